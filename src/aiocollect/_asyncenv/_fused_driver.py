"""The thread of the fused engine (``_fused.py``): it waits in ``epoll`` on the workers' sockets and a
wake-up pipe, writes a unit's frames when all its workers have replied (block copies from their slots
into the batch being filled), and once ``min_batch`` sub-envs wait (or the oldest has waited
``max_wait``) gathers their observations, runs the policy, writes the actions into the slots and rings
the units. Between two calls it runs what the loop queued for "the policy thread" (weight loads, random
states); it makes no call while the collector is paused or the loop holds the engine's ``policy_lock``.
It reads and writes the engine's shared state (trajectory ids, counters, the batches completed) and talks
to the loop only through the engine's thread-safe hand-offs."""

from __future__ import annotations

import os
from collections import deque
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._envs._spaces import LeafSpec, NestedKey
from .._observe._events import WorkerFailed
from .._procenv._driven import Poller, Unit, read_reply
from ._frames import FrameBatch, Layout, PolicyCall
from ._run import as_numpy, output_dtype

if TYPE_CHECKING:
    from ._fused import FusedEngine

__all__ = ["Driver", "Halted"]


class Halted(Exception):
    """The driver was asked to stop (inside a wait)."""


class Driver:
    """One run of the fused engine's thread over ``units`` (see the module docstring)."""

    def __init__(self, engine: FusedEngine, units: list[Unit], poller: Poller, wake_r: int) -> None:
        self.e, self.units, self.poller, self.wake_r = engine, units, poller, wake_r
        self.queue: deque[Unit] = deque()  # ready units, in the order they became ready
        self.queued_rows = 0
        self.first_ready = 0.0
        self.in_flight = 0  # sub-envs stepping
        self.acting = False  # a policy call in flight
        self.parked = False  # paused: a loop task waits for the collector to resume, then rings
        self.next_action = 0  # actions are numbered in the order they are handed out
        self.calls: deque[PolicyCall] = deque()  # the calls whose actions may still give frames
        self.layout: Layout | None = None
        self.filling: FrameBatch | None = None
        self.batches_completed = 0
        n = engine.rows
        self.ret, self.len = np.zeros(n), np.zeros(n, np.int64)  # per row: the episode so far
        self.iota = np.arange(max(u.width for u in units), dtype=np.int64)  # a unit's rows from 0

    @property
    def idle(self) -> bool:
        return not self.in_flight and not self.acting

    @property
    def completed(self) -> int:
        """Frames written (into complete batches and the one being filled)."""
        filling = self.filling
        done = self.batches_completed * self.e.config.frames_per_batch
        return done if filling is None else done + filling.filled

    # -- the loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Read the replies a stopped engine (or a cancelled call) left owed, then reset every unit."""
        for unit in self.units:
            unit.pending, unit.stepping = sum(1 for w in unit.workers if w.owed), False
            unit.staged = [np.empty_like(unit.obs(key)) for key in self.e.spec.obs_keys]
        self._wait_units()
        for unit in self.units:
            unit.write_seed(self.e.reset_seed(unit.first, unit.index))
            try:
                unit.ring(b"R")
            except Exception as exc:
                self._unit_failed(unit, exc)
        self._wait_units()
        for unit in self.units:
            self._queue_unit(unit)

    def _wait_units(self) -> None:
        """Until no unit awaits a reply (before the first step)."""
        while any(u.pending for u in self.units if not u.dead):
            self._wait(None, queue=False)

    def loop(self) -> None:
        """Until the budget is collected, the engine is stopped (:class:`Halted`) or something fails."""
        e = self.e
        config = e.config
        cap = (1 + config.prefetch) * config.frames_per_batch
        target, clock = config.target, e.clock
        while True:
            if e.halt:
                return
            if e.jobs:
                e.run_jobs()
                continue
            completed = self.completed
            if 0 < target <= completed:
                return
            room = cap - (completed - e.delivered) - self.in_flight
            if target > 0:
                room = min(room, target - completed - self.in_flight)
            timeout: float | None = None
            waiting = self.queued_rows
            if e.is_paused():
                if not self.parked:
                    self.parked = True
                    e.request("park")
                room = 0
            elif e.held:
                room = 0
            elif room > 0 and waiting:
                need = min(config.min_batch, e.rows - len(e.dropped), room)
                late = self.first_ready + config.max_wait - perf_counter()
                if waiting >= need or late <= 0:
                    self._act(min(waiting, room))
                    continue
                timeout = late
            if room > 0:
                start = perf_counter()
                self._wait(timeout)
                clock.env += perf_counter() - start
            else:
                with clock.waiting():
                    self._wait(timeout)

    def _wait(self, timeout: float | None, *, queue: bool = True) -> None:
        """Wait for replies (or a ring, or ``timeout`` s) and take them: a unit whose workers have all
        replied writes its frames and queues for the policy (``queue``)."""
        for data in self.poller.wait(timeout):
            if data is None:
                os.read(self.wake_r, 4096)
                if self.e.halt:
                    raise Halted
                continue
            unit, worker = data
            if unit.dead:
                continue
            try:
                if read_reply(worker) is None:
                    continue
            except Exception as exc:
                self._unit_failed(unit, unit.fail(worker, exc))
                continue
            if worker.owed:
                continue
            unit.pending -= 1
            if unit.pending:
                continue
            if unit.stepping:
                self._frames(unit)
            if queue:
                self._queue_unit(unit)

    def _queue_unit(self, unit: Unit) -> None:
        if unit.dead:
            return
        if not self.queue:
            self.first_ready = perf_counter()
        self.queue.append(unit)
        self.queued_rows += unit.width

    def _unit_failed(self, unit: Unit, exc: BaseException) -> None:
        """A worker of ``unit`` failed: the collector's error, or (``on_env_error="drop"``) the unit's."""
        e = self.e
        unit.dead = True
        if not e.config.drop_failed_envs:
            raise exc
        for worker in unit.workers:  # its sockets may hang up from now on; its other replies stay owed
            self.poller.remove(worker.sock.fileno())
        if unit.stepping and unit.pending:
            self.in_flight -= unit.width
        unit.pending, unit.stepping = 0, False
        if unit in self.queue:
            self.queue.remove(unit)
            self.queued_rows -= unit.width
        first, stop = unit.first, unit.first + unit.width
        message = f"{type(exc).__name__}: {exc} (vector env {unit.index}: its sub-envs, env ids {first} to "
        message += f"{stop - 1}, are dropped)"
        e.dropped.update(range(first, stop))
        hub = e.hub
        e.on_loop(lambda: [hub.publish(WorkerFailed(i, message)) for i in range(first, stop)])
        e.request("close", unit.index)
        self._idle_maybe()
        if len(e.dropped) == e.rows:
            error = RuntimeError(
                f"every env was dropped (on_env_error='drop'); the last one, env {first}, raised "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            raise error

    def _idle_maybe(self) -> None:
        """Tell a ``pause()`` waiting for the steps in flight that they are done."""
        e = self.e
        if self.idle and (self.parked or e.held or e.is_paused()):
            e.on_loop(e.idle_signal.set)

    # -- a policy call ----------------------------------------------------------------------------
    def _act(self, n: int) -> None:
        """One policy call on the first ready units holding ``n`` sub-envs (a unit is never split), its
        actions written into their slots and the units rung."""
        units: list[Unit] = []
        taken = 0
        queue = self.queue
        while taken < n:
            unit = queue.popleft()
            units.append(unit)
            taken += unit.width
        self.queued_rows -= taken
        if queue:
            self.first_ready = perf_counter()
        self.acting = True  # until its units step (a pause() waiting for idle must not slip in between)
        try:
            self._call(units, taken)
        finally:
            self.acting = False

    def _call(self, units: list[Unit], taken: int) -> None:
        e = self.e
        keys = e.spec.obs_keys
        if len(units) == 1:  # into the unit's own buffers (reused: a large fresh array page-faults)
            unit = units[0]
            obs = unit.staged
            for buf, key in zip(obs, keys, strict=True):
                np.copyto(buf, unit.obs(key))
            idx = unit.rows
        else:
            obs = [np.concatenate([u.obs(key) for u in units]) for key in keys]
            idx = np.concatenate([u.rows for u in units])
        version = e.version
        tensors = {key: torch.from_numpy(a) for key, a in zip(keys, obs, strict=True)}
        start = perf_counter()
        out = e.policy._call_torch(tensors, taken)
        e.clock.policy += perf_counter() - start
        e.batch_sizes.append(taken)
        e.clock.frames += taken
        outputs = {key: as_numpy(value, taken) for key, value in out.items()}
        self._check_layout(outputs)
        arrays = e.codec.arrays(outputs, taken)
        base = self.next_action
        call = PolicyCall(obs, list(outputs.values()), idx, e.traj_ids[idx], version, base)
        self.calls.append(call)
        self.in_flight += taken
        j = 0
        for unit in units:
            unit.write_actions(arrays, j)
            unit.action_no, unit.obs_at_call = base + j, [o[j : j + unit.width] for o in obs]
            j += unit.width
        self.next_action = base + taken
        for unit in units:
            try:
                unit.ring(b"S")
            except Exception as exc:
                self._unit_failed(unit, exc)

    def _check_layout(self, outputs: dict[NestedKey, Any]) -> None:
        """The batches' layout from the first call's outputs; a later call must write the same keys."""
        if self.layout is None:
            specs = {key: LeafSpec(tuple(v.shape[1:]), output_dtype(v)) for key, v in outputs.items()}
            versions = self.e.config.track_policy_version
            self.layout = Layout(self.e.spec.obs_specs, specs, track_policy_version=versions)
        elif list(outputs) != self.layout.out_keys:
            raise KeyError(f"the policy wrote {list(outputs)}, and {self.layout.out_keys} at its first call")

    # -- frames -----------------------------------------------------------------------------------
    def _frames(self, unit: Unit) -> None:
        """Append the frames of ``unit``'s step, count its episodes and give its ended sub-envs new
        trajectory ids."""
        e = self.e
        first, width = unit.first, unit.width
        stop = first + width
        reward, terminated, truncated, ended = unit.flags()
        done = terminated | truncated
        ends = done.nonzero()[0].tolist() if np.count_nonzero(done) else []
        ret, length = self.ret[first:stop], self.len[first:stop]
        ret += reward
        length += 1
        written = self._append(unit, (reward, terminated, truncated, ended), ends)
        if written:
            e.frame_counts[first : first + written] += 1
        if ends:
            e.traj_ids[first + np.asarray(ends)] = np.arange(e.next_traj, e.next_traj + len(ends))
            e.next_traj += len(ends)
            ret[done] = 0.0
            length[done] = 0
        unit.stepping = False
        self.in_flight -= width
        self._idle_maybe()

    def _append(self, unit: Unit, flags: tuple[np.ndarray, ...], ends: list[int]) -> int:
        """Block copies of the step's frames from the slots into the batch being filled, the rest into the
        next one; frames past the budget are not written. Returns the frames written."""
        config = self.e.config
        reward, terminated, truncated, ended = flags
        keys = self.e.spec.obs_keys
        blocks = [unit.obs(key) for key in keys]
        finals = [unit.final(key) for key in keys] if np.count_nonzero(ended) else None
        first, width, number = unit.first, unit.width, unit.action_no
        off = 0
        while off < width:
            if 0 < config.target <= self.batches_completed * config.frames_per_batch:
                break  # the budget is collected: the rest of the step is no frame
            batch = self.filling
            if batch is None:
                assert self.layout is not None
                batch = self.filling = FrameBatch(self.layout, config.frames_per_batch, blocks=True)
            row = batch.filled
            m = min(width - off, batch.size - row)
            end, stop_row = off + m, row + m
            for slot, block in zip(batch.obs, unit.obs_at_call, strict=True):
                slot[row:stop_row] = block[off:end]
            for slot, block in zip(batch.next_obs, blocks, strict=True):
                slot[row:stop_row] = block[off:end]
            if finals is not None:  # an ended sub-env's next observation is its final one
                rows = ended[off:end].nonzero()[0]
                for slot, final in zip(batch.next_obs, finals, strict=True):
                    slot[row + rows] = final[off + rows]
            np.add(self.iota[off:end], number, out=batch.source[row:stop_row])
            batch.reward[row:stop_row] = reward[off:end]
            batch.terminated[row:stop_row] = terminated[off:end]
            batch.truncated[row:stop_row] = truncated[off:end]
            batch.filled = stop_row
            for k in ends:
                if off <= k < end:
                    batch.episodes.append((first + k, float(self.ret[first + k]), int(self.len[first + k])))
            if stop_row == batch.size:
                self._complete(batch)
            off = end
        return off

    def _complete(self, batch: FrameBatch) -> None:
        """``batch`` is full: find its frames' calls, free the calls no frame can come from any more, and
        hand it to the loop."""
        self.filling = None
        self.batches_completed += 1
        batch.resolve(list(self.calls))
        low = self.next_action
        for unit in self.units:  # (the unit being written is still stepping: its rest may need its call)
            if unit.stepping and unit.action_no < low:
                low = unit.action_no
        calls = self.calls
        while calls and calls[0].base + calls[0].n <= low:
            calls.popleft()
        self.e.complete.append(batch)
        self.e.on_loop(self.e.consumer_signal.set)
