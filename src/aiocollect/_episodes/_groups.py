"""Seeded episodes, for ``group_size`` and ``on_update="restart"``: every episode of an env slot resets with
a seed known in advance, so that ``G`` slots start their episodes from the same initial state (a group)
and an episode can be started again from its own.

The slots of a rollout (its env rows, flat) form blocks of ``G`` consecutive slots. The ``k``-th episode
of every slot of block ``b`` resets with the block's ``k``-th seed (:meth:`EpisodeSeeds.seed`, a pure
function of the collector's seed, the member, ``b`` and ``k``) and belongs to group ``(b, k)``, whose id
(:meth:`EpisodeSeeds.group_id`) is unique over the collector's life and across members (the trajectory
ids' scheme: ``start + stride * j``). No slot waits for its group-mates: each goes through its rounds
``k = 0, 1, ...`` at its own pace.

:class:`SeededEnv` puts this in front of the rollout's array env (``_envs/_adapter.py``): its resets and
the resets after an episode's end are seeded per slot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["EpisodeSeeds", "Group", "GroupOrder", "RowEpisodes", "SeededEnv"]


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One SplitMix64 step (Steele, Lea and Flood 2014): a 64-bit int to a well-mixed 64-bit int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class EpisodeSeeds:
    """The reset seed and the group id of round ``k`` of each block of ``group`` slots.

    ``seed``: the collector's seed (``None``: a random base drawn here, which is all a group needs: its
    slots are in one rollout). ``start``, ``stride``: the member's trajectory-id scheme, which group ids
    share (disjoint over members).

    Example:
        >>> seeds = EpisodeSeeds(slots=4, group=2, seed=0)
        >>> first = seeds.slot_seeds(np.zeros(4, dtype=np.int64)).tolist()  # round 0 of each slot
        >>> first == [seeds.seed(0, 0)] * 2 + [seeds.seed(1, 0)] * 2
        True
        >>> [seeds.group_id(b, k) for k in range(2) for b in range(2)]
        [0, 1, 2, 3]
    """

    def __init__(self, slots: int, group: int, seed: int | None, start: int = 0, stride: int = 1) -> None:
        if slots % group:
            raise ValueError(
                f"group_size={group} needs the env slots of each rollout in whole groups: this env has "
                f"{slots} slot(s) (its batch size); make it a multiple of {group} (e.g. num_envs={group}) "
                f"or use group_size={_divisor(slots, group)}"
            )
        self.slots, self.group, self.blocks = slots, group, slots // group
        self.start, self.stride = start, stride
        self._block_of = np.arange(slots, dtype=np.int64) // group
        self.rebase(seed, 0)

    def rebase(self, seed: int | None, first_round: int) -> None:
        """Seeds from ``seed`` on, round ``first_round`` taking the seeds round 0 had (``set_seed``)."""
        base: Any = np.random.SeedSequence().entropy if seed is None else seed
        self.base_seed = _splitmix64(int(base) & _MASK64)
        self.first_round = first_round

    def seed(self, block: int, k: int) -> int:
        """The reset seed of round ``k`` of ``block`` (a 32-bit int, what gymnasium takes)."""
        h = self.base_seed
        for word in (self.start, block, k - self.first_round):  # SplitMix64 over the words: a few us
            h = _splitmix64(h ^ (word & _MASK64))
        return h >> 32

    def group_id(self, block: int | np.ndarray, k: int | np.ndarray) -> Any:
        return self.start + self.stride * (k * self.blocks + block)

    def slot_seeds(self, rounds: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Each slot's seed for its round ``rounds[slot]`` (where ``mask``; 0 elsewhere)."""
        out = np.zeros(self.slots, dtype=np.int64)
        where = range(self.slots) if mask is None else np.flatnonzero(mask)
        cache: dict[tuple[int, int], int] = {}
        for s in where:
            key = (int(self._block_of[s]), int(rounds[s]))
            if key not in cache:
                cache[key] = self.seed(*key)
            out[s] = cache[key]
        return out

    def frame_groups(self, rounds: np.ndarray, done: np.ndarray) -> np.ndarray:
        """The group id of every frame of a batch (``done``: ``[slots, T]``, time last) whose slots are
        at round ``rounds`` after it: each episode end in the batch advanced its slot by one round."""
        after = np.cumsum(done[:, ::-1], axis=1)[:, ::-1]  # episode ends at or after each frame
        k = rounds[:, None] - after
        return np.asarray(self.group_id(self._block_of[:, None], k), dtype=np.int64)


def _divisor(slots: int, group: int) -> int:
    return max(d for d in range(1, group + 1) if slots % d == 0)


@dataclass(eq=False)
class Group:
    """Trajectories from one initial state (one ``("collector", "group_id")``), delivered together."""

    ident: int
    members: list[Any] = field(default_factory=list)  # in admission order
    complete: int = 0  # members whose last frame came
    dead: bool = False  # a member was cut and not started again: never delivered


class GroupOrder:
    """The group accounting of a :class:`~aiocollect._episodes._assembler.TrajectoryAssembler` with
    ``group_size``:
    groups of ``size`` trajectories (objects with ``complete``, ``discarded`` and ``group``), released
    ``per_batch / size`` at a time in the order their first member was admitted, once each has ``size``
    complete members. A member cut for good (not started again under its group id) dooms its group: its
    other members and those still to come are to be discarded (what :meth:`leave` and :meth:`kill` give).

    Example:
        >>> from types import SimpleNamespace as T
        >>> order = GroupOrder(2, per_batch=2)
        >>> a, b = (T(complete=False, discarded=False, group=None) for _ in range(2))
        >>> order.join(a, 7), order.join(b, 7), order.ready()
        (True, True, None)
        >>> a.group.complete = 2  # (the assembler counts members as their last frame comes)
        >>> order.take() == [a, b]
        True
    """

    def __init__(self, size: int, per_batch: int) -> None:
        self.size, self.per_batch = size, per_batch
        self._groups: dict[int, Group] = {}
        self._order: deque[Group] = deque()
        self._dead: set[int] = set()  # groups discarded: their late members are too

    def join(self, traj: Any, ident: int) -> bool:
        """``traj`` joins group ``ident``; ``False``: that group was discarded (so is ``traj``)."""
        if ident in self._dead:
            return False
        group = self._groups.get(ident)
        if group is None:
            group = self._groups[ident] = Group(ident)
            self._order.append(group)
        group.members.append(traj)
        traj.group = group
        return True

    def leave(self, traj: Any, *, again: bool) -> list[Any]:
        """``traj`` was discarded; unless it starts ``again`` (the same group id), its group goes too:
        the members to discard."""
        group = traj.group
        if group is None or group.dead:
            return []
        group.members.remove(traj)
        group.complete -= traj.complete
        return [] if again else self.kill(group.ident)

    def kill(self, ident: int) -> list[Any]:
        """Discard group ``ident`` (and members still to come): its members not discarded yet."""
        self._dead.add(ident)
        group = self._groups.pop(ident, None)
        if group is None:
            return []
        group.dead = True
        return [m for m in group.members if not m.discarded]

    def ready(self) -> list[Group] | None:
        """The next groups of a batch, if each has all its members complete."""
        order = self._order
        while order and order[0].dead:
            order.popleft()
        ready: list[Group] = []
        for group in order:
            if group.dead:
                continue
            if group.complete < self.size:
                return None
            ready.append(group)
            if len(ready) * self.size == self.per_batch:
                return ready
        return None

    def take(self) -> list[Any]:
        """The members of the groups :meth:`ready` gives, group after group (check it first)."""
        groups = self.ready()
        assert groups is not None, "take() before ready()"
        for group in groups:
            self._order.remove(group)
            del self._groups[group.ident]
        return [m for group in groups for m in group.members]


class SeededEnv:
    """The rollout's array env with seeded episodes: :meth:`reset` starts the next round of the slots it
    resets (of all of them: a round none has begun), seeded; a step's ended episodes are reset again at
    once, seeded (after the env's own autoreset, whose observations they replace). Everything else is
    the wrapped env's.

    ``restart(mask)`` starts the episodes of the slots in ``mask`` again from their own seed (the same
    round): ``on_update="restart"``.
    """

    def __init__(self, env: Any, seeds: EpisodeSeeds) -> None:
        reset_seeded = getattr(env, "reset_seeded", None)
        if reset_seeded is None:  # pragma: no cover - the rollout's ArrayEnv has it
            raise TypeError(f"{type(env).__name__} cannot reset one env slot with a given seed")
        env.check_reset_seeded()
        self._env = env
        self.seeds = seeds
        #: each slot's current round (the episode it runs); -1 before the first reset
        self.rounds = np.full(seeds.slots, -1, dtype=np.int64)
        self._shape = env.batch_shape

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    @property
    def fused_gym(self) -> Any:
        """The wrapped env's fused loop (a ``GymEnv``'s), told to reseed the episodes it ends."""
        gym = self._env.fused_gym
        return None if gym is None else _FusedSeeded(gym, self)

    def start_at(self, round_: int) -> None:
        """The next :meth:`reset` of all slots starts round ``round_`` (a resumed collector: fresh groups)."""
        self.rounds[:] = round_ - 1

    @property
    def next_round(self) -> int:
        return int(self.rounds.max()) + 1

    def reset(self, mask: np.ndarray | None = None) -> dict[Any, np.ndarray]:
        flat = None if mask is None else np.asarray(mask, dtype=bool).reshape(-1)
        if flat is None:  # every slot: a round no slot has begun (the groups in flight are cut)
            self.rounds[:] = self.next_round
        else:
            self.rounds[flat] += 1
        return self._reset(flat)

    def restart(self, mask: np.ndarray | None = None) -> dict[Any, np.ndarray]:
        """The episodes in ``mask`` (all: ``None``) started again from their own initial state."""
        flat = None if mask is None else np.asarray(mask, dtype=bool).reshape(-1)
        return self._reset(flat)

    def _reset(self, flat: np.ndarray | None) -> dict[Any, np.ndarray]:
        seeds = self.seeds.slot_seeds(self.rounds, flat)
        mask = None if flat is None else flat.reshape(self._shape)
        return self._env.reset_seeded(mask, seeds.reshape(self._shape))

    def stepper(self, *, converted: bool = False) -> Any:
        step = self._env.stepper(converted=converted)
        reset = self.reset
        count_nonzero = np.count_nonzero

        def seeded_step(action: Any) -> Any:
            result = step(action)
            done = np.logical_or(result[2], result[3])
            if count_nonzero(done):
                root = reset(done)
                return (*result[:4], root)
            return result

        return seeded_step

    def next_seeds(self, done: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The episodes ``done`` ended (reset already, unseeded) go to their next round: the mask and the
        seeds to reset them with (the fused loop's :meth:`reset`)."""
        flat = np.asarray(done, dtype=bool).reshape(-1)
        self.rounds[flat] += 1
        return flat.reshape(self._shape), self.seeds.slot_seeds(self.rounds, flat).reshape(self._shape)

    def write_groups(self, out: np.ndarray, done: np.ndarray) -> None:
        """The group id of every frame of a batch into ``out`` (``[*B, T]``) from its done flags."""
        flat = done.reshape(self.seeds.slots, out.shape[-1])
        out[...] = self.seeds.frame_groups(self.rounds, flat).reshape(out.shape)


class RowEpisodes:
    """Seeded episodes of an async-env collector's rows (one env each, ``_asyncenv/_run.py``): the seed
    and group id of each row's episode, and the rows whose episode is to start again (``restarting``,
    set by :meth:`updated` with ``on_update="restart"``).

    Example:
        >>> rows = RowEpisodes(4, 2, seed=0, restart=True)
        >>> rows.seed(0) == rows.seed(1) != rows.seed(2), rows.group_ids.tolist()
        (True, [0, 0, 1, 1])
        >>> again = rows.seed(0); _ = rows.advance(0); rows.group_ids.tolist()
        [2, 0, 1, 1]
        >>> rows.updated(); rows.restarting
        [True, True, True, True]
    """

    def __init__(self, rows: int, group: int, seed: int | None, *, restart: bool) -> None:
        self.seeds = EpisodeSeeds(rows, group, seed)
        self.rounds = np.zeros(rows, dtype=np.int64)
        self._blocks = np.arange(rows, dtype=np.int64) // group
        self.group_ids = np.asarray(self.seeds.group_id(self._blocks, self.rounds), dtype=np.int64)
        self.restart = restart
        self.restarting = [False] * rows

    @classmethod
    def of(cls, rows: int, group: int | None, seed: int | None, *, restart: bool) -> RowEpisodes | None:
        """Seeded episodes for ``group_size=group`` or ``on_update="restart"``, else ``None``."""
        return None if group is None and not restart else cls(rows, group or 1, seed, restart=restart)

    def seed(self, row: int) -> int:
        """The reset seed of ``row``'s episode (the same again for a restart)."""
        return self.seeds.seed(int(self._blocks[row]), int(self.rounds[row]))

    def advance(self, row: int) -> int:
        """``row``'s episode ended: the seed of its next one."""
        self.rounds[row] += 1
        self.group_ids[row] = self.seeds.group_id(int(self._blocks[row]), int(self.rounds[row]))
        return self.seed(row)

    def updated(self) -> None:
        """New weights: with ``restart``, every episode in flight starts again."""
        if self.restart:
            self.restarting[:] = [True] * len(self.restarting)

    @property
    def next_round(self) -> int:
        """The first round no row has begun (a checkpoint's: a resume starts its groups there)."""
        return int(self.rounds.max()) + 1

    def go_on_from(self, old: RowEpisodes, at: int | None = None) -> None:
        """An engine made anew (a checkpoint loaded, a seed set, a reset): rounds no group of ``old``
        used (from round ``at`` at least: a checkpoint's), seeded as rounds 0, 1, ... (a collector given
        ``set_seed(s)`` then collects what a new one seeded ``s`` does)."""
        first = max(old.next_round, at or 0)
        self.rounds[:] = first
        self.seeds.first_round = first  # (the seed as the new engine's config says)
        self.group_ids[:] = self.seeds.group_id(self._blocks, self.rounds)


class _FusedSeeded:
    """A ``GymEnv``'s fused loop (``GymEnv._run_gym_steps``) whose ended episodes are reset again, seeded."""

    def __init__(self, gym: Any, seeded: SeededEnv) -> None:
        self._gym, self._seeded = gym, seeded

    def _run_steps(self, *args: Any, **kwargs: Any) -> tuple[int, np.ndarray]:
        return self._gym._run_steps(*args, reseed=self._reseed, **kwargs)

    def _reseed(self, root: np.ndarray | None, done: np.ndarray) -> np.ndarray:
        mask, seeds = self._seeded.next_seeds(done)
        return self._gym._reseed_rows(root, mask, seeds)
