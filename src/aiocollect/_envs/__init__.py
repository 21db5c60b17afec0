"""Environments: the env protocol, the gymnasium adapter, spaces."""

__all__: list[str] = []
