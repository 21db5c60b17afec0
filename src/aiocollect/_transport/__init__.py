"""Transport: how bytes and messages move between the trainer and its workers, nodes and actors.

``_flat`` (one flat-buffer codec for TensorDicts), ``_waiters`` (the request/reply waiter table),
``_groups`` (private torch.distributed process groups and stores), ``_wire`` (the framed control channel),
``_messages`` (its messages and the typed worker operations) and ``_shm`` (shared-memory segments).
Imports only lower layers: envs, policies, base utilities.
"""

__all__: list[str] = []
