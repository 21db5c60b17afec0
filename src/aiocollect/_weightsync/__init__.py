"""Weight-sync schemes: shared memory, pipe and torch.distributed broadcast."""

__all__: list[str] = []
