"""The thread of the fused engine (``_fused.py``): it waits in ``epoll`` on the workers' sockets and a
wake-up pipe, writes a unit's frames when all its workers have replied (block copies from their slots
into the batch being filled), and once ``min_batch`` sub-envs wait (or the oldest has waited
``max_wait``) gathers their observations, runs the policy, writes the actions into the slots and rings
the units. It makes no call while the collector is paused or the loop holds the engine's ``policy_lock``
(work "in the policy thread", weight loads and random states, runs in the policy's own thread, kept from
the driver's calls by the policy's lock). It reads and writes the engine's state (``_engine.py``: the
budget, the batches, the calls) and talks to the loop only through the hand-offs it is given:
``on_loop(fn)`` and ``request(kind, arg)``."""

from __future__ import annotations

import contextlib
import os
import selectors
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

import numpy as np
import torch

from .._procenv._env import Part, ProcessVectorEnv, Worker
from .._procenv._slots import Block
from ._engine import Engine

__all__ = ["Driver", "Halted", "Unit"]


class Unit:
    """Env ``index`` of the collector (a ``ProcessVectorEnv`` or a part), its rows ``first`` to
    ``first + width - 1``; the workers it steps together (its :attr:`block`), claimed from the env: its
    own ``step``/``reset`` refuse (a call in flight) and its loop reader is unwatched until ``_fused.py``
    hands them back, the replies still owed read first by its next call (or ``close``)."""

    def __init__(self, env: ProcessVectorEnv | Part, index: int, first: int) -> None:
        whole = env if isinstance(env, ProcessVectorEnv) else env._env
        if whole._closed:
            raise RuntimeError(f"{env!r} is closed")
        self.index, self.first = index, first
        self.workers: list[Worker] = (
            list(env._workers) if isinstance(env, ProcessVectorEnv) else [env._worker]
        )
        self.block = Block(self.workers)  # its slots, read and written as one block of rows
        self.width = self.block.width
        self.pending = 0  # replies the unit awaits for its command in flight
        self.stepping = False  # its command in flight is a step (not a reset)
        self.dead = False  # failed (dropped): never stepped again
        self.action_no = 0  # the number of its first row's action (rows numbered in a row)
        self.obs_at_call: list[Any] = []  # the observations its actions were computed from (copies)
        self.staged: list[np.ndarray] = []  # its observations for a policy call of its own (reused)
        self.ids = np.arange(first, first + self.width)  # its env ids
        for worker in self.workers:
            if worker.failure is not None:
                raise worker.failure
            if worker.waiting:
                raise RuntimeError(f"{env!r} is stepped by something else (a call in flight)")
        for worker in self.workers:  # from the loop's thread: its reader is the loop's business
            worker.reader.unwatch()
            worker.waiting = True  # claimed: the env's own calls refuse while we drive it

    def ring(self, command: bytes) -> None:
        """Send ``command`` (``S`` step, ``R`` reset) to every worker; their replies are then owed."""
        for worker in self.workers:
            try:
                worker.sock.send(command)
            except OSError:
                error = worker.failure = worker.died()  # the env raises it from now on
                raise error from None
            worker.owed += 1
        self.pending = len(self.workers)
        self.stepping = command == b"S"


def read_reply(worker: Worker) -> bool | None:
    """A readable worker's reply: ``True`` done, ``None`` nothing to read after all; raises its error
    (with the worker's traceback) or :class:`WorkerDiedError`."""
    try:
        reply = worker.sock.recv(1)
    except BlockingIOError:
        return None
    except OSError:
        reply = b""
    if reply == b"D":
        worker.owed -= 1
        return True
    worker.owed = 0
    raise worker.read_failure() if reply == b"E" else worker.died()


class Halted(Exception):
    """The driver was asked to stop (inside a wait)."""


class Driver:
    """One run of the fused engine's thread over ``units`` (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        units: list[Unit],
        poller: selectors.BaseSelector,
        wake_r: int,
        on_loop: Callable[[Callable[[], object]], None],
        request: Callable[[str, Any], None],
    ) -> None:
        self.e, self.units, self.poller, self.wake_r = engine, units, poller, wake_r
        self.on_loop, self.request = on_loop, request
        self.queue: deque[Unit] = deque()  # ready units, in the order they became ready
        self.queued_rows = 0
        self.first_ready = 0.0
        self.parked = False  # paused: a loop task waits for the collector to resume, then rings
        self.halt = False  # to stop
        n = engine.rows
        self.ret, self.len = np.zeros(n), np.zeros(n, np.int64)  # per row: the episode so far

    def oldest_action(self) -> int:
        low = self.e.next_action
        for unit in self.units:  # (the unit being written is still stepping: its rest may need its call)
            if unit.stepping and unit.action_no < low:
                low = unit.action_no
        return low

    # -- the loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Read the replies a stopped engine (or a cancelled call) left owed, then reset every unit."""
        for unit in self.units:
            unit.pending, unit.stepping = sum(1 for w in unit.workers if w.owed), False
            unit.staged = [np.empty_like(unit.block.obs(key)) for key in self.e.spec.obs_keys]
        self._wait_units()
        for unit in self.units:
            unit.block.write_seed(self.e.reset_seed(unit.first, unit.index))
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
        clock = e.clock
        while True:
            if self.halt:
                return
            if e.collected():
                return
            room = e.room()
            timeout: float | None = None
            waiting = self.queued_rows
            if e.is_paused():
                if not self.parked:
                    self.parked = True
                    self.request("park", None)
                room = 0
            elif e.held:
                room = 0
            elif room > 0 and waiting:
                late = self.first_ready + e.options.max_wait - perf_counter()
                if waiting >= e.need(room) or late <= 0:
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
        for key, _ in self.poller.select(timeout):
            data = key.data
            if data is None:
                os.read(self.wake_r, 4096)
                if self.halt:
                    raise Halted
                continue
            unit, worker = data
            if unit.dead:
                continue
            try:
                if read_reply(worker) is None:
                    continue
            except Exception as exc:
                worker.failure = exc  # the env raises it from now on
                self._unit_failed(unit, exc)
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
        if not e.options.drop_failed:
            raise exc
        for worker in unit.workers:  # its sockets may hang up from now on; its other replies stay owed
            with contextlib.suppress(KeyError):  # (removed already)
                self.poller.unregister(worker.sock)
        if unit.stepping and unit.pending:
            e.in_flight -= unit.width
        unit.pending, unit.stepping = 0, False
        if unit in self.queue:
            self.queue.remove(unit)
            self.queued_rows -= unit.width
        error = e.drop(unit.index, exc)
        self.request("close", unit.index)
        self._idle_maybe()
        if error is not None:
            raise error

    def _idle_maybe(self) -> None:
        """Tell a ``pause()`` waiting for the steps in flight that they are done."""
        e = self.e
        if e.idle and (self.parked or e.held or e.is_paused()):
            self.on_loop(e.idle_signal.set)

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
        self.e.acting = True  # until its units step (a pause() waiting for idle must not slip in between)
        try:
            self._call(units, taken)
        finally:
            self.e.acting = False

    def _call(self, units: list[Unit], taken: int) -> None:
        e = self.e
        keys = e.spec.obs_keys
        if len(units) == 1:  # into the unit's own buffers (reused: a large fresh array page-faults)
            unit = units[0]
            obs = unit.staged
            for buf, key in zip(obs, keys, strict=True):
                np.copyto(buf, unit.block.obs(key))
            idx = unit.ids
        else:
            obs = [np.concatenate([u.block.obs(key) for u in units]) for key in keys]
            idx = np.concatenate([u.ids for u in units])
        version = e.version
        tensors = {key: torch.from_numpy(a) for key, a in zip(keys, obs, strict=True)}
        start = perf_counter()
        out = e.policy._call_torch(tensors, taken)
        e.clock.policy += perf_counter() - start
        arrays, base = e.called(obs, idx, out, version)
        j = 0
        for unit in units:
            unit.block.write_actions(arrays, j)
            unit.action_no, unit.obs_at_call = base + j, [o[j : j + unit.width] for o in obs]
            j += unit.width
        e.next_action = base + taken
        for unit in units:
            try:
                unit.ring(b"S")
            except Exception as exc:
                self._unit_failed(unit, exc)

    # -- frames -----------------------------------------------------------------------------------
    def _frames(self, unit: Unit) -> None:
        """Append the frames of ``unit``'s step (its episodes counted, its ended sub-envs given new
        trajectory ids)."""
        e, first = self.e, unit.first
        stop = first + unit.width
        reward, terminated, truncated, ended = unit.block.flags()
        keys = e.spec.obs_keys
        finals = (ended, [unit.block.final(key) for key in keys]) if np.count_nonzero(ended) else None
        nxt = [unit.block.obs(key) for key in keys]
        episode = (self.ret[first:stop], self.len[first:stop])
        e.append(
            first, unit.action_no, nxt, (reward, terminated, truncated), episode, unit.obs_at_call, finals
        )
        unit.stepping = False
        self._idle_maybe()
