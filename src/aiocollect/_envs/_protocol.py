"""The env protocol: what the collectors need from an environment.

Any object with these members works as an env (no base class needed). :class:`aiocollect.GymEnv` is the
reference implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from gymnasium import spaces
    from tensordict import TensorDict

__all__ = ["EnvProtocol"]


@runtime_checkable
class EnvProtocol(Protocol):
    """The members an environment must have to be collected from.

    * ``batch_size``: ``torch.Size([])`` for one env, ``torch.Size([N])`` for ``N`` envs stepped together.
    * ``observation_space`` / ``action_space``: gymnasium spaces of **one** env (Box, Discrete,
      MultiDiscrete, MultiBinary; a Dict gives one key per entry, a Dict or Tuple action one key per leaf).
    * ``reset(td=None)``: returns a TensorDict of ``batch_size`` with the observation keys. When ``td``
      holds a boolean ``"_reset"`` entry of shape ``[*batch_size, 1]``, only those sub-envs are reset
      (the others keep their current observation).
    * ``step(td)``: reads ``td["action"]`` and returns a TensorDict of ``batch_size`` holding a
      ``"next"`` sub-TensorDict with the observation keys, ``"reward"`` (float32, trailing dim 1),
      ``"done"``, ``"terminated"`` and ``"truncated"`` (bool, trailing dim 1). The collector calls
      ``reset`` (with a ``"_reset"`` mask for batched envs) after an episode ends.
    * ``set_seed(seed) -> int``: seeds the next reset and returns the last seed used, so several envs can
      be seeded in a chain (the next env gets ``returned + 1``).
    * ``close()``.

    Optional: ``has_truncated`` (default ``True``); an env that never truncates sets it to ``False`` and
    ``set_truncated=True`` is then refused. ``get_state()`` / ``set_state(state)``: the env's own state as
    tensors, numpy arrays, Python scalars, lists and dicts, for checkpoints that resume exactly
    (``state_dict(envs=True)``, see docs/long-runs.md). Agent groups (multi-agent keys, as TorchRL lays them
    out): a ``Dict`` action space whose leaves are all named ``"action"`` is written at ``(group, "action")``;
    ``reward_space`` and ``done_space`` (``Dict`` spaces) name the per-agent rewards and done flags of
    ``step()``'s ``"next"`` (see docs/policies.md, "Multi-agent keys"). In ``step``'s ``"next"``,
    ``"truncated"`` may be left out (never truncated) and ``"terminated"`` too when ``"done"`` is there (done
    means terminated).

    The collectors read such an env's tensors once per step and copy them (converted to the dtypes of
    the observation space), so an env may return tensors it updates in place later. This is the slow
    path (one TensorDict per step); :class:`aiocollect.GymEnv` works on arrays directly.

    Example:
        >>> from aiocollect import EnvProtocol, GymEnv
        >>> isinstance(GymEnv("CartPole-v1"), EnvProtocol)
        True
    """

    @property
    def batch_size(self) -> torch.Size: ...

    @property
    def observation_space(self) -> spaces.Space[Any]: ...

    @property
    def action_space(self) -> spaces.Space[Any]: ...

    def reset(self, td: TensorDict | None = None) -> TensorDict: ...

    def step(self, td: TensorDict) -> TensorDict: ...

    def set_seed(self, seed: int) -> int: ...

    def close(self) -> None: ...
