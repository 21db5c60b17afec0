"""One PettingZoo env (a copy among ``num_envs``) stepped into a row of the frames: the parallel API, where
every live agent acts at each step, and the turn-based (AEC) one, where the selected agent acts.

Both write the same entries (see ``docs/multiagent.md``):

* an agent that left the episode (``use_mask=True``) has zeros for its observation and info entries, its
  ``mask`` False, every action allowed in its ``action_mask``, a reward of 0 and its last done flags, until
  the env resets;
* in a turn-based env only the agent to act next has ``mask`` True and its own ``action_mask``; the others
  are observed as they are (``observe(agent)``), with every action allowed, and their actions are ignored;
* the env's own flags: its episode ends when every agent is done (``done_on_any=False``) or as soon as one
  is (``done_on_any=True``); it is ``terminated`` where every agent terminated, else ``truncated``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._spaces import NestedKey
from ._agents import AgentSlot

__all__ = ["ParallelCopy", "TurnCopy"]

#: an agent's action in one copy: ``action(slot, row)``
ActionOf = Callable[[AgentSlot, int], Any]


class _Copy:
    def __init__(
        self, env: Any, slots: dict[str, AgentSlot], *, use_mask: bool, done_on_any: bool, state: bool
    ):
        self.env = env
        self.slots = slots
        self.use_mask = use_mask
        self.done_on_any = done_on_any
        self.state = state
        #: each agent's flags when it left (``(terminated, truncated)``), for the frames until the reset
        self._left: dict[str, tuple[bool, bool]] = {}

    def _ends(self, done: list[bool], terminated: list[bool]) -> tuple[bool, bool]:
        """The env's ``(terminated, truncated)`` from its agents' flags."""
        ended = any(done) if self.done_on_any else all(done)
        if not ended:
            return False, False
        whole = all(terminated) if not self.done_on_any else any(terminated)
        return whole, not whole

    def _write_state(self, arrays: Mapping[NestedKey, np.ndarray], row: int) -> None:
        if self.state:
            arrays["state"][row] = self.env.state()


class ParallelCopy(_Copy):
    """A ``pettingzoo.ParallelEnv``."""

    def reset(self, arrays: Mapping[NestedKey, np.ndarray], row: int, seed: int | None) -> None:
        obs, infos = self.env.reset(seed=seed)
        self._left.clear()
        live = set(self.env.agents)
        for agent, slot in self.slots.items():
            slot.observe(arrays, row, obs[agent], infos.get(agent, {}), agent in live)
        self._write_state(arrays, row)

    def step(self, arrays: Mapping[NestedKey, np.ndarray], row: int, action: ActionOf) -> tuple[bool, bool]:
        env = self.env
        obs, rewards, terms, truncs, infos = env.step({a: action(self.slots[a], row) for a in env.agents})
        live = set(env.agents)
        done, terminated = [], []
        for agent, slot in self.slots.items():
            if agent in obs:
                term, trunc = bool(terms.get(agent, False)), bool(truncs.get(agent, False))
                slot.observe(arrays, row, obs[agent], infos.get(agent, {}), agent in live)
                slot.outcome(arrays, row, float(rewards.get(agent, 0.0)), term, trunc)
                if term or trunc:
                    self._left[agent] = (term, trunc)
            else:
                term, trunc = self._gone(agent)
                slot.absent(arrays, row)
                slot.outcome(arrays, row, 0.0, term, trunc)
            done.append(term or trunc)
            terminated.append(term)
        self._write_state(arrays, row)
        return self._ends(done, terminated)

    def _gone(self, agent: str) -> tuple[bool, bool]:
        if not self.use_mask:
            raise ValueError(
                f"agent {agent!r} left the episode before the others; PettingZooEnv(..., use_mask=True) "
                "masks such agents ((group, 'mask') False, their entries zeros until the env resets)"
            )
        return self._left.get(agent, (True, False))


class TurnCopy(_Copy):
    """A ``pettingzoo.AECEnv``: the agent in ``agent_selection`` acts; agents that are done and selected
    are stepped with ``None`` (as PettingZoo asks) before the next live agent acts, their rewards added."""

    def reset(self, arrays: Mapping[NestedKey, np.ndarray], row: int, seed: int | None) -> None:
        self.env.reset(seed=seed)
        self._left.clear()
        self._observe(arrays, row)
        self._write_state(arrays, row)

    def _observe(self, arrays: Mapping[NestedKey, np.ndarray], row: int) -> None:
        env = self.env
        live = set(env.agents)
        selected = env.agent_selection
        for agent, slot in self.slots.items():
            if agent in live:
                slot.observe(arrays, row, env.observe(agent), env.infos.get(agent, {}), agent == selected)
            else:
                slot.absent(arrays, row)

    def step(self, arrays: Mapping[NestedKey, np.ndarray], row: int, action: ActionOf) -> tuple[bool, bool]:
        env = self.env
        rewards = dict.fromkeys(self.slots, 0.0)
        env.step(action(self.slots[env.agent_selection], row))
        self._add(rewards)
        while env.agents and self._selected_done() and not self._all_done():
            env.step(None)  # a done agent's turn: PettingZoo removes it
            self._add(rewards)
        self._observe(arrays, row)
        done, terminated = [], []
        for agent, slot in self.slots.items():
            if agent in env.terminations and agent in env.agents:
                term, trunc = bool(env.terminations[agent]), bool(env.truncations[agent])
                if term or trunc:
                    self._left[agent] = (term, trunc)
            else:  # it left (turn-based envs always have use_mask)
                term, trunc = self._left.get(agent, (True, False))
            slot.outcome(arrays, row, rewards[agent], term, trunc)
            done.append(term or trunc)
            terminated.append(term)
        self._write_state(arrays, row)
        return self._ends(done, terminated)

    def _add(self, rewards: dict[str, float]) -> None:
        for agent, value in self.env.rewards.items():
            if agent in rewards:
                rewards[agent] += float(value)

    def _selected_done(self) -> bool:
        agent = self.env.agent_selection
        return bool(self.env.terminations.get(agent, False) or self.env.truncations.get(agent, False))

    def _all_done(self) -> bool:
        env = self.env
        return all(env.terminations[a] or env.truncations[a] for a in env.agents)
