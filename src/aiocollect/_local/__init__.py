"""Collectors in this process: the lifecycle every collector shares (``_base.CollectorBase``) and the
single-process ``Collector``."""

__all__: list[str] = []
