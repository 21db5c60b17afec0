"""The node processes of :class:`DistributedCollector` and :class:`RPCCollector` as their launchers see
them: watched (their exit, without polling), stopped (a grace period, then terminated, then killed) and
reaped. ``MPNode``: a process on this machine (``launcher="mp"``); ``JobNode``: a submitit job;
``ExternalNode``: a node started by someone else (the delayed launcher)."""

from __future__ import annotations

import abc
import contextlib
import functools
import multiprocessing.connection as mp_connection
import os
import signal
from typing import Any

import anyio
import anyio.to_thread

__all__ = ["ExternalNode", "JobNode", "MPNode", "NodeProcess"]


class NodeProcess(abc.ABC):
    """A started node, as its launcher sees it."""

    @property
    @abc.abstractmethod
    def exitcode(self) -> int | None:
        """The exit code once it ended, when the launcher knows it."""

    @abc.abstractmethod
    async def wait(self) -> None:
        """Return when the node ended (never returns for a node the launcher cannot watch)."""

    @abc.abstractmethod
    async def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for it to end, then end it (kill it, or cancel its job)."""

    def describe(self) -> str:
        return ""


class MPNode(NodeProcess):
    """A node process on this machine. It leads a process group of its own (``node_entry``), so that
    whatever it leaves behind (its workers' forkserver, when it is killed) goes with it: the group is
    killed once the node has ended, before it is reaped (its pid, the group's id, cannot be reused
    until then)."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.pid = process.pid
        self._exited = anyio.Event()
        self._watching = False
        self._exitcode: int | None = None
        self._reaped = False
        self._closed = False
        self._close_when_done = False

    def _ended(self, timeout: float | None = 0.0) -> bool:
        """Whether the process ended (waiting up to ``timeout``; call it in a thread to wait): its
        sentinel is readable; nothing is reaped."""
        return self._reaped or bool(mp_connection.wait([self.process.sentinel], timeout))

    def _reap(self) -> None:
        """Once it ended: kill what is left of its process group, then reap it."""
        if self._reaped or not self._ended():
            return
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)  # its own group (node_entry): its forkserver, strays
        self.process.join()
        self._exitcode = self.process.exitcode
        self._reaped = True

    @property
    def exitcode(self) -> int | None:
        self._reap()
        return self._exitcode

    async def wait(self) -> None:
        if not self._watching and not self._reaped:
            self._watching = True
            try:
                # the sentinel is readable once the process ended: no polling
                await anyio.wait_readable(self.process.sentinel)
            finally:
                self._watching = False
                if self._close_when_done:
                    self._close()
            self._reap()
            self._exited.set()
        await self._exited.wait()

    async def stop(self, grace: float) -> None:
        with anyio.CancelScope(shield=True):
            if not await anyio.to_thread.run_sync(self._ended, grace):
                # killed, not terminated: a stopped or hung node would not act on SIGTERM (it had its
                # grace period); its group (forkserver, workers) goes with it in _reap
                self.process.kill()
                await anyio.to_thread.run_sync(self._ended, None)
            self._reap()
            # release its sentinel pipe now (left to the garbage collector, 2 fds a node stayed open);
            # a watcher still waiting on it closes it when it wakes (at once: the process ended)
            if self._watching:
                self._close_when_done = True
            else:
                self._close()

    def _close(self) -> None:
        if self._reaped and not self._closed:
            self._closed = True
            self.process.close()

    def describe(self) -> str:
        return f"pid {self.pid}"


class JobNode(NodeProcess):
    """A submitit job (local or Slurm)."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self._exited = anyio.Event()

    @property
    def _popen(self) -> Any:
        return getattr(self.job, "_process", None)  # LocalJob keeps its subprocess.Popen there

    @property
    def pid(self) -> int | None:
        popen = self._popen
        return popen.pid if popen is not None else None

    @property
    def exitcode(self) -> int | None:
        popen = self._popen
        return popen.poll() if popen is not None else None

    async def wait(self) -> None:
        popen = self._popen
        if popen is not None:
            await anyio.to_thread.run_sync(popen.wait, abandon_on_cancel=True)
        else:  # a Slurm job: submitit's own watcher polls the scheduler, in a thread
            await anyio.to_thread.run_sync(self.job.wait, abandon_on_cancel=True)
        self._exited.set()

    async def stop(self, grace: float) -> None:
        with anyio.CancelScope(shield=True):
            popen = self._popen
            if popen is not None:
                with contextlib.suppress(Exception):
                    await anyio.to_thread.run_sync(popen.wait, grace)
                if popen.poll() is None:
                    popen.terminate()
                    with contextlib.suppress(Exception):
                        await anyio.to_thread.run_sync(popen.wait, 2.0)
                if popen.poll() is None:
                    popen.kill()
                    await anyio.to_thread.run_sync(popen.wait)
                return
            with anyio.move_on_after(grace):
                await self._exited.wait()
            if not self._exited.is_set():
                with contextlib.suppress(Exception):
                    await anyio.to_thread.run_sync(functools.partial(self.job.cancel, check=False))

    def describe(self) -> str:
        return f"submitit job {self.job.job_id}"


class ExternalNode(NodeProcess):
    """A node started by someone else (the delayed launcher): only its connection tells it ended."""

    @property
    def exitcode(self) -> int | None:
        return None

    async def wait(self) -> None:
        await anyio.sleep_forever()

    async def stop(self, grace: float) -> None:
        return None
