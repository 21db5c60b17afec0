"""Whole trajectories out of frame batches: :class:`TrajectoryAssembler`, the one assembler every
collector's ``trajs_per_batch`` uses.

A collector keeps producing its ordinary frame batches (a chunk of steps of every env slot); the assembler
groups their frames by ``("collector", "traj_ids")``, holds each trajectory until its last frame has
``("next", "done")``, and releases ``trajs_per_batch`` complete trajectories at a time, flat over frames,
in **admission order**: the order in which trajectories were first seen (by time step, then env slot),
never the order in which they finished. A batch therefore waits for the long episodes admitted before the
short ones behind them (latency), and is not biased toward short episodes.

A slot (an env row of a ``[*B, T]`` batch, or ``("collector", "env_id")`` in a flat batch, per source)
that starts a new trajectory while its previous one is still open had that one cut (a ``reset()``, a
``set_seed()``): the cut trajectory is discarded and counted in ``frames_discarded``, never delivered.
So are the trajectories a flush tears (:meth:`TrajectoryAssembler.taint`) and, with ``max_policy_lag``,
those begun with weights too old (:meth:`TrajectoryAssembler.drop_older`).

Plain synchronous code (no event loop): the collectors call it where their frame batches arrive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

try:  # public from tensordict 0.15
    from tensordict import is_leaf_nontensor
except ImportError:  # pragma: no cover - tensordict 0.14
    from tensordict.base import _is_leaf_nontensor as is_leaf_nontensor

from ._groups import Group, GroupOrder

__all__ = ["EpisodeBatch", "EpisodeStatistics", "TrajectoryAssembler"]

_TRAJ = ("collector", "traj_ids")
_GROUP = ("collector", "group_id")
_ENV_ID = ("collector", "env_id")
_VERSION = ("collector", "policy_version")
_DONE = ("next", "done")
_REWARD = ("next", "reward")
_SLOT_STRIDE = 1 << 32  # slot keys: source * stride + row (or env id)


@dataclass
class _Traj:
    ident: int
    slot: int
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (batch seq, frame indices)
    frames: int = 0
    oldest: int = 1 << 62  # the oldest policy version of its frames (push's ``version``)
    complete: bool = False
    discarded: bool = False
    group: Group | None = None


@dataclass(frozen=True)
class EpisodeStatistics:
    """What a ``trajs_per_batch`` collector's :meth:`episode_statistics` says.

    Attributes:
        in_flight: trajectories admitted and not yet delivered.
        delivered: trajectories delivered; ``frames_delivered`` their frames.
        frames_discarded: frames of trajectories discarded: cut before their end (a ``reset()``, a
            flush) or begun too long ago (``max_policy_lag``).
        mean_length, max_length: of the delivered trajectories (``nan``/0 before the first).
        version_spans: per trajectory of the last batch, its oldest and newest policy version (with
            ``track_policy_version``; else empty); ``max_version_span``: the largest ``newest - oldest``
            delivered so far.
    """

    in_flight: int
    delivered: int
    frames_delivered: int
    frames_discarded: int
    mean_length: float
    max_length: int
    version_spans: tuple[tuple[int, int], ...] = ()
    max_version_span: int = 0


@dataclass(frozen=True)
class EpisodeBatch:
    """What :meth:`TrajectoryAssembler.pop` hands back: the trajectories, flat over frames, and their
    per-trajectory numbers (in delivery order)."""

    batch: TensorDictBase
    lengths: list[int]
    returns: list[float]
    #: per trajectory, the oldest and newest ``("collector", "policy_version")`` (empty without versions)
    versions: list[tuple[int, int]]


class TrajectoryAssembler:
    """Frame batches in (:meth:`push`), batches of ``trajs_per_batch`` whole trajectories out (:meth:`pop`).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> ids = torch.tensor([[0, 0, 2, 2], [1, 1, 1, 1]])
        >>> done = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
        >>> frames = TensorDict({("collector", "traj_ids"): ids, ("next", "done"): done[..., None],
        ...                      "t": torch.arange(8).reshape(2, 4)}, batch_size=[2, 4])
        >>> assembler = TrajectoryAssembler(2)
        >>> assembler.push(frames)
        >>> out = assembler.pop()
        >>> out.batch["collector", "traj_ids"].tolist(), out.lengths
        ([0, 0, 1, 1, 1, 1], [2, 4])
        >>> assembler.in_flight  # trajectory 2 waits for its end
        1
    """

    def __init__(self, trajs_per_batch: int, group_size: int | None = None) -> None:
        self.trajs_per_batch = trajs_per_batch
        #: with ``group_size``, trajectories are delivered in whole groups (``("collector", "group_id")``)
        self._grouping = None if group_size is None else GroupOrder(group_size, trajs_per_batch)
        self._order: deque[_Traj] = deque()  # admission order, open and complete
        self._open: dict[int, _Traj] = {}  # by trajectory id, until delivered or discarded
        self._slots: dict[int, _Traj] = {}  # each slot's newest trajectory
        self._batches: dict[int, TensorDictBase] = {}
        self._leaves: dict[int, dict[Any, Any]] = {}  # each stored batch's entries, by nested key
        self._refs: dict[int, int] = {}  # pieces still pointing into each stored batch
        self._seq = 0
        self._pushing = -1  # the batch push() is taking in
        #: sources whose frames were dropped (a stale batch): each slot's next new trajectory is a torn
        #: one (renamed, or begun in the dropped frames) and is discarded; the slots done with that
        self._tainted: dict[int, set[int]] = {}
        self._sources: set[int] = set()
        self._complete = 0  # complete trajectories not yet delivered
        #: since the collector started (a resumed one counts delivered frames and trajectories on)
        self.frames_discarded = 0
        self.max_length = 0
        self._spans: tuple[tuple[int, int], ...] = ()
        self._max_span = 0

    def emptied(self) -> TrajectoryAssembler:
        """A new assembler of the same sizes, holding nothing (the frames in assembly were dropped)."""
        return TrajectoryAssembler(
            self.trajs_per_batch, None if self._grouping is None else self._grouping.size
        )

    # -- numbers ----------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Trajectories admitted and not yet delivered (open or waiting for their batch)."""
        return sum(not t.discarded for t in self._open.values())

    def statistics(self, delivered: int, frames: int) -> EpisodeStatistics:
        """The numbers, with the collector's own count of the trajectories and frames it delivered
        (which a ``load_state_dict`` restores)."""
        return EpisodeStatistics(
            self.in_flight,
            delivered,
            frames,
            self.frames_discarded,
            frames / delivered if delivered else float("nan"),
            self.max_length,
            self._spans,
            self._max_span,
        )

    # -- in ---------------------------------------------------------------------------------------
    def push(self, batch: TensorDictBase, *, source: int = 0, version: int = 0) -> None:
        """Take in one frame batch (``[*B, T]``, time last, or flat with ``("collector", "env_id")``);
        ``source`` tells apart the slots of batches from different workers; ``version``: the oldest
        policy version of its frames (see :meth:`drop_older`)."""
        if batch.batch_dims == 0 or batch.numel() == 0:
            return
        flat, slot_of, key_of = _flat_frames(batch)
        ids = batch.get(_TRAJ).reshape(-1)
        done = batch.get(_DONE).reshape(-1).numpy()
        groups = batch.get(_GROUP).reshape(-1).numpy() if self._grouping is not None else None
        order = torch.sort(ids, stable=True).indices
        uniq_t, counts = torch.unique_consecutive(ids[order], return_counts=True)
        uniq = uniq_t.tolist()
        seq = self._seq
        self._seq += 1
        bounds = np.concatenate(([0], np.cumsum(counts.numpy())))
        order_np = order.numpy()
        firsts = order_np[bounds[:-1]]
        lasts = order_np[bounds[1:] - 1]
        admit_keys = key_of[firsts]
        self._sources.add(source)
        self._batches[seq] = flat
        self._leaves[seq] = dict(flat.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor))
        self._refs[seq] = 0  # pieces pointing into it, counted as they come (a cut may release some)
        self._pushing = seq
        for k in np.argsort(admit_keys, kind="stable"):
            ident = uniq[k]
            if ident < 0:  # never collected (a stopped batch's tail)
                continue
            idx = order[bounds[k] : bounds[k + 1]]
            traj = self._open.get(ident)
            if traj is None:
                group = -1 if groups is None else int(groups[firsts[k]])
                traj = self._admit(ident, source, int(slot_of[firsts[k]]), group)
            if traj.discarded:  # torn: its frames are counted, never delivered
                self.frames_discarded += int(idx.numel())
                if done[lasts[k]]:
                    del self._open[ident]
                continue
            traj.pieces.append((seq, idx))
            traj.frames += int(idx.numel())
            traj.oldest = min(traj.oldest, version)
            self._refs[seq] += 1
            if done[lasts[k]]:
                traj.complete = True
                self._complete += 1
                if traj.group is not None:
                    traj.group.complete += 1
        self._pushing = -1
        if not self._refs[seq]:
            del self._refs[seq], self._batches[seq], self._leaves[seq]

    def _admit(self, ident: int, source: int, row: int, group: int = -1) -> _Traj:
        """A trajectory seen for the first time: it starts in its slot, which had the one before cut
        (with groups: started again, where the new one is of the same group, else its group is cut)."""
        slot = source * _SLOT_STRIDE + row
        traj = _Traj(ident, slot)
        previous = self._slots.get(slot)
        if previous is not None and not previous.complete and previous.ident in self._open:
            if previous.discarded:
                del self._open[previous.ident]
            else:
                again = previous.group is not None and previous.group.ident == group
                self._discard(previous, again=again)
        self._slots[slot] = traj
        self._open[ident] = traj
        cleared = self._tainted.get(source)
        if cleared is not None and row not in cleared:
            cleared.add(row)
            traj.discarded = True
            if self._grouping is not None:
                self._discard_all(self._grouping.kill(group))
        elif self._grouping is None:
            self._order.append(traj)
        else:
            traj.discarded = not self._grouping.join(traj, group)
        return traj

    def drop_older(self, version: int) -> None:
        """Discard the trajectories (open or complete) with a frame older than policy ``version``."""
        for traj in list(self._open.values()):
            if traj.oldest < version and not traj.discarded:
                self._complete -= traj.complete
                self._discard(traj, absorb=not traj.complete)

    def taint(self, source: int | None = None) -> None:
        """Frames of ``source`` (of every source: ``None``) were dropped before they got here: its
        trajectories in flight lost frames (discarded, and so are the frames still to come under their
        ids), and each slot's next new trajectory may be one of them renamed, or one begun in the dropped
        frames (discarded as it shows up)."""
        sources = self._sources if source is None else {source}
        for s in sources:
            self._tainted[s] = set()
        for traj in list(self._open.values()):
            if traj.slot // _SLOT_STRIDE in sources and not traj.complete and not traj.discarded:
                self._discard(traj, absorb=True)

    def _discard(self, traj: _Traj, *, absorb: bool = False, again: bool = False) -> None:
        """Count ``traj``'s frames as discarded and let go of them; ``absorb``: its id stays known, so
        that frames still to come under it are discarded too (until its end, or its slot's next).
        Its group is discarded too, unless ``again`` (the trajectory is being started again)."""
        traj.discarded = True
        self.frames_discarded += traj.frames
        if not absorb:
            del self._open[traj.ident]
        self._release(traj)
        if self._grouping is not None:
            self._discard_all(self._grouping.leave(traj, again=again))

    def _discard_all(self, trajs: list[_Traj]) -> None:
        """Discard the members of a group discarded (complete or not)."""
        for traj in trajs:
            self._complete -= traj.complete
            self._discard(traj, absorb=not traj.complete)

    def _release(self, traj: _Traj) -> None:
        for seq, _ in traj.pieces:
            self._refs[seq] -= 1
            if not self._refs[seq] and seq != self._pushing:  # (the batch being pushed: push ends it)
                del self._refs[seq], self._batches[seq], self._leaves[seq]
        traj.pieces = []

    # -- out --------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether the next ``trajs_per_batch`` trajectories in admission order are all complete."""
        if self._complete < self.trajs_per_batch:
            return False
        if self._grouping is not None:
            return self._grouping.ready() is not None
        self._drop_discarded_head()
        n = 0
        for traj in self._order:
            if traj.discarded:
                continue
            if not traj.complete:
                return False
            n += 1
            if n == self.trajs_per_batch:
                return True
        return False

    def _drop_discarded_head(self) -> None:
        while self._order and self._order[0].discarded:
            self._order.popleft()

    def pop(self) -> EpisodeBatch:
        """The next ``trajs_per_batch`` trajectories, flat over frames (check :meth:`ready` first)."""
        taken: list[_Traj] = [] if self._grouping is None else self._grouping.take()
        while len(taken) < self.trajs_per_batch:
            traj = self._order.popleft()
            if traj.discarded:
                continue
            assert traj.complete, "pop() before ready()"
            taken.append(traj)
        self._complete -= len(taken)
        batch = self._gather(taken)
        lengths = [t.frames for t in taken]
        for traj in taken:
            del self._open[traj.ident]
            self._release(traj)
        self.max_length = max(self.max_length, *lengths)
        spans = _version_spans(batch, lengths)
        self._spans = tuple(spans)
        self._max_span = max([self._max_span, *(b - a for a, b in spans)])
        return EpisodeBatch(batch, lengths, _segment_sums(batch, lengths), spans)

    def _gather(self, taken: list[_Traj]) -> TensorDictBase:
        """Each leaf of the batches involved copied once, into its rows of the output (one
        ``index_select`` and one ``index_copy_`` per batch and leaf: TensorDict indexing costs ~10x
        more for the small entries of a batch)."""
        by_seq: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        position = 0
        for traj in taken:
            for seq, idx in traj.pieces:
                sources, dests = by_seq.setdefault(seq, ([], []))
                sources.append(idx)
                dests.append(torch.arange(position, position + idx.numel()))
                position += int(idx.numel())
        moves = [(seq, torch.cat(a), torch.cat(b)) for seq, (a, b) in by_seq.items()]
        first = moves[0][0]
        leaves: dict[Any, torch.Tensor] = {}
        for key, value in self._leaves[first].items():
            if not isinstance(value, torch.Tensor):  # non-tensor entries: TensorDict indexing
                return _gather_tensordicts([(self._batches[q], a, b) for q, a, b in moves], position)
            out = value.new_empty((position, *value.shape[1:]))
            for seq, src, dst in moves:
                out.index_copy_(0, dst, self._leaves[seq][key].index_select(0, src))
            leaves[key] = out
        return TensorDict(leaves, batch_size=[position], device=self._batches[first].device)


def _gather_tensordicts(
    moves: list[tuple[TensorDictBase, torch.Tensor, torch.Tensor]], n: int
) -> TensorDictBase:
    parts = [batch[src] for batch, src, _ in moves]
    # torch's stubs take Tensors only (TensorDicts dispatch through __torch_function__)
    out = cast("TensorDictBase", torch.cat(parts))  # type: ignore[arg-type]
    return out[torch.argsort(torch.cat([dst for _, _, dst in moves]))]


def _flat_frames(batch: TensorDictBase) -> tuple[TensorDictBase, np.ndarray, np.ndarray]:
    """The batch flat over frames, each frame's slot, and the order frames were admitted in: a flat
    batch's own (``("collector", "env_id")`` its slots), else by time step, then by env row."""
    if batch.batch_dims == 1 and _ENV_ID in batch.keys(include_nested=True):
        return batch, batch.get(_ENV_ID).reshape(-1).numpy(), np.arange(batch.numel())
    if batch.names and any(n is not None for n in batch.names):
        batch.names = None  # (the collector's own frame batch: no one else holds it)
    T = batch.batch_size[-1]
    rows = batch.numel() // T
    slot_of = np.arange(rows * T) // T
    return batch.reshape(-1), slot_of, (np.arange(rows * T) % T) * rows + slot_of


def _segment_sums(batch: TensorDictBase, lengths: list[int]) -> list[float]:
    reward = batch.get(_REWARD, None)
    if reward is None:
        return [0.0] * len(lengths)
    total = torch.cumsum(reward.reshape(reward.shape[0], -1).sum(-1).double(), 0)
    at_end = total[torch.cumsum(torch.tensor(lengths), 0) - 1]
    return torch.diff(at_end, prepend=at_end.new_zeros(1)).tolist()


def _version_spans(batch: TensorDictBase, lengths: list[int]) -> list[tuple[int, int]]:
    version = batch.get(_VERSION, None)
    if version is None:
        return []
    spans = []
    for part in torch.split(version.reshape(-1), lengths):
        spans.append((int(part.min()), int(part.max())))
    return spans
