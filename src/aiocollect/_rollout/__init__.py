"""The rollout core: the synchronous hot loop, its per-batch work, its storage and its thread."""

__all__: list[str] = []
