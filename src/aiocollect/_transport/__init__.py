"""Transport: how bytes and messages move between the trainer and its workers, nodes and actors.

``_flat`` (one flat-buffer codec for TensorDicts), ``_waiters`` (the request/reply waiter table),
``_groups`` (private torch.distributed process groups and stores), ``_wire`` (the framed control channel
and its messages) and ``_shm`` (shared-memory segments). Lower layers only: envs, policies, base utilities.
"""

__all__: list[str] = []
