"""The one collector over several members, whatever transport carries their batches."""

__all__: list[str] = []
