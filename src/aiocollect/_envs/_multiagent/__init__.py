"""Multi-agent envs with TorchRL's agent-group layout: ``PettingZooEnv`` (parallel and turn-based) and
``VmasEnv``; their libraries are the ``multiagent`` extra, imported when an env is made."""

__all__: list[str] = []
