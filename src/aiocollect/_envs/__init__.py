"""Environments: the env protocol, the gymnasium adapter, spaces."""
