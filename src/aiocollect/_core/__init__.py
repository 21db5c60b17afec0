"""The base layer: errors, options and their checks, restart policies, seeds and RNG, process ids, signals,
resume carries, and small helpers every other layer uses."""

__all__: list[str] = []
