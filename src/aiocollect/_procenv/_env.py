"""``ProcessVectorEnv``: the parent side. Starts the workers (through the forkserver, synchronously: the
spaces are known when the constructor returns), owns their shared-memory slots, and steps them with
one-byte doorbells (``_doorbell.py``)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import select
import signal
import socket
from collections.abc import Sequence
from typing import Any, NoReturn, cast

import anyio
import anyio.to_thread
import cloudpickle
import gymnasium as gym
import numpy as np

from .._core._errors import WorkerDiedError
from .._core._mistakes import check_main_guard
from .._core._processes import reaped, signal_group, started
from .._envs._spaces import NestedKey, action_entries, action_specs, nest_obs, observation_specs
from .._transport._messages import Failed
from .._transport._wire import BlockingChannel, FrameReader
from .._workers._preload import PRELOAD
from ._doorbell import ReplyReader
from ._slots import Block, Slots
from ._worker import worker_main

__all__ = ["Part", "ProcessVectorEnv", "Worker"]


class Worker:
    """One worker process, its socket and slots, and the sub-envs ``[lo, hi)`` it steps."""

    def __init__(self, index: int, process: Any, sock: socket.socket, lo: int) -> None:
        self.index, self.process, self.sock, self.lo = index, process, sock, lo
        self.hi = lo
        self.slots: Slots | None = None
        self.owed = 0  # replies the worker owes (a caller cancelled while it stepped)
        self.waiting = False
        self.failure: BaseException | None = None
        self.reader = ReplyReader(sock)

    def died(self) -> WorkerDiedError:  # once it hung up: its exit code after it exits (waits up to 5 s)
        self.process.join(5)
        return WorkerDiedError(self.index, self.process.exitcode)

    def read_failure(self, timeout: float = 10.0) -> BaseException:
        """The error frame that follows an ``E`` reply (blocking, up to ``timeout`` seconds between
        reads): the worker's error with its traceback, or :class:`WorkerDiedError` if it hung up."""
        reader = FrameReader()
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                if not select.select([self.sock], [], [], timeout)[0]:
                    return RuntimeError(f"ProcessVectorEnv worker {self.index} sent no error after 'E'")
                continue
            except OSError:
                data = b""
            if not data:
                return self.died()
            for msg in reader.feed(data):
                return msg.error if isinstance(msg, Failed) else RuntimeError(f"unexpected reply {msg!r}")


def _split(env_fns: Sequence[Any], num_workers: int) -> list[list[Any]]:
    base, extra = divmod(len(env_fns), num_workers)
    out, lo = [], 0
    for w in range(num_workers):
        hi = lo + base + (w < extra)
        out.append(list(env_fns[lo:hi]))
        lo = hi
    return out


class ProcessVectorEnv:
    """Gymnasium envs stepped in worker processes, behind :class:`AsyncVectorEnvProtocol`: the
    central-inference env of :class:`aiocollect.AsyncEnvCollector` (the policy runs once, in the
    trainer, on the observations of every worker).

    ``env_fns`` are split into ``num_workers`` consecutive shares; each worker process (started through
    aiocollect's forkserver) steps its share as one gymnasium vector env with same-step autoreset.
    Observations, rewards, flags and actions travel through shared-memory slots the parent creates and
    unlinks; a step is one byte on each worker's socket each way (awaited through the loop's readiness),
    nothing pickled. Sub-env ``k`` of ``reset(seed=s)`` is seeded with ``s + k``.

    The constructor starts the workers and waits until they are ready (it blocks: build it in an env fn
    of ``AsyncEnvCollector``, which builds envs in a worker thread, or with ``anyio.to_thread``). An env
    error in a worker is raised by ``step``/``reset`` with its own type and the worker's traceback as a
    note; a worker that dies raises :class:`aiocollect.WorkerDiedError`. ``close()`` (idempotent, also
    after a cancelled step) stops the workers and removes the segments.

    ``split()`` gives one async vector env per worker, sharing these processes: given to
    ``AsyncEnvCollector`` as its envs, the policy runs on whichever workers are ready (``min_batch``)
    while the others still step.

    Args:
        env_fns: callables returning gymnasium envs (pickled with cloudpickle), or, one per worker,
            callables returning a gymnasium vector env.
        num_workers: the number of worker processes (default: ``min(len(env_fns), os.cpu_count())``).
        show_warnings: keep the workers' warnings (default: silenced).

    Example:
        >>> import anyio, gymnasium as gym, numpy as np
        >>> from aiocollect import ProcessVectorEnv
        >>> async def main():
        ...     env = await anyio.to_thread.run_sync(
        ...         lambda: ProcessVectorEnv([lambda: gym.make("CartPole-v1")] * 8, num_workers=2))
        ...     obs, info = await env.reset(seed=0)
        ...     obs, reward, terminated, truncated, info = await env.step(np.zeros(8, np.int64))
        ...     await env.close()
        ...     print(env.num_envs, obs.shape, reward.shape)
        >>> anyio.run(main)
        8 (8, 4) (8,)
    """

    def __init__(
        self, env_fns: Sequence[Any], num_workers: int | None = None, *, show_warnings: bool = False
    ) -> None:
        import os

        if isinstance(env_fns, (str, bytes)) or not isinstance(env_fns, Sequence) or not env_fns:
            raise TypeError(
                "env_fns must be a non-empty list of callables returning gymnasium envs, e.g. "
                f"[lambda: gymnasium.make('CartPole-v1')] * 64; got {env_fns!r}"
            )
        if any(not callable(fn) for fn in env_fns):
            raise TypeError(f"env_fns must hold callables returning gymnasium envs; got {list(env_fns)!r}")
        if num_workers is None:
            num_workers = min(len(env_fns), os.cpu_count() or 1)
        if (
            isinstance(num_workers, bool)
            or not isinstance(num_workers, int)
            or not 1 <= num_workers <= len(env_fns)
        ):
            raise ValueError(
                f"num_workers must be an int from 1 to len(env_fns) = {len(env_fns)}, got {num_workers!r}"
            )
        try:
            payloads = [cloudpickle.dumps(share) for share in _split(env_fns, num_workers)]
        except Exception as exc:
            raise TypeError(
                f"env_fns must pickle with cloudpickle to reach the worker processes: {exc}"
            ) from exc
        self._workers: list[Worker] = []
        self._closed = False
        self._parts_open = 0
        try:
            self._start(payloads, show_warnings)
        except BaseException:
            self._reap()
            raise

    # -- start ------------------------------------------------------------------------------------
    def _start(self, payloads: list[bytes], show_warnings: bool) -> None:
        check_main_guard("ProcessVectorEnv", "forkserver", other_fix="step the envs in this process")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        for index, payload in enumerate(payloads):
            parent, child = socket.socketpair()
            process = ctx.Process(
                target=worker_main,
                args=(child, index, payload, show_warnings),
                name=f"aiocollect-envs-{index}",
                daemon=False,
            )
            self._workers.append(Worker(index, process, parent, 0))
            try:
                process.start()
            finally:
                child.close()
            started(process)
        lo = 0
        for worker in self._workers:
            n, obs_space, act_space = self._hello(worker)
            if worker.index == 0:
                self.single_observation_space: gym.Space[Any] = obs_space
                self.single_action_space: gym.Space[Any] = act_space
            elif (obs_space, act_space) != (self.single_observation_space, self.single_action_space):
                raise ValueError(
                    f"ProcessVectorEnv: worker {worker.index}'s envs have the spaces {obs_space}, "
                    f"{act_space} "
                    f"and worker 0's {self.single_observation_space}, {self.single_action_space}: every env "
                    "needs the same spaces"
                )
            worker.lo, worker.hi = lo, lo + n
            lo += n
        #: the number of sub-envs
        self.num_envs: int = lo
        self._obs_specs = observation_specs(self.single_observation_space)
        self._act_specs = action_specs(self.single_action_space)
        for worker in self._workers:
            worker.slots = Slots(self._obs_specs, self._act_specs, worker.hi - worker.lo)
            BlockingChannel(worker.sock).send(worker.slots.name)
        self._block = Block(self._workers)
        for worker in self._workers:
            reply = worker.sock.recv(1)
            if reply == b"E":
                raise worker.read_failure()
            if reply != b"D":
                raise worker.died()
            worker.sock.setblocking(False)

    def _hello(self, worker: Worker) -> tuple[int, Any, Any]:
        try:
            msg = BlockingChannel(worker.sock).recv()
        except (EOFError, OSError):
            raise worker.died() from None
        if isinstance(msg, Failed):
            raise msg.error
        n, obs_space, act_space = cast("tuple[int, Any, Any]", msg)
        return n, obs_space, act_space

    # -- the protocol -----------------------------------------------------------------------------
    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every sub-env (sub-env ``k`` seeded with ``seed + k``); ``options`` must be ``None``."""
        return await self._reset(self._block, seed, options)

    async def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every sub-env with ``actions`` ``[num_envs, ...]`` (same-step autoreset: an ended sub-env's
        final observation is in ``info["final_obs"]``, ``info["_final_obs"]`` the mask)."""
        return await self._step(self._block, actions)

    async def close(self) -> None:
        """Stop the workers (a grace period, then SIGTERM/SIGKILL of their process groups) and remove the
        shared-memory segments; idempotent, shielded from cancellation."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for worker in self._workers:
                with contextlib.suppress(OSError):
                    worker.sock.send(b"C")
            failed = any(w.failure is not None for w in self._workers)
            with anyio.move_on_after(1.0 if failed else 5.0):
                for worker in self._workers:
                    if worker.process.exitcode is None:
                        await anyio.wait_readable(worker.process.sentinel)
            for worker in self._workers:
                worker.reader.unwatch()
            await anyio.to_thread.run_sync(self._reap)

    def split(self) -> list[Any]:
        """One async vector env per worker (its sub-envs, in order), sharing this env's processes: give
        them to ``AsyncEnvCollector`` as its envs to run the policy on whichever workers are ready. The
        processes stop when every part is closed. Do not step this env itself meanwhile."""
        if self._parts_open:
            raise RuntimeError("ProcessVectorEnv.split() was called already: use the parts it gave")
        self._parts_open = len(self._workers)
        return [Part(self, worker) for worker in self._workers]

    def __repr__(self) -> str:
        return (
            f"ProcessVectorEnv(num_envs={getattr(self, 'num_envs', '?')}, num_workers={len(self._workers)})"
        )

    # -- stepping ---------------------------------------------------------------------------------
    async def _reset(
        self, block: Block, seed: int | None, options: dict[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        if options is not None:
            raise ValueError(
                f"ProcessVectorEnv.reset takes no options (got {options!r}): it resets every sub-env, and "
                "ended sub-envs are reset inside step (same-step autoreset)"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self._check(block.workers)
        await self._drain(block.workers)
        block.write_seed(seed)
        await self._run(block.workers, b"R")
        return self._nest({k: block.obs(k, copy=True) for k in self._obs_specs}), {}

    async def _step(self, block: Block, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        self._check(block.workers)
        n = block.width
        try:
            leaves = {k: np.asarray(v) for k, v in action_entries(self.single_action_space, actions).items()}
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(
                f"actions must be a batch of {n} actions of {self.single_action_space} "
                f"(a dict or tuple of [{n}, ...] arrays for a Dict or Tuple space); got {actions!r}"
            ) from exc
        for key, value in leaves.items():
            if value.shape[:1] != (n,) or value.shape[1:] != self._act_specs[key].shape:
                raise ValueError(
                    f"actions: {key!r} has the shape {value.shape}, expected "
                    f"{(n, *self._act_specs[key].shape)} (one action per sub-env)"
                )
        await self._drain(block.workers)
        block.write_actions(leaves)
        await self._run(block.workers, b"S")
        reward, terminated, truncated, ended = block.flags(copy=True)
        info: dict[str, Any] = {}
        if np.count_nonzero(ended):
            final, finals = np.empty(n, dtype=object), {key: block.final(key) for key in self._obs_specs}
            for j in ended.nonzero()[0].tolist():
                final[j] = self._nest({key: value[j].copy() for key, value in finals.items()})
            info = {"final_obs": final, "_final_obs": ended}
        return (
            self._nest({k: block.obs(k, copy=True) for k in self._obs_specs}),
            reward,
            terminated,
            truncated,
            info,
        )

    def _nest(self, flat: dict[NestedKey, np.ndarray]) -> Any:
        """``{key: array}`` as gymnasium gives it: the array, or a nested dict for a Dict space."""
        if not isinstance(self.single_observation_space, gym.spaces.Dict):
            return flat["observation"]
        return nest_obs(flat)

    # -- the doorbells ----------------------------------------------------------------------------
    def _check(self, workers: list[Worker]) -> None:
        if self._closed:
            raise RuntimeError("ProcessVectorEnv is closed")
        for worker in workers:
            if worker.failure is not None:
                raise worker.failure
            if worker.waiting:
                raise RuntimeError(
                    "ProcessVectorEnv: a call while another one on the same workers is in flight "
                    "(await each reset/step before the next)"
                )

    async def _drain(self, workers: list[Worker]) -> None:
        """Take the replies a cancelled call left unread, so that the slots are the worker's no more."""
        for worker in workers:
            while worker.owed:
                await self._reply(worker)

    async def _run(self, workers: list[Worker], command: bytes) -> None:
        for worker in workers:
            try:
                worker.sock.send(command)
            except OSError:
                await self._fail(worker)
            worker.owed += 1
        for worker in workers:
            await self._reply(worker)

    async def _reply(self, worker: Worker) -> None:
        worker.waiting = True
        try:
            reply = await worker.reader.reply()
        finally:
            worker.waiting = False
        if reply == b"D":
            worker.owed -= 1
            return
        await self._fail(worker, error_frame=reply == b"E")

    async def _fail(self, worker: Worker, *, error_frame: bool = False) -> NoReturn:
        """Raise (from now on) ``worker``'s error: the frame that follows its ``E`` reply (``error_frame``),
        else its death (:class:`WorkerDiedError` with its exit code, once it exits: up to 5 s)."""
        error: BaseException
        if error_frame:
            await anyio.wait_readable(worker.sock)  # the error frame (or the hang-up) follows
            error = await anyio.to_thread.run_sync(worker.read_failure)
        else:
            with anyio.move_on_after(5.0):
                if worker.process.exitcode is None:
                    await anyio.wait_readable(worker.process.sentinel)
            error = WorkerDiedError(worker.index, worker.process.exitcode)
        worker.failure = error
        worker.owed = 0
        raise error

    # -- stop and reap ----------------------------------------------------------------------------
    def _reap(self) -> None:
        """Stop what is left of the workers and free every resource (blocking; also for a failed start)."""
        for worker in self._workers:
            process = worker.process
            if process.pid is not None:
                if process.exitcode is None:
                    signal_group(process, signal.SIGTERM)
                    process.join(1.0)
                signal_group(process, signal.SIGKILL)  # and whatever its envs started
                process.join()
                reaped(process)
                with contextlib.suppress(ValueError):
                    process.close()
            worker.sock.close()
            if worker.slots is not None:
                worker.slots.close(unlink=True)
                worker.slots = None

    async def _close_part(self) -> None:
        self._parts_open -= 1
        if self._parts_open <= 0:
            await self.close()


class Part:
    """One worker's sub-envs of a :class:`ProcessVectorEnv`, an async vector env of their own."""

    def __init__(self, env: ProcessVectorEnv, worker: Worker) -> None:
        self._env, self._worker, self._block = env, worker, Block([worker])
        self._closed = False
        self.num_envs: int = worker.hi - worker.lo
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        return await self._env._reset(self._block, seed, options)

    async def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        return await self._env._step(self._block, actions)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._env._close_part()

    def __repr__(self) -> str:
        w = self._worker
        return f"ProcessVectorEnv.split()[{w.index}] (sub-envs {w.lo}-{w.hi - 1})"
