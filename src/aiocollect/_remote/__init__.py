"""Collectors hosted on other processes or machines: ``torch.distributed`` nodes
(:class:`DistributedCollector`, :class:`DistributedSyncCollector`), ``torch.distributed.rpc`` nodes
(:class:`RPCCollector`) and Ray actors (:class:`RayCollector`), and the launchers that start the nodes.

One hosted-collector core (``_node``) runs on every node and actor; the trainer side is one base
(``_nodes``, ``_trainer``); the engines (``_gloo``, ``_rpc``, ``_ray``) only carry batches, weights and the
typed control operations of ``_messages``."""

__all__: list[str] = []
