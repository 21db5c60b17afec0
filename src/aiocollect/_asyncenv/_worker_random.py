"""``init_random_frames`` in a ``MultiAsyncEnvCollector`` worker: its first actions are drawn uniformly from
the action space instead of by the policy, and the policy's other outputs are zeros in those frames, as in
the other collectors' random frames. The frames carry the policy version of the moment, as theirs do."""

from __future__ import annotations

from typing import Any

import torch
from gymnasium import spaces

from .._envs._spaces import NestedKey
from .._policies._runners import RandomPolicy
from ._policy import BatchPolicy

__all__ = ["RandomFirst"]


class RandomFirst:
    """Wraps what the engine calls on each batch of ready envs: the first ``actions`` env actions are
    random (a call that crosses the count gets random actions in its first rows), then the policy's.

    The policy is called at the first call (its outputs say the keys, shapes and dtypes every call has)
    and whenever a call is not all random; draws run in the policy thread (on the loop for an async
    policy, which has none).

    Example:
        >>> from gymnasium.spaces import Discrete
        >>> RandomFirst(None, Discrete(2), actions=8, seed=0).left
        8
    """

    def __init__(
        self, policy: BatchPolicy, action_space: spaces.Space[Any], *, actions: int, seed: int | None
    ) -> None:
        self.policy = policy
        self.left = actions
        self.random = RandomPolicy(action_space, seed=seed)
        self._template: dict[NestedKey, tuple[tuple[int, ...], torch.dtype]] | None = None

    async def __call__(self, obs: dict[NestedKey, torch.Tensor], n: int) -> dict[NestedKey, torch.Tensor]:
        k = min(self.left, n)
        if k == 0:
            return await self.policy(obs, n)
        self.left -= k
        if self._template is None or k < n:
            out = await self.policy(obs, n)
            if self._template is None:
                self._template = {key: (tuple(v.shape[1:]), v.dtype) for key, v in out.items()}
        else:  # all random: no policy call
            out = {
                key: torch.zeros((n, *shape), dtype=dtype) for key, (shape, dtype) in self._template.items()
            }
        if self.policy.is_async:  # no policy thread: a draw is cheap
            draws = self.random.sample_entries((k,))
        else:
            draws = await self.policy.in_thread(lambda: self.random.sample_entries((k,)))
        return {key: _first_rows(value, draws.get(key), k) for key, value in out.items()}


def _first_rows(value: torch.Tensor, draw: torch.Tensor | None, k: int) -> torch.Tensor:
    """``value`` with its first ``k`` rows replaced by ``draw`` (zeros where the random policy drew
    nothing: the policy's other outputs)."""
    shape = (k, *value.shape[1:])
    if draw is None:
        head = torch.zeros(shape, dtype=value.dtype, device=value.device)
    else:
        head = draw.reshape(shape).to(dtype=value.dtype, device=value.device)
    return head if k == value.shape[0] else torch.cat([head, value[k:]])
