"""``ProcessVectorEnv``: gymnasium envs stepped in worker processes behind the async vector env protocol,
their observations, rewards, flags and actions in shared memory (central inference: one policy, in the
trainer, batching the envs of every worker)."""

from ._env import ProcessVectorEnv

__all__ = ["ProcessVectorEnv"]
