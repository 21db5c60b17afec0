"""Where each PettingZoo agent's values go in a frame: its group's arrays, at its index in the group.

One :class:`AgentSlot` per agent is worked out once, so that a step writes an agent's observation, action
mask, mask, info entries, reward and flags with a few indexed assignments (no key built per step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._spaces import NestedKey
from ._spec import GroupLayout

__all__ = ["AgentSlot", "agent_slots"]


@dataclass
class AgentSlot:
    """One agent's keys in a frame (``arrays[key][row, index] = value``)."""

    agent: str
    group: str
    index: int
    obs_keys: list[tuple[NestedKey, NestedKey]]  # (batch key, the key in the agent's observation Dict)
    plain: bool  # the observation is one array: obs_keys[0][0] takes it as it is
    mask_from: str | None  # "obs" or "info": where the action mask is, None without one
    info_keys: list[tuple[NestedKey, str]]
    use_mask: bool

    def observe(
        self, arrays: Mapping[NestedKey, np.ndarray], row: int, obs: Any, info: Any, acting: bool
    ) -> None:
        """Write the agent's observation (its action mask where it acts next, else all actions allowed)."""
        g, j = self.group, self.index
        if self.plain:
            arrays[self.obs_keys[0][0]][row, j] = obs
        else:
            for key, own in self.obs_keys:
                arrays[key][row, j] = _get(obs, own)
        if self.mask_from is not None:
            source = obs if self.mask_from == "obs" else info
            arrays[(g, "action_mask")][row, j] = source["action_mask"] if acting else True
        if self.use_mask:
            arrays[(g, "mask")][row, j] = acting
        for key, name in self.info_keys:
            arrays[key][row, j] = info.get(name, 0) if isinstance(info, Mapping) else 0

    def absent(self, arrays: Mapping[NestedKey, np.ndarray], row: int) -> None:
        """An agent that left the episode: zeros, its mask False, every action allowed."""
        g, j = self.group, self.index
        for key, _ in self.obs_keys:
            arrays[key][row, j] = 0
        if self.mask_from is not None:
            arrays[(g, "action_mask")][row, j] = True
        if self.use_mask:
            arrays[(g, "mask")][row, j] = False
        for key, _ in self.info_keys:
            arrays[key][row, j] = 0

    def outcome(
        self,
        arrays: Mapping[NestedKey, np.ndarray],
        row: int,
        reward: float,
        terminated: bool,
        truncated: bool,
    ) -> None:
        """Write the agent's reward and done flags of a step."""
        g, j = self.group, self.index
        arrays[(g, "reward")][row, j, 0] = reward
        arrays[(g, "terminated")][row, j, 0] = terminated
        arrays[(g, "truncated")][row, j, 0] = truncated
        arrays[(g, "done")][row, j, 0] = terminated or truncated


def _get(obs: Any, key: NestedKey) -> Any:
    for part in (key,) if isinstance(key, str) else key:
        obs = obs[part]
    return obs


def agent_slots(
    groups: Mapping[str, GroupLayout], mask_from: Mapping[str, str | None]
) -> dict[str, AgentSlot]:
    """Every agent's :class:`AgentSlot`, by agent name (``mask_from``: per group, where its agents' action
    masks are)."""
    out = {}
    for g, layout in groups.items():
        obs_keys = [(key, own) for key, (own, _) in layout.obs_keys().items()]
        info_keys: list[tuple[NestedKey, str]] = [((g, "info", name), name) for name in layout.info or {}]
        for j, agent in enumerate(layout.agents):
            out[agent] = AgentSlot(
                agent, g, j, obs_keys, layout.plain_obs, mask_from[g], info_keys, layout.use_mask
            )
    return out
