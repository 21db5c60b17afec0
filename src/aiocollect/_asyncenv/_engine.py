"""The engine of ``AsyncEnvCollector``: one run over its envs, and what its two ways of stepping them share.

:class:`Engine` holds the run's state (trajectory ids, frame counts, versions, the policy calls whose
actions may still give frames, the batch being filled and the batches completed) and writes once what both
ways of stepping need: the budget (:meth:`Engine.room`, :meth:`Engine.need`), the batch filler
(:meth:`Engine.append`), the completion (:meth:`Engine.finish`), the record of a policy call
(:meth:`Engine.called`), :meth:`Engine.take_batch`, :attr:`Engine.idle` and :meth:`Engine.new_version`.
How the envs are stepped is its :class:`Stepper`: a task per env and a policy task on the collector's loop
(``_run.py``, ``LoopSteps``), or one thread driving process envs' doorbells (``_fused.py``,
``FusedSteps``). The collector and its checkpoints talk to the engine only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc
import numpy as np

from .._envs._spaces import NestedKey
from .._episodes._groups import RowEpisodes
from .._observe._events import WorkerFailed
from .._observe._timesplit import SplitClock
from ._envset import EnvSet, close_once
from ._frames import FrameBatch, Layout, PolicyCall, as_numpy
from ._options import AsyncEnvOptions
from ._policy import ActionCodec

__all__ = ["AllDropped", "Engine", "Hold", "Setup", "Signal", "Stepper"]


class AllDropped(RuntimeError):
    """Every env was dropped (``on_env_error="drop"``); its cause is the last one's error."""


class Signal:
    """Wakes the tasks waiting on it (no state: a waiter checks its condition first, then waits)."""

    __slots__ = ("_event",)  # not None: a task waits (read directly on the engine's hot path)

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def set(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class Hold:
    """The engine's ``policy_lock``: while the loop holds it no policy call starts (a weight load and its
    new version happen between two calls); the loop's policy task holds it around each call."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = anyio.Lock(fast_acquire=True)

    async def __aenter__(self) -> None:
        await self._lock.acquire()
        self._engine.held += 1

    async def __aexit__(self, *exc: object) -> None:
        self._engine.held -= 1
        self._lock.release()
        self._engine.stepper.wake()


class Stepper(Protocol):
    """One way to step an engine's envs and call its policy (made with the engine: ``kind(engine)``)."""

    #: whether its batches are written a block of frames at a time (``FrameBatch(blocks=True)``)
    blocks: bool

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Step until the budget is collected, the engine is stopped or something fails."""

    async def stop(self) -> None:
        """Stop stepping (after the steps and the policy call in flight) and wait until it has."""

    def wake(self) -> None:
        """(From the loop.) Look again: room for steps, a hold released."""

    def on_loop(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the collector's loop (from where the envs are stepped)."""

    def oldest_action(self) -> int:
        """The number of the oldest action still stepping (the next call's first: none is)."""


@dataclass(frozen=True)
class Setup:
    """What every engine of one entered collector runs with, its successors' too: its envs' layout, what
    it calls, the options, its way of stepping (``kind(engine)``), the collector's event hub and pause
    state, the envs' restarts (``restart=``) and, in a host, its first env id there (:meth:`Engine.drop`)."""

    spec: EnvSet
    policy: Any
    options: AsyncEnvOptions
    kind: Callable[[Engine], Stepper]
    hub: Any
    is_paused: Callable[[], bool]
    resumed: Callable[[], Awaitable[None]]
    restarts: Any = None
    offset: int = 0


class Engine:
    """The running state of one entered ``AsyncEnvCollector`` (see the module docstring).

    Its per-env state is per row: a single env has one row, a vector env of ``N`` sub-envs ``N``
    consecutive rows (``spec.firsts``); a row's index is its env id. ``target``: the frames to collect
    (a multiple of ``frames_per_batch``, or -1), ``seed``: the envs' first resets' (env ``i``'s
    ``seed + i``)."""

    def __init__(self, envs: list[Any], setup: Setup, *, target: int, seed: int | None) -> None:
        spec, options, n = setup.spec, setup.options, setup.spec.rows
        self.setup, self.rows, self.envs, self.spec, self.options = setup, n, envs, spec, options
        self.policy, self.kind, self.hub, self.restarts = setup.policy, setup.kind, setup.hub, setup.restarts
        self.offset = (
            setup.offset
        )  # a hosted collector's: its first env id over the host's (its events say those)
        self.is_paused, self.resumed = setup.is_paused, setup.resumed
        self.frames_per_batch, self.target, self.seed = options.frames_per_batch, target, seed
        self.min_batch = options.min_batch_of(n)
        self.codec = ActionCodec(spec.action_space)
        self.traj_ids = np.arange(n, dtype=np.int64)
        self.next_traj = n
        # seeded episodes (group_size, on_update="restart"), else None: resets unseeded but the first
        self.episodes = RowEpisodes.of(n, options.group_size, seed, restart=options.on_update == "restart")
        self.env_frames = [0] * n  # frames written per row
        self.dropped: set[int] = set()
        self.closed_envs: set[int] = set()
        self.version = 0
        self.batch_sizes: deque[int] = deque(maxlen=10_000)  # of the recent policy calls
        self.clock = SplitClock()  # the policy side's time: awaiting envs, the policy, the consumer
        self.error: BaseException | None = None
        # actions are numbered in the order they are handed out; a frame records only its action's number
        # (an int, which the cyclic GC does not track): its call is found in `calls` when its batch completes
        self.next_action = 0  # the number of the first action of the next policy call
        self.calls: deque[PolicyCall] = deque()  # the calls whose actions may still give frames
        self.layout: Layout | None = None
        self.filling: FrameBatch | None = None
        self.batches_completed = 0
        self.in_flight = 0  # rows with an action, stepping
        self.acting = False  # a policy call in flight
        self.complete: deque[FrameBatch] = deque()  # ready for the consumer, in order
        self.delivered = 0  # frames delivered
        self.policy_signal = Signal()
        self.consumer_signal = Signal()
        self.idle_signal = Signal()
        self.held = 0  # the loop holds policy_lock
        self.policy_lock = Hold(self)
        self.stepper: Stepper = setup.kind(self)

    def successor(self, envs: list[Any], *, seed: int | None, target: int, at: int | None = None) -> Engine:
        """A new engine over ``envs`` (these, or restored ones) that goes on from this one: trajectory ids
        fresh from its counter, its version and frame counts, its seeded episodes' rounds (from round
        ``at`` at least); the envs reset with ``seed`` (env ``i``: ``seed + i``; ``None``: unseeded), and
        ``target`` frames to collect (-1: endless)."""
        new = Engine(envs, self.setup, target=target, seed=seed)
        n = new.rows
        new.traj_ids[:] = np.arange(self.next_traj, self.next_traj + n)
        new.next_traj = self.next_traj + n
        new.version = self.version
        if new.episodes is not None and self.episodes is not None:  # rounds (group ids) none used before
            new.episodes.go_on_from(self.episodes, at)
        new.env_frames = self.env_frames
        return new

    # -- lifecycle --------------------------------------------------------------------------------
    async def close_env(self, i: int) -> None:
        """Close env ``i`` (once), shielded; an error closing it is dropped (it failed, or we are ending)."""
        await close_once(self.envs, self.closed_envs, i)

    # -- what the collector reads -----------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.in_flight and not self.acting

    @property
    def completed(self) -> int:
        """Frames written (into complete batches and the one being filled)."""
        filling = self.filling
        done = self.batches_completed * self.frames_per_batch
        return done if filling is None else done + filling.filled

    def take_batch(self) -> FrameBatch:
        """The next complete batch; its frames no longer count against the frames in flight."""
        batch = self.complete.popleft()
        self.delivered += batch.size
        self.stepper.wake()  # room for more steps
        return batch

    def new_version(self) -> int:
        """The policy version after an update (its weights loaded); with ``on_update="restart"`` every
        episode in flight starts again."""
        self.version += 1
        if self.episodes is not None:
            self.episodes.updated()
        return self.version

    def restart_counts(self) -> list[int]:
        """Per row (env id): the restarts of its env (a vector env's, on its first row)."""
        return [0] * self.rows if self.restarts is None else self.restarts.per_row(self.rows)

    def reset_seed(self, first: int, u: int) -> int | None:
        """The seed of env ``u``'s first reset (its first row ``first``), derived anew after a restart."""
        if self.episodes is not None:
            return self.episodes.seed(first)
        seed = None if self.seed is None else self.seed + first
        return seed if self.restarts is None else self.restarts.seed(seed, u)

    # -- the budget -------------------------------------------------------------------------------
    def room(self) -> int:
        """Rows that may start a step now: ``1 + prefetch`` batches ahead of the consumer at most, and
        within the budget (``<= 0``: none)."""
        completed = self.completed
        room = (1 + self.options.prefetch) * self.frames_per_batch - (completed - self.delivered)
        room -= self.in_flight
        if self.target > 0:
            room = min(room, self.target - completed - self.in_flight)
        return room

    def collected(self) -> bool:
        """The budget is written (nothing more to step)."""
        return 0 < self.target <= self.completed

    def need(self, room: int) -> int:
        """Ready rows that start a policy call at once (else the first one's ``max_wait`` does):
        ``min_batch``, or fewer where fewer envs are left or may step (``room``)."""
        return min(self.min_batch, self.rows - len(self.dropped), room)

    # -- policy calls -----------------------------------------------------------------------------
    def called(
        self, obs: list[np.ndarray], idx: np.ndarray, out: dict[NestedKey, Any], version: int
    ) -> tuple[dict[NestedKey, np.ndarray], int]:
        """Record a policy call on the rows ``idx`` (``obs``: what it saw, ``out``: what it wrote, under
        weights ``version``) for the frames of its steps; its actions, checked against the action space,
        are numbered from the number returned and step from now on."""
        n = len(idx)
        self.batch_sizes.append(n)
        self.clock.frames += n
        outputs = {key: as_numpy(value, n) for key, value in out.items()}
        layout = self.layout
        if layout is None:
            track, grouped = self.options.track_policy_version, self.options.group_size is not None
            layout = self.layout = Layout(self.spec.obs_specs, outputs, track=track, grouped=grouped)
        elif list(outputs) != layout.out_keys:
            raise KeyError(f"the policy wrote {list(outputs)}, and {layout.out_keys} at its first call")
        arrays = self.codec.arrays(outputs, n)
        groups = self.episodes.group_ids[idx] if layout.group_ids and self.episodes else None
        base = self.next_action
        self.calls.append(
            PolicyCall(obs, list(outputs.values()), idx, self.traj_ids[idx], version, base, groups)
        )
        self.in_flight += n
        return arrays, base

    # -- frames -----------------------------------------------------------------------------------
    def new_batch(self) -> FrameBatch:
        assert self.layout is not None
        batch = self.filling = FrameBatch(self.layout, self.frames_per_batch, blocks=self.stepper.blocks)
        return batch

    def append(
        self,
        first: int,
        number: int,
        nxt: list[np.ndarray],
        flags: tuple[np.ndarray, np.ndarray, np.ndarray],
        episode: tuple[np.ndarray, np.ndarray],
        obs: list[np.ndarray] | None = None,
        finals: tuple[np.ndarray, list[np.ndarray]] | None = None,
    ) -> None:
        """The frames of a vector step of the rows ``first`` on (their actions numbered from ``number``;
        ``nxt``: their next observations, ``flags``: reward, terminated, truncated; ``obs``, ``finals``: see
        :meth:`FrameBatch.write`): written into the batch being filled, the rest into the next one (frames
        past the budget are not written); then the episodes that ended are counted (``episode``: each
        row's return and length so far) and begin new trajectories, and the rows step no more."""
        reward, terminated, truncated = flags
        done = terminated | truncated
        ended = done.nonzero()[0].tolist() if np.count_nonzero(done) else []  # (any() costs twice as much)
        ret, length = episode
        ret += reward
        length += 1
        width = len(reward)
        off = 0
        while off < width:
            if 0 < self.target <= self.batches_completed * self.frames_per_batch:
                break  # the budget is collected: the rest of the step is no frame
            batch = self.filling or self.new_batch()
            row = batch.filled
            end = off + min(width - off, batch.size - row)
            batch.write(row, off, end, number, nxt, flags, obs, finals)
            for k in ended:
                if off <= k < end:
                    batch.episodes.append((first + k, float(ret[k]), int(length[k])))
            if batch.filled == batch.size:
                self.finish(batch)
            off = end
        counts = self.env_frames
        counts[first : first + off] = [f + 1 for f in counts[first : first + off]]
        if ended:  # new trajectory ids, in the order of the sub-envs
            self.traj_ids[first + np.asarray(ended)] = np.arange(self.next_traj, self.next_traj + len(ended))
            self.next_traj += len(ended)
            ret[done] = 0.0
            length[done] = 0
        self.in_flight -= width

    def finish(self, batch: FrameBatch) -> None:
        """``batch`` is full: find the policy calls of its frames, free the calls no frame can come from
        any more, and hand it to the consumer."""
        self.filling = None
        self.batches_completed += 1
        batch.resolve(list(self.calls))
        low, calls = self.stepper.oldest_action(), self.calls
        while calls and calls[0].base + calls[0].n <= low:
            calls.popleft()
        self.complete.append(batch)
        self.stepper.on_loop(self._batch_ready)

    def _batch_ready(self) -> None:
        self.consumer_signal.set()
        self.policy_signal.set()

    def drop(self, u: int, exc: BaseException) -> BaseException | None:
        """Drop env ``u`` (``on_env_error="drop"``; a vector env: all its sub-envs), a ``WorkerFailed``
        event for each of its rows (their env ids over the host's, in a ``MultiAsyncEnvCollector``
        worker); the error to end with when every env is dropped."""
        first, width = self.spec.firsts[u], self.spec.widths[u]
        stop = first + max(width, 1)
        off, member = self.offset, self.options.member
        where = "" if member is None else f"worker {member}'s "
        message = f"{type(exc).__name__}: {exc}"
        if width:
            ids = f"env ids {first + off} to {stop - 1 + off}"
            message += f" ({where}vector env {u}: its sub-envs, {ids}, are dropped)"
        self.dropped.update(range(first, stop))
        hub = self.hub
        self.stepper.on_loop(
            lambda: [hub.publish(WorkerFailed(i + off, message)) for i in range(first, stop)]
        )
        if len(self.dropped) < self.rows:
            return None
        if member is None:
            what = f"every env was dropped (on_env_error='drop'); the last one, env {first}, raised"
        else:
            ids = f"env ids {off} to {off + self.rows - 1}"
            what = (
                f"every env was dropped in worker {member} ({ids}; on_env_error='drop'); the last one raised"
            )
        error = AllDropped(f"{what} {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error
