"""Whole episodes: the trajectory assembler, its arguments, seeded groups, trajectory splits and renames."""

__all__: list[str] = []
