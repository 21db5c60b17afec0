"""``ProcessVectorEnv`` driven from one thread (the fused central-inference path of ``AsyncEnvCollector``,
``_asyncenv/_fused.py``): its workers' doorbells rung and read with blocking calls, never through a loop.

A :class:`Unit` is what the collector steps as one: a whole ``ProcessVectorEnv`` (all its workers, one
policy call on all its sub-envs) or one ``split()`` part (one worker). While a thread drives them the
workers are *claimed*: the env's own ``step``/``reset`` refuse (a call in flight), its loop reader is not
registered; :func:`release` hands them back, with the replies still owed counted so that the env's next
call (or ``close``) reads them first, as after a cancelled ``step``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._env import Part, ProcessVectorEnv, Worker
from ._slots import Block

__all__ = ["Unit", "is_process_env", "read_reply", "release"]


def is_process_env(env: Any) -> bool:
    """A ``ProcessVectorEnv`` or one of its ``split()`` parts (what the fused path drives)."""
    return isinstance(env, (ProcessVectorEnv, Part))


class Unit:
    """Env ``index`` of the collector (a ``ProcessVectorEnv`` or a part), its rows ``first`` to
    ``first + width - 1``; the workers it steps together (its :attr:`block`), claimed from the env."""

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
                raise self.fail(worker, worker.died()) from None
            worker.owed += 1
        self.pending = len(self.workers)
        self.stepping = command == b"S"

    def fail(self, worker: Worker, error: BaseException) -> BaseException:
        """``worker`` failed with ``error``: the env raises it from now on; the unit is dead."""
        worker.failure = error
        self.dead = True
        return error


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


def release(units: list[Unit]) -> None:
    """Hand the workers back to their envs (from the loop's thread, once the driving thread has ended)."""
    for unit in units:
        for worker in unit.workers:
            worker.waiting = False
