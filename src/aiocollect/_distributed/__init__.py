"""Distributed collectors on existing engines: Ray (:class:`RayCollector`), ``torch.distributed``
(:class:`DistributedCollector`, :class:`DistributedSyncCollector`), ``torch.distributed.rpc``
(:class:`RPCCollector`), and the launchers that start their nodes (``multiprocessing``, submitit, and the
delayed submitit launcher)."""
