"""The worker: builds its env, policy and rollout, then serves commands (a process or a thread).

Blocking, synchronous code. Batches go into shared-memory slots the parent owns; one small frame per
batch on the control socket tells the parent which slot is ready.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import torch

from .._core._options import RolloutOptions, WeightSchedule
from .._core._processes import become_worker
from .._core._resume import load_member, worker_state
from .._core._rng import RolloutRNG
from .._core._torch_settings import TorchSettings
from .._envs._adapter import check_env
from .._envs._rebuild import env_factory
from .._observe._events import Restarted
from .._policies._weights import as_weights, copy_weights, module_weights
from .._rollout._core import build_rollout
from .._transport._flat import FlatLayout, layout_of
from .._transport._messages import (
    Attach,
    BatchReady,
    Call,
    Close,
    Collect,
    GetState,
    LoadState,
    LoadWeights,
    Operation,
    Ready,
    Release,
    Reset,
    Result,
    RunFree,
    SetSeed,
    failure,
)
from .._transport._wire import BlockingChannel
from ._answers import HALTED, READS, MemberIO, control_layout, read, unversioned

__all__ = [
    "HALTED",
    "Worker",
    "WorkerSpec",
    "build_env",
    "close_after_failure",
    "control_layout",
    "start_thread_worker",
    "worker_main",
]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; pickled into the process (the env fn and policy are cloudpickled)."""

    index: int
    num_workers: int
    #: the env constructor and the policy, cloudpickled (the policy once, shared by every worker's spec)
    payload: bytes
    policy_payload: bytes
    #: this worker's options: its own ``frames_per_batch`` and trajectory ids
    #: (:meth:`RolloutOptions.for_member`); batches stay in the shared-memory slots (no storing device)
    rollout: RolloutOptions
    schedule: WeightSchedule
    control_name: str
    #: a weight-sync receiver spec (``spec.open(index)``), or None for a policy without weights
    weights: Any
    #: torch's intra-op threads in a worker process (``num_sub_threads``)
    num_threads: int | None
    in_process: bool
    show_warnings: bool
    #: the torch settings of the thread that entered the collector: a serial worker's thread takes them
    #: (a process sets ``num_threads``)
    torch_settings: TorchSettings | None = None
    #: a worker body of another kind, ``run(chan, spec)`` (it sends ``Ready`` and serves until ``Close``);
    #: None: the rollout :class:`Worker`
    run: Any = None

    @property
    def max_policy_lag(self) -> int | None:
        return self.schedule.max_policy_lag


def build_env(create_env_fn: Any) -> Any:
    """The worker's env: ``create_env_fn()``, or ``create_env_fn`` itself when it is an env instance (an env
    *class* has ``step`` too, and is called like any other constructor)."""
    if hasattr(create_env_fn, "step") and not isinstance(create_env_fn, type):
        return create_env_fn
    return create_env_fn()


def close_after_failure(env: Any, exc: BaseException) -> None:
    """Close ``env`` after ``exc``; a close that fails too (a half-built env, e.g. torchrl's "trying to close
    a closed environment") becomes a note on ``exc``, so the real cause is what the trainer sees."""
    try:
        env.close()
    except Exception as close_exc:
        exc.add_note(f"(closing the env afterwards failed too: {type(close_exc).__name__}: {close_exc})")


#: serial workers are threads of one process and share torch's global RNG: a seeded worker's batch is
#: collected under this lock with its own RNG state swapped in, so that its samples do not depend on the
#: other threads' timing (a worker process owns the whole generator, and needs no lock)
_SERIAL_RNG_LOCK = threading.Lock()


class _Closing(Exception):
    """The parent asked the worker to stop."""


class _StopFlag:
    """``is_set()`` reads this worker's entry of the shared stop array (preemption)."""

    def __init__(self, array: np.ndarray, index: int) -> None:
        self._array = array
        self._index = index

    def is_set(self) -> bool:
        return bool(self._array[self._index])

    def halted(self) -> bool:
        return int(self._array[self._index]) == HALTED


class _Counting:
    """A stop signal that counts the steps begun in the worker's shared ``progress`` entry (the rollout
    reads it once per step), so the parent can count what a worker that dies loses."""

    def __init__(self, stop: Any, progress: np.ndarray, index: int) -> None:
        self._stop = stop
        self._progress = progress
        self._index = index

    def is_set(self) -> bool:
        self._progress[self._index] += 1
        return bool(self._stop.is_set())


class _StopOrStale:
    """Set when the parent stops the worker (preemption, shutdown) or when the weights the rollout runs
    fall below the worker's version floor (``update_weights(flush=True)``, ``max_policy_lag``): read at
    every step, two array reads."""

    def __init__(self, stop: np.ndarray, floor: np.ndarray, index: int, rollout: Any) -> None:
        self._stop = stop
        self._floor = floor
        self._index = index
        self._rollout = rollout

    def is_set(self) -> bool:
        i = self._index
        return bool(self._stop[i]) or int(self._floor[i]) > self._rollout.policy_version


class Worker(MemberIO):
    def __init__(self, spec: WorkerSpec, chan: BlockingChannel) -> None:
        self.spec, self.chan = spec, chan
        create_env_fn = cloudpickle.loads(spec.payload)
        policy = cloudpickle.loads(spec.policy_payload)
        self.env = env = build_env(create_env_fn)
        try:
            check_env(env)
            self.rollout, self.policy, self.random_policy = build_rollout(
                env,
                policy,
                spec.rollout,
                spec.schedule,
                copy_module=False,
                factory=env_factory(create_env_fn, spec.rollout.restart),
                on_env=lambda new_env: setattr(self, "env", new_env),
            )
            self.rollout.output_specs()
            self.rng = RolloutRNG()
            super().__init__(spec)  # the control block, the weight receiver, the slots
            self.stop = _StopFlag(self.array("stop"), spec.index)
            self._published, self._floor, self._discarded, self._progress = (
                self.array(k) for k in ("published", "floor", "discarded", "progress")
            )
            #: the policy version of the last batch sent; whether the trajectories in flight took new ids
            #: since (see ``collect``)
            self._sent_version, self._split = 0, False
            #: run_free: the slot of the last batch sent (unread while it is not handed back)
            self._sent_slot: int | None = None
            self._stop_or_stale = _StopOrStale(self.array("stop"), self._floor, spec.index, self.rollout)
            self.frames = 0
            if self.rollout.restarts is not None:  # each one reported as it happens, batch or not
                self.rollout.restarts.on_restart = lambda r: chan.send(Restarted.of(spec.index, r))
        except BaseException as exc:
            close_after_failure(env, exc)
            raise

    # -- layout and batches ----------------------------------------------------------------------
    def layout(self) -> tuple[FlatLayout, tuple[int, ...]]:
        batch = self.rollout.layout()
        return layout_of(batch), tuple(batch.batch_size)

    def attach(self, msg: Attach) -> None:
        self.map_slots(msg, *self.layout())

    def load_weights(self) -> int:
        if self.weights is not None and isinstance(self.policy, torch.nn.Module):
            self.rollout.policy_version = self.weights.load(self.policy, self.rollout.policy_version)
        return self.rollout.policy_version

    def _below_floor(self) -> bool:
        """Whether the policy runs weights older than the version floor the parent set: a batch collected
        with them is not delivered."""
        return int(self._floor[self.spec.index]) > self.rollout.policy_version

    def _behind(self) -> bool:
        """Whether a batch must not start yet: the weights are below the version floor, or more than
        ``max_policy_lag`` behind the published version."""
        lag = self.spec.max_policy_lag
        i = self.spec.index
        stale = lag is not None and int(self._published[i]) - self.rollout.policy_version > lag
        return stale or self._below_floor()

    def load_within_lag(self, chan: BlockingChannel) -> None:
        """Load new weights; wait for them while too far behind (``max_policy_lag``, a version floor)."""
        self.load_weights()
        if self.weights is None:
            return
        while self._behind():
            # the newer weights are on their way (a message, a write in progress): take them in
            with self.rollout.clock.waiting():
                incoming = chan.recv(timeout=0.001)
            if incoming is not None:
                self.handle_between_batches(chan, incoming)
            self.load_weights()

    def handle_between_batches(self, chan: BlockingChannel, msg: Any) -> None:
        """Messages a worker serves while it is not collecting (``Close`` raises ``_Closing``)."""
        if self.weights is not None and self.weights.on_message(msg):
            return
        if isinstance(msg, Call):
            chan.send(self.call(msg))
        elif isinstance(msg, Release):
            self.free.add(msg.slot)
        elif isinstance(msg, Close):
            raise _Closing
        elif isinstance(msg, Attach):
            self.attach(msg)
        else:  # pragma: no cover - a protocol bug
            raise TypeError(f"unexpected message {msg!r}")

    def collect(self, chan: BlockingChannel, slot: int, random: bool) -> BatchReady:
        """One batch into ``slot``, collected with weights no older than the version floor.

        A rollout overtaken by newer weights stops at its next step, its frames are discarded (and
        counted) and it starts again on the new weights. The env is never reset for this: the
        trajectories in flight go on under fresh trajectory ids whenever frames of theirs will be
        missing (discarded here, or in a batch the parent drops as stale: any batch sent with a version
        below the floor), so that one id never spans a gap. The episodes that ended in discarded frames
        are still reported, with this batch.

        The parent may drop the last batch sent after this one started (its floor rose meanwhile) and
        deliver this one: when that batch is still unread and older, this one carries spare ids (see
        :meth:`_spare_ids`) for the parent to rename the trajectories it continues."""
        into = self.slots[slot].td  # the batch is written straight into the shared-memory slot
        unread = self._sent_slot is not None and self._sent_slot != slot and self._sent_slot not in self.free
        stop: Any = self._stop_or_stale if self.weights is not None else self.stop
        if self.spec.rollout.restart is not None:  # the parent replaces a worker that dies
            stop = _Counting(stop, self._progress, self.spec.index)
        returns: list[float] = []
        lengths: list[int] = []
        while True:
            self.load_within_lag(chan)
            self._progress[self.spec.index] = 0
            if self._sent_version < int(self._floor[self.spec.index]) and not self._split:
                # frames since the last batch sent will be missing: new ids (the env is not reset)
                self.rollout.load_state_dict(self.rollout.state_dict())
                self._split = True
            run = lambda: self.rng.run(  # noqa: E731
                lambda: self.rollout.collect(random=random, stop=stop, into=into)
            )
            if self.spec.in_process and self.rng.state is not None:
                with _SERIAL_RNG_LOCK:
                    result = run()
            else:
                result = run()
            returns += result.episode_returns
            lengths += result.episode_lengths
            if self.stop.is_set() or self.weights is None or not self._below_floor():
                break
            self._discarded[self.spec.index] += result.frames  # overtaken by newer weights
            self._split = False
        self.frames += result.frames
        self._progress[self.spec.index] = 0
        spare_ids = self._spare_ids() if unread and not self._split else ()
        self._sent_version = self.rollout.policy_version
        self._split = False
        return BatchReady(
            slot=slot,
            steps=result.steps,
            frames=result.frames,
            policy_version=self.rollout.policy_version,
            episode_returns=returns,
            episode_lengths=lengths,
            spare_ids=spare_ids,
            time_split=self.rollout.clock.totals(),
        )

    def _spare_ids(self) -> tuple[int, ...]:
        """Fresh ids, one per env, when the parent may drop the previous batch (still unread) and deliver
        this one, whose trajectories go on from it: this one runs newer weights, and the floor may pass
        the previous one's version (``max_policy_lag``: any later update; a flush: one raised already,
        or one whose floor is not written yet: the parent writes floors before ``published``)."""
        version = self.rollout.policy_version
        if self.weights is None or version <= self._sent_version:
            return ()  # same weights: the parent drops both batches or neither
        i = self.spec.index
        if self.spec.max_policy_lag is None:
            published = int(self._published[i])  # read before the floor (written in the other order)
            if published >= version and int(self._floor[i]) <= self._sent_version:
                return ()
        return tuple(self.rollout._new_ids(max(self.rollout.env.numel, 1)).tolist())

    # -- control operations (Call.op): one method per Operation type, dispatched by _OPERATIONS --------
    def set_seed(self, op: SetSeed) -> int:
        last = int(self.env.set_seed(op.seed))
        if self.rollout.restarts is not None:
            self.rollout.restarts.seeded(op.seed)
        self.random_policy.set_seed(op.seed)
        self.rng.seed(op.seed)
        self.rollout.seed_groups(op.seed)
        self.rollout.reset()
        return last

    def reset(self, op: Reset) -> None:
        self.rollout.reset()

    def get_state(self, op: GetState) -> dict[str, Any]:
        unversioned(op)
        return {**self.rollout.state_dict(), "frames": self.frames, **worker_state(self, op.envs)}

    def load_state(self, op: LoadState) -> None:
        unversioned(op)
        state = dict(op.state)
        self.frames, self._sent_version = int(state.get("frames", 0)), int(state.get("sent_version", 0))
        load_member(self.rollout, self.rng, self.random_policy, state, self.frames)
        if state.get("policy") is not None and isinstance(self.policy, torch.nn.Module):  # the newest
            copy_weights(module_weights(self.policy), as_weights(state["policy"]))

    def call(self, msg: Call) -> Result:
        handler = _OPERATIONS.get(type(msg.op))
        if handler is None:  # pragma: no cover - a protocol bug
            raise TypeError(f"unknown worker operation {msg.op!r}")
        return Result(msg.request_id, handler(self, msg.op))

    # -- serving ---------------------------------------------------------------------------------
    def serve(self, chan: BlockingChannel) -> None:
        """Sync mode: one batch per ``Collect``; ``RunFree`` switches to async mode."""
        try:
            while True:
                with self.rollout.clock.waiting():  # for the parent's next Collect
                    msg = chan.recv()
                if isinstance(msg, Collect):
                    chan.send(self.collect(chan, msg.slot, msg.random))
                elif isinstance(msg, RunFree):
                    self.run_free(chan, msg)
                else:
                    self.handle_between_batches(chan, msg)
        except _Closing:
            return

    def run_free(self, chan: BlockingChannel, msg: RunFree) -> None:
        """Async mode: collect continuously, at most one batch ahead of the parent (two slots); once the
        stop flag is set (``request_stop()``, shutdown) start no batch, only serve the parent."""
        self.free = set(range(len(self.slots)))
        while True:
            while True:
                if self.free and not self.stop.is_set():
                    incoming = chan.poll()
                else:
                    with self.rollout.clock.waiting():  # both slots unread, or stopped: for the parent
                        incoming = chan.recv()
                if incoming is None:
                    break
                self.handle_between_batches(chan, incoming)
            slot = min(self.free)
            self.free.discard(slot)
            ready = self.collect(chan, slot, random=self.frames < msg.random_frames)
            if self.stop.halted():  # cut short by request_stop(): never delivered, so not sent
                self._discarded[self.spec.index] += ready.frames
                self.free.add(slot)
                continue
            chan.send(ready)
            self._sent_slot = slot

    def close(self) -> None:
        super().close()
        self.env.close()


#: the worker's method for each control operation
_OPERATIONS: dict[type[Operation], Callable[[Worker, Any], Any]] = {
    SetSeed: Worker.set_seed,
    Reset: Worker.reset,
    GetState: Worker.get_state,
    LoadState: Worker.load_state,
    LoadWeights: lambda worker, op: worker.load_weights(),
    **{read_op: lambda worker, op: read(op, worker.env, worker.policy) for read_op in READS},
}


def worker_main(sock: socket.socket, spec: WorkerSpec) -> None:
    """Entry point of a worker process (or thread, for the serial backend)."""
    chan = BlockingChannel(sock)
    worker = None
    failed = False
    try:
        if not spec.in_process:
            become_worker(sock, "aiocollect-parent-watch", spec.show_warnings)
            if spec.num_threads is not None:
                torch.set_num_threads(spec.num_threads)
        elif spec.torch_settings is not None:
            spec.torch_settings.apply()
        if spec.run is not None:
            spec.run(chan, spec)
            return
        worker = Worker(spec, chan)
        layout, batch_size = worker.layout()
        chan.send(
            Ready(
                layout=layout,
                batch_size=batch_size,
                frames_per_batch=worker.rollout.frames_per_batch,
                policy_version=worker.rollout.policy_version,
            )
        )
        worker.serve(chan)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone or closed the channel: just exit
    except BaseException as exc:
        failed = True
        try:
            chan.send(failure(exc, f"worker {spec.index}"))
        except OSError:
            pass
    finally:
        try:
            if worker is not None:
                try:
                    worker.close()
                except Exception:
                    if not failed:  # after a failure the cause is sent already: a close error is noise
                        raise
        finally:
            sock.close()


def start_thread_worker(sock: socket.socket, spec: WorkerSpec) -> threading.Thread:
    thread = threading.Thread(
        target=worker_main, args=(sock, spec), name=f"aiocollect-worker-{spec.index}", daemon=True
    )
    thread.start()
    return thread
