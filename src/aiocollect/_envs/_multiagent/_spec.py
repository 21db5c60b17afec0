"""Agent groups laid out as TorchRL lays them out: group maps, per-agent spaces stacked along an agent dim,
and the specs of a group's batch entries.

A group ``g`` of ``n`` agents whose spaces are equal gives ``(g, "observation")`` (nested keys for a ``Dict``
observation), ``(g, "action")``, ``(g, "reward")`` and the done flags, each with the agent dim first
(``[n, ...]`` per env), as ``torchrl.envs.PettingZooWrapper`` and ``VmasEnv`` make them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from .._spaces import LeafSpec, NestedKey, action_specs, leaf_spec, observation_specs

__all__ = [
    "FLAGS",
    "GroupLayout",
    "GroupMapArg",
    "default_group_map",
    "group_map_arg",
    "masked_choice",
    "stack_space",
]

#: a group map: ``None`` (the default grouping), ``"all"``, ``"per_agent"`` or ``{group: [agent, ...]}``
GroupMapArg = str | Mapping[str, Sequence[str]] | None

FLAGS = ("done", "terminated", "truncated")


def default_group_map(agents: Sequence[str], *, fallback: str | None = None) -> dict[str, list[str]]:
    """Agents named ``<name>_<int>`` grouped by ``<name>`` (``simple_adversary``: ``"adversary"``,
    ``"agent"``); any other agent in a group of its own, or, with ``fallback``, every agent in one group of
    that name as soon as one agent does not follow the convention (VMAS's rule).

    Example:
        >>> default_group_map(["adversary_0", "agent_0", "agent_1"])
        {'adversary': ['adversary_0'], 'agent': ['agent_0', 'agent_1']}
    """
    out: dict[str, list[str]] = {}
    for agent in agents:
        name, sep, index = agent.rpartition("_")
        if not (sep and name and index.isdigit()):
            if fallback is not None:
                return {fallback: list(agents)}
            name = agent
        out.setdefault(name, []).append(agent)
    return out


def group_map_arg(
    group_map: GroupMapArg, agents: Sequence[str], default: dict[str, list[str]]
) -> dict[str, list[str]]:
    """The checked group map: every agent in exactly one group, group names usable as keys."""
    if group_map is None:
        return default
    if group_map == "all":
        return {"agents": list(agents)}
    if group_map == "per_agent":
        return {agent: [agent] for agent in agents}
    if isinstance(group_map, str) or not isinstance(group_map, Mapping):
        raise ValueError(
            f"group_map must be None, 'all', 'per_agent' or a dict {{group: [agent, ...]}}, got {group_map!r}"
        )
    out = {}
    for group, members in group_map.items():
        if not isinstance(group, str) or not group or "." in group or group in ("next", "collector"):
            raise ValueError(
                f"group_map: group name {group!r} cannot be a batch key (a non-empty str without '.', not "
                "'next' or 'collector')"
            )
        if isinstance(members, str) or not isinstance(members, Sequence) or not members:
            raise ValueError(f"group_map[{group!r}] must be a non-empty list of agent names, got {members!r}")
        out[group] = list(members)
    placed = [agent for members in out.values() for agent in members]
    twice = sorted({a for a in placed if placed.count(a) > 1})
    unknown = sorted(set(placed) - set(agents))
    missing = [a for a in agents if a not in placed]
    if twice or unknown or missing:
        wrong = {"twice": twice, "unknown": unknown, "missing": missing}
        said = "; ".join(f"{what}: {names}" for what, names in wrong.items() if names)
        raise ValueError(
            f"group_map must place each of the env's agents {list(agents)} in exactly one group ({said})"
        )
    return out


def stack_space(space: spaces.Space[Any], n: int) -> spaces.Space[Any]:
    """The space of ``n`` agents' values stacked along a first (agent) dim: ``Discrete(k)`` becomes
    ``MultiDiscrete([k] * n)``, ``Box(shape)`` ``Box((n, *shape))``, a ``Dict`` its entries stacked."""
    if isinstance(space, spaces.Box):
        low = np.broadcast_to(space.low, (n, *space.shape)).copy()
        high = np.broadcast_to(space.high, (n, *space.shape)).copy()
        return spaces.Box(low, high, (n, *space.shape), space.dtype)
    if isinstance(space, spaces.Discrete):
        return spaces.MultiDiscrete([int(space.n)] * n, start=[int(space.start)] * n)
    if isinstance(space, spaces.MultiDiscrete):
        nvec = np.broadcast_to(space.nvec, (n, *space.shape)).copy()
        start = np.broadcast_to(space.start, (n, *space.shape)).copy()
        return spaces.MultiDiscrete(nvec, start=start)
    if isinstance(space, spaces.MultiBinary):
        return spaces.MultiBinary((n, *np.atleast_1d(space.n).tolist()))
    if isinstance(space, spaces.Dict):
        return spaces.Dict({k: stack_space(v, n) for k, v in space.spaces.items()})
    leaf_spec(space, what="agent")  # raises, naming the space
    raise AssertionError("unreachable")


def _same(
    spaces_: Sequence[spaces.Space[Any]], group: str, agents: Sequence[str], what: str
) -> spaces.Space[Any]:
    first = spaces_[0]
    odd = [a for a, s in zip(agents, spaces_, strict=True) if s != first]
    if odd:
        raise TypeError(
            f"the agents of group {group!r} have different {what} spaces ({agents[0]}: {first}; "
            f"{odd[0]}: {spaces_[agents.index(odd[0])]}): agents stacked in one group need equal spaces. "
            "Put them in groups of their own (group_map='per_agent', or a dict {group: [agent, ...]})"
        )
    return first


def _prefixed(prefix: tuple[str, ...], key: NestedKey) -> tuple[str, ...]:
    return (*prefix, key) if isinstance(key, str) else (*prefix, *key)


@dataclass
class GroupLayout:
    """One group's entries: its agents, the stacked spaces and the specs (agent dim first) of its keys."""

    name: str
    agents: list[str]
    obs_space: spaces.Space[Any]  # one agent's, without an action mask
    act_space: spaces.Space[Any]  # one agent's
    action_mask: LeafSpec | None = None  # an action mask of the agents' (from observations or infos)
    use_mask: bool = False
    info: Mapping[str, LeafSpec] | None = None  # info entries of one agent's
    flags: bool = True  # the group's done / terminated / truncated flags (PettingZoo's; not VMAS's)

    @classmethod
    def of(
        cls,
        name: str,
        agents: list[str],
        obs_spaces: Sequence[spaces.Space[Any]],
        act_spaces: Sequence[spaces.Space[Any]],
        **kwargs: Any,
    ) -> GroupLayout:
        obs = _same(obs_spaces, name, agents, "observation")
        act = _same(act_spaces, name, agents, "action")
        return cls(name, agents, obs, act, **kwargs)

    @property
    def n(self) -> int:
        return len(self.agents)

    @property
    def plain_obs(self) -> bool:
        """The observation is one array (not a ``Dict``)."""
        return not isinstance(self.obs_space, spaces.Dict)

    def obs_keys(self) -> dict[NestedKey, tuple[NestedKey, LeafSpec]]:
        """``{batch key: (the agent observation's own key, spec with the agent dim)}``."""
        out: dict[NestedKey, tuple[NestedKey, LeafSpec]] = {}
        for key, spec in observation_specs(self.obs_space).items():
            batch_key = (
                (self.name, "observation") if self.plain_obs else _prefixed((self.name, "observation"), key)
            )
            out[batch_key] = (key, LeafSpec((self.n, *spec.shape), spec.dtype))
        return out

    def specs(self) -> dict[NestedKey, LeafSpec]:
        """The group's observation-like entries (root and ``"next"``), in batch order."""
        g, n = self.name, self.n
        out: dict[NestedKey, LeafSpec] = {k: spec for k, (_, spec) in self.obs_keys().items()}
        if self.action_mask is not None:
            out[(g, "action_mask")] = LeafSpec((n, *self.action_mask.shape), torch.bool)
        if self.use_mask:
            out[(g, "mask")] = LeafSpec((n,), torch.bool)
        for key, spec in (self.info or {}).items():
            out[(g, "info", key)] = LeafSpec((n, *spec.shape), spec.dtype)
        if self.flags:
            for flag in FLAGS:
                out[(g, flag)] = LeafSpec((n, 1), torch.bool)
        return out

    def action_space(self) -> spaces.Space[Any]:
        return stack_space(self.act_space, self.n)

    def action_spec(self) -> LeafSpec:
        return action_specs(self.action_space())["action"]


def masked_choice(mask: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A uniformly random index among the ``True`` entries of each row of ``mask`` (``[..., k]``): the
    legal actions; a row with none is drawn from all ``k``.

    Example:
        >>> mask = torch.tensor([[False, True, False], [True, False, True]])
        >>> bool(mask.gather(-1, masked_choice(mask, None).unsqueeze(-1)).all())
        True
    """
    mask = mask.to(torch.bool)
    mask = mask | ~mask.any(-1, keepdim=True)
    noise = torch.rand(mask.shape, generator=generator)
    return (noise + 1).mul_(mask).argmax(-1)
