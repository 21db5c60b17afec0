"""``VmasEnv``: VMAS's torch-batched multi-agent simulator behind the env protocol, with TorchRL's ``VmasEnv``
layout, without torchrl.

VMAS steps ``num_envs`` worlds at once in torch (on the CPU or a GPU). Each step's tensors are stacked per
group on the simulator's device and copied into the env's preallocated CPU frame (one copy per entry;
none past the stacking on the CPU, where a frame's numpy arrays and torch tensors share memory). vmas is
optional (the ``multiagent`` extra): it is imported when an env is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from .._gym import ArrayStep
from .._spaces import LeafSpec, NestedKey, action_bounds, action_outside_space
from ._base import Frame, GroupedEnv
from ._pettingzoo import import_extra
from ._spec import GroupLayout, GroupMapArg, default_group_map, group_map_arg

__all__ = ["VmasEnv"]


class VmasEnv(GroupedEnv):
    """A VMAS scenario, ``num_envs`` worlds simulated together (batch size ``[num_envs]``).

    Args:
        scenario: a VMAS scenario name (``"balance"``, ``"navigation"``, ...) or a ``BaseScenario``.
        num_envs: the number of worlds.
        device: where VMAS simulates (``"cpu"``, ``"cuda"``); batches are stored on the CPU.
        continuous_actions: ``Box`` actions; ``False``: discrete ones (an index per agent).
        max_steps: the horizon: an episode that reaches it is ``truncated`` (``None``: no horizon).
        group_map: ``None`` groups agents named ``<name>_<int>`` by ``<name>`` (all agents in ``"agents"``
            when one does not follow the convention, or when there is one group ``"agent"``), ``"all"``,
            ``"per_agent"``, or ``{group: [agent, ...]}``.
        seed: the simulator's seed (``set_seed`` seeds it again).
        **scenario_kwargs: passed to the scenario (``n_agents=4``, ...).

    Per group ``g``: ``(g, "observation")`` (nested keys for a ``Dict`` observation), ``(g, "action")``,
    ``(g, "info", key)`` for the scenario's info entries (float32) and ``("next", g, "reward")``, each
    ``[num_envs, n_agents, ...]``; the root ``"done"``, ``"terminated"`` and ``"truncated"``.

    Example:
        >>> env = VmasEnv("balance", num_envs=8, seed=0)
        >>> env.group_map
        {'agents': ['agent_0', 'agent_1', 'agent_2']}
        >>> env.reset()["agents", "observation"].shape
        torch.Size([8, 3, 16])
        >>> env.close()
    """

    def __init__(
        self,
        scenario: Any,
        *,
        num_envs: int,
        device: str | torch.device = "cpu",
        continuous_actions: bool = True,
        max_steps: int | None = None,
        group_map: GroupMapArg = None,
        seed: int | None = None,
        **scenario_kwargs: Any,
    ) -> None:
        vmas = import_extra("vmas", "VmasEnv")
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.device = torch.device(device)
        self._env = vmas.make_env(
            scenario,
            num_envs=num_envs,
            device=self.device,
            continuous_actions=continuous_actions,
            max_steps=max_steps,
            seed=seed,
            terminated_truncated=True,
            **scenario_kwargs,
        )
        env = self._env
        names = [agent.name for agent in env.agents]
        default = default_group_map(names, fallback="agents")
        if list(default) == ["agent"]:  # TorchRL's name for one group of agents
            default = {"agents": default["agent"]}
        grouping = group_map_arg(group_map, names, default)
        index = {name: i for i, name in enumerate(names)}
        self.groups = {}
        for g, members in grouping.items():
            ids = [index[a] for a in members]
            obs = [gymnasium_space(env.observation_space[i]) for i in ids]
            acts = [gymnasium_space(env.action_space[i]) for i in ids]
            info = _info_specs(env.scenario.info(env.agents[ids[0]]), num_envs)
            self.groups[g] = GroupLayout.of(g, list(members), obs, acts, info=info, flags=False)
        self._ids = {g: [index[a] for a in lay.agents] for g, lay in self.groups.items()}
        self._batch_shape = (num_envs,)
        self._init_specs()
        self._next, self._root = self._frames(num_envs)
        self._bounds: dict[NestedKey, Any] = {
            (g, "action"): action_bounds(lay.action_space()) for g, lay in self.groups.items()
        }
        self._last: Frame | None = None

    @property
    def env(self) -> Any:
        """The VMAS ``Environment``."""
        return self._env

    def set_seed(self, seed: int) -> int:
        """Seed the simulator (its own random state: VMAS keeps it apart from the global ones)."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self._env.seed(seed)
        return seed

    def close(self) -> None:
        viewer = getattr(self._env, "viewer", None)
        if viewer is not None:
            viewer.close()

    def __repr__(self) -> str:
        scenario = type(self._env.scenario).__name__
        n = self._batch_shape[0]
        return f"VmasEnv({scenario}, groups={self.group_map}, num_envs={n}, device={self.device})"

    # -- the array interface (ArrayEnv) ---------------------------------------------------------------
    def _reset_arrays(self, mask: np.ndarray | None = None) -> dict[NestedKey, np.ndarray]:
        env = self._env
        rows = None if mask is None or self._last is None else np.flatnonzero(np.asarray(mask).reshape(-1))
        if rows is None or len(rows) == env.num_envs:
            env.reset(return_observations=False)
        else:
            for row in rows:
                env.reset_at(int(row), return_observations=False)
        self._observe(self._root, rows)
        self._last = self._root
        return self._root.arrays

    def _observe(self, frame: Frame, rows: np.ndarray | None) -> None:
        """The scenario's observations and infos into ``frame`` (only ``rows``: the others keep theirs)."""
        obs, infos = self._env.get_from_scenario(
            get_observations=True, get_rewards=False, get_infos=True, get_dones=False
        )
        if rows is not None and self._last is not None and self._last is not frame:
            for key, value in frame.arrays.items():
                np.copyto(value, self._last.arrays[key])
        self._write(frame.arrays, obs, infos, None, rows)

    def _write(
        self,
        arrays: Mapping[NestedKey, np.ndarray],
        obs: list[Any],
        infos: list[Any],
        rewards: Any,
        rows: Any,
    ) -> None:
        for g, lay in self.groups.items():
            ids = self._ids[g]
            for key, (own, _) in lay.obs_keys().items():
                _put(arrays[key], [_get(obs[i], own) for i in ids], rows)
            for name in lay.info or {}:
                _put(arrays[(g, "info", name)], [_column(infos[i][name]) for i in ids], rows)
            if rewards is not None:
                _put(arrays[(g, "reward")], [_column(rewards[i]) for i in ids], rows)

    def _step_arrays(self, action: Mapping[NestedKey, Any]) -> ArrayStep:
        if self._last is None:
            raise RuntimeError("VmasEnv.step() called before reset()")
        env = self._env
        per_agent: list[Any] = [None] * env.n_agents
        for g, ids in self._ids.items():
            value = self._action((g, "action"), action[(g, "action")])
            for j, i in enumerate(ids):
                per_agent[i] = value[:, j]
        obs, rewards, terminated, truncated, infos = env.step(per_agent)
        self._write(self._next.arrays, obs, infos, rewards, None)
        terminated = terminated.reshape(-1).cpu().numpy()
        truncated = (truncated.reshape(-1).cpu().numpy()) & ~terminated
        done = terminated | truncated
        root = None
        if done.any():
            self._last = self._next  # the worlds not reset keep the step's observations
            self._reset_arrays(done)
            root = self._root
        self._last = self._next if root is None else root
        return self._result(self._next, root, terminated, truncated)

    def _action(self, key: NestedKey, value: Any) -> torch.Tensor:
        tensor = torch.as_tensor(value).reshape((*self._batch_shape, *self.action_specs[key].shape))
        bounds = self._bounds[key]
        if bounds is not None:
            array = tensor.numpy(force=True)
            if (array < bounds[0]).any() or (array > bounds[1]).any():
                raise action_outside_space(self.groups[key[0]].action_space(), array, key)
        return tensor.to(self.device)


def _get(obs: Any, key: NestedKey) -> Any:
    for part in () if isinstance(obs, torch.Tensor) else (key,) if isinstance(key, str) else key:
        obs = obs[part]
    return obs


def _column(value: torch.Tensor) -> torch.Tensor:
    """A per-env value ``[N]`` as ``[N, 1]`` (TorchRL's ``_selective_unsqueeze``)."""
    return value.unsqueeze(-1) if value.ndim == 1 else value


def _put(target: np.ndarray, values: list[torch.Tensor], rows: Any) -> None:
    """``target[:, j] = values[j]`` for the agents of a group (``rows``: those envs only)."""
    stacked = torch.stack(values, dim=1).detach()
    out = torch.from_numpy(target)
    if rows is None:
        out.copy_(stacked.reshape(out.shape))
    else:
        index = torch.as_tensor(rows)
        out[index] = stacked.reshape(out.shape)[index.to(stacked.device)].to(out.device, out.dtype)


def gymnasium_space(space: Any) -> spaces.Space[Any]:
    """A VMAS space (``gym``'s, the pre-gymnasium package) as the gymnasium space it stands for."""
    kind = type(space).__name__
    if kind == "Box":
        return spaces.Box(space.low, space.high, space.shape, space.dtype)
    if kind == "Discrete":
        return spaces.Discrete(int(space.n))
    if kind == "MultiDiscrete":
        return spaces.MultiDiscrete(space.nvec)
    if kind == "Dict":
        return spaces.Dict({k: gymnasium_space(v) for k, v in space.spaces.items()})
    raise TypeError(f"unsupported VMAS space {space!r} ({kind}): Box, Discrete, MultiDiscrete and Dict are")


def _info_specs(info: Mapping[str, Any], num_envs: int) -> dict[str, LeafSpec]:
    out = {}
    for name, value in info.items():
        tensor = _column(torch.as_tensor(value))
        out[name] = LeafSpec(tuple(tensor.shape[1:]), torch.float32)
    return out
