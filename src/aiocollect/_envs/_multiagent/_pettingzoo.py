"""``PettingZooEnv``: PettingZoo's parallel and turn-based (AEC) envs behind the env protocol, with TorchRL's
multi-agent layout (``torchrl.envs.PettingZooWrapper``'s keys, shapes and dtypes).

pettingzoo is optional (the ``multiagent`` extra): it is imported when an env is wrapped, never by
``import aiocollect``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from .._gym import ArrayStep
from .._spaces import LeafSpec, NestedKey, action_bounds, action_outside_space, leaf_spec
from ._agents import AgentSlot, agent_slots
from ._base import Frame, GroupedEnv
from ._pz_copies import ParallelCopy, TurnCopy
from ._spec import GroupLayout, GroupMapArg, default_group_map, group_map_arg

__all__ = ["INSTALL", "PettingZooEnv", "import_extra"]

INSTALL = 'pip install "aiocollect[multiagent]"'


def import_extra(module: str, owner: str) -> Any:
    """``import module``, or an ImportError naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{owner} needs {module}: {INSTALL}") from exc


class PettingZooEnv(GroupedEnv):
    """A PettingZoo env (or ``num_envs`` copies stepped as one batched env) with TorchRL's multi-agent keys.

    Args:
        env: a ``pettingzoo.ParallelEnv`` or ``pettingzoo.AECEnv`` (turn-based), or a callable returning
            one (needed for ``num_envs``: each copy is made by a call).
        num_envs: step that many copies as one env of batch size ``[num_envs]``; ``None``: one env, batch
            size ``[]``.
        group_map: how agents are grouped (stacked along an agent dim): ``None`` groups agents named
            ``<name>_<int>`` by ``<name>`` in a parallel env (``simple_adversary``: ``"adversary"``,
            ``"agent"``) and puts each agent in a group of its own in a turn-based one (as TorchRL does);
            ``"all"`` (one group ``"agents"``), ``"per_agent"``, or ``{group: [agent, ...]}``.
        use_mask: a ``(group, "mask")`` entry, False for agents that do not act: those that left the
            episode (their entries are zeros until the env resets) and, in a turn-based env, those whose
            turn it is not. Default: True for turn-based envs (required there), False for parallel ones.
        done_on_any: the episode ends as soon as one agent is done; default: for a parallel env without
            ``use_mask`` (its agents cannot go on without one), else when every agent is done.
        return_state: a ``"state"`` entry (``env.state()``, for centralised critics); default: where the env
            has one.
        seed: the seed of the first reset; copy ``i`` is seeded with ``seed + i`` (``set_seed`` likewise).

    Per group ``g``: ``(g, "observation")`` (nested keys for a ``Dict`` observation), ``(g, "action")``,
    ``(g, "action_mask")`` where the agents' observations (or infos) carry an ``"action_mask"``, ``(g,
    "mask")`` with ``use_mask``, ``(g, "info", key)`` for the numeric entries of the reset info, ``("next", g,
    "reward")`` and ``(g, "done" | "terminated" | "truncated")``, each ``[*batch, n_agents, ...]``; the env's
    own flags at the root. A discrete action is an index (TorchRL's ``categorical_actions=True``).

    Example:
        >>> from mpe2 import simple_spread_v3
        >>> env = PettingZooEnv(lambda: simple_spread_v3.parallel_env(max_cycles=25), num_envs=4, seed=0)
        >>> env.group_map
        {'agent': ['agent_0', 'agent_1', 'agent_2']}
        >>> td = env.reset()
        >>> td["agent", "observation"].shape, td["state"].shape
        (torch.Size([4, 3, 18]), torch.Size([4, 54]))
        >>> env.close()
    """

    def __init__(
        self,
        env: Any,
        *,
        num_envs: int | None = None,
        group_map: GroupMapArg = None,
        use_mask: bool | None = None,
        done_on_any: bool | None = None,
        return_state: bool | None = None,
        seed: int | None = None,
    ) -> None:
        pettingzoo = import_extra("pettingzoo", "PettingZooEnv")
        if num_envs is not None and (
            isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1
        ):
            raise ValueError(f"num_envs must be a positive int or None, got {num_envs!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        kinds = (pettingzoo.ParallelEnv, pettingzoo.AECEnv)
        envs = _open(env, num_envs, kinds)
        try:
            odd = [type(e).__name__ for e in envs if not isinstance(e, kinds)]
            if odd:
                raise TypeError(f"env made {odd[0]}, not a pettingzoo ParallelEnv or AECEnv")
            self._envs = envs
            self._init(
                envs[0],
                isinstance(envs[0], pettingzoo.ParallelEnv),
                group_map,
                use_mask,
                done_on_any,
                return_state,
            )
        except BaseException:
            for e in envs:
                if isinstance(e, kinds):
                    e.close()
            raise
        self._batch_shape = () if num_envs is None else (num_envs,)
        self._seed = seed
        self._init_specs()
        copy = ParallelCopy if self.parallel else TurnCopy
        self._copies = [
            copy(
                e,
                self._slots,
                use_mask=self._use_mask,
                done_on_any=self._done_on_any,
                state=self._state_spec is not None,
            )
            for e in envs
        ]
        self._next, self._root = self._frames(len(envs))
        self._bounds: dict[NestedKey, Any] = {
            (g, "action"): action_bounds(lay.action_space()) for g, lay in self.groups.items()
        }
        self._actions: dict[str, np.ndarray] = {}
        self._last: Frame | None = None  # the frame last handed out (the observations to act on)

    def _init(
        self,
        env: Any,
        parallel: bool,
        group_map: GroupMapArg,
        use_mask: bool | None,
        done_on_any: bool | None,
        state: bool | None,
    ) -> None:
        self.parallel = parallel
        if use_mask is None:
            use_mask = not parallel
        if not parallel and not use_mask:
            raise ValueError(
                "a turn-based (AEC) env needs use_mask=True: only the agent to act has mask True"
            )
        self._use_mask = bool(use_mask)
        self._done_on_any = (parallel and not use_mask) if done_on_any is None else bool(done_on_any)
        agents = list(env.possible_agents)
        default = default_group_map(agents) if parallel else {a: [a] for a in agents}
        grouping = group_map_arg(group_map, agents, default)
        infos = self._first_infos(env)
        mask_from: dict[str, str | None] = {}
        self.groups = {}
        for g, members in grouping.items():
            obs = [env.observation_space(a) for a in members]
            masked = [isinstance(s, spaces.Dict) and "action_mask" in s.spaces for s in obs]
            source = (
                "obs"
                if all(masked)
                else "info"
                if all("action_mask" in infos.get(a, {}) for a in members)
                else None
            )
            mask_from[g] = source
            if source == "obs":
                obs = [spaces.Dict({k: v for k, v in s.spaces.items() if k != "action_mask"}) for s in obs]
            acts = [env.action_space(a) for a in members]
            mask = None
            if source is not None:
                mask = LeafSpec(
                    (int(acts[0].n),)
                    if isinstance(acts[0], spaces.Discrete)
                    else np.shape(infos[members[0]].get("action_mask")),
                    torch.bool,
                )
            info = _info_specs(infos.get(members[0], {}))
            self.groups[g] = GroupLayout.of(
                g, members, obs, acts, action_mask=mask, use_mask=self._use_mask, info=info
            )
        self._slots: dict[str, AgentSlot] = agent_slots(self.groups, mask_from)
        self._state_spec = _state_spec(env, parallel) if state is not False else None
        if state and self._state_spec is None:
            raise ValueError(f"return_state=True but {type(env).__name__} has no state(): drop return_state")

    @staticmethod
    def _first_infos(env: Any) -> dict[str, Any]:
        """The reset infos (the env is reset once to read which info entries and masks it has)."""
        out = env.reset()
        return dict(out[1]) if isinstance(out, tuple) else dict(env.infos)  # parallel: (obs, infos)

    # -- the protocol's members besides GroupedEnv's ---------------------------------------------------
    @property
    def envs(self) -> list[Any]:
        """The wrapped PettingZoo envs (one per copy)."""
        return list(self._envs)

    def set_seed(self, seed: int) -> int:
        """Seed the next reset (copy ``i`` gets ``seed + i``); returns the last seed used."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self._seed = seed
        return seed + len(self._envs) - 1

    def close(self) -> None:
        for env in self._envs:
            env.close()

    def __repr__(self) -> str:
        kind = "parallel" if self.parallel else "turn-based"
        name = type(self._envs[0]).__name__
        return f"PettingZooEnv({name}, {kind}, groups={self.group_map}, batch_size={list(self._batch_shape)})"

    # -- the array interface (ArrayEnv) ---------------------------------------------------------------
    def _reset_arrays(self, mask: np.ndarray | None = None) -> dict[NestedKey, np.ndarray]:
        seed, self._seed = self._seed, None
        return self._reset_rows(
            mask, None if seed is None else [seed + row for row in range(len(self._envs))]
        )

    def _check_reset_seeded(self) -> None:
        """Every copy resets with a seed of its own (``group_size``, ``on_update="restart"``)."""

    def _reset_seeded(self, mask: np.ndarray | None, seeds: np.ndarray) -> dict[NestedKey, np.ndarray]:
        """Reset the copies in ``mask`` (all: ``None``), copy ``i`` with ``seeds[i]``."""
        self._seed = None
        return self._reset_rows(mask, [int(s) for s in np.asarray(seeds).reshape(-1)])

    def _reset_rows(self, mask: np.ndarray | None, seeds: list[int] | None) -> dict[NestedKey, np.ndarray]:
        root, last = self._root, self._last
        if mask is None or last is None:
            rows = list(range(len(self._envs)))
        else:
            rows = [int(r) for r in np.flatnonzero(np.asarray(mask).reshape(-1))]
            if last is not root:  # the sub-envs not reset keep their observations
                for key, value in root.arrays.items():
                    np.copyto(value, last.arrays[key])
        for row in rows:
            self._clear(root.arrays, row)
            self._copies[row].reset(root.arrays, row, None if seeds is None else seeds[row])
        self._last = root
        return root.view(bool(self._batch_shape))

    def _clear(self, arrays: Mapping[NestedKey, np.ndarray], row: int) -> None:
        for key in self.group_flag_keys:
            arrays[key][row] = False

    def _step_arrays(self, action: Mapping[NestedKey, Any]) -> ArrayStep:
        if self._last is None:
            raise RuntimeError("PettingZooEnv.step() called before reset()")
        self._actions = {key[0]: self._action(key, action[key]) for key in self.action_specs}
        nxt = self._next.arrays
        n = len(self._envs)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        for row, copy in enumerate(self._copies):
            terminated[row], truncated[row] = copy.step(nxt, row, self._agent_action)
        done = terminated | truncated
        root = None
        if done.any():
            root = self._root
            for key, value in root.arrays.items():
                np.copyto(value, nxt[key])
            for row in np.flatnonzero(done).tolist():
                self._clear(root.arrays, row)
                self._copies[row].reset(root.arrays, row, None)
        self._last = self._next if root is None else root
        return self._result(self._next, root, terminated, truncated)

    def _action(self, key: NestedKey, value: Any) -> np.ndarray:
        """A group's actions as ``[copies, n_agents, ...]`` numpy, integer ones checked against the space."""
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        spec = self.action_specs[key]
        array = array.reshape((len(self._envs), *spec.shape))
        bounds = self._bounds[key]
        if bounds is not None and ((array < bounds[0]).any() or (array > bounds[1]).any()):
            raise action_outside_space(self.groups[key[0]].action_space(), array, key)
        return array

    def _agent_action(self, slot: AgentSlot, row: int) -> Any:
        value = self._actions[slot.group][row, slot.index]
        return int(value) if value.ndim == 0 else value


def _open(env: Any, num_envs: int | None, kinds: tuple[type, ...]) -> list[Any]:
    """The env copies: ``env`` itself, or ``num_envs`` calls of it."""
    if isinstance(env, kinds):
        if num_envs not in (None, 1):
            raise TypeError(
                f"num_envs={num_envs} steps that many copies of the env: pass a callable that makes one "
                "(e.g. lambda: simple_spread_v3.parallel_env()), not an env"
            )
        return [env]
    if callable(env):
        return [env() for _ in range(num_envs or 1)]
    raise TypeError(f"env must be a pettingzoo ParallelEnv or AECEnv, or a callable making one; got {env!r}")


def _info_specs(info: Mapping[str, Any]) -> dict[str, LeafSpec]:
    """The numeric entries of an agent's reset info (float32, as TorchRL's ``Unbounded`` specs)."""
    out = {}
    for name, value in info.items():
        if name == "action_mask" or isinstance(value, (Mapping, str)):
            continue
        arr = np.asarray(value)
        if arr.dtype.kind in "biuf":
            out[name] = LeafSpec(tuple(arr.shape), torch.float32)
    return out


def _state_spec(env: Any, parallel: bool) -> LeafSpec | None:
    """The spec of ``env.state()`` (the env was reset), or None where it has none."""
    try:
        value = env.state()
    except (NotImplementedError, AttributeError):
        return None
    space = getattr(env, "state_space", None)
    if isinstance(space, spaces.Space):
        return leaf_spec(space, what="state")
    arr = np.asarray(value)
    return LeafSpec(tuple(arr.shape), torch.from_numpy(np.empty((), arr.dtype)).dtype)
