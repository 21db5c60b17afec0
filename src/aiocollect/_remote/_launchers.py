"""How the nodes of :class:`DistributedCollector` and :class:`RPCCollector` start, reach the trainer and
are reaped.

Every node, however it was started, runs :func:`node_entry`: it opens one TCP connection to the trainer's
**control listener**, authenticates with a random token (raw bytes, checked before anything is
unpickled), and then serves the trainer on that connection. The connection is also the node's lifeline:
when either end dies the other sees EOF at once, so nobody polls for liveness.

Launchers (trainer side):

* ``"mp"``: node processes on this machine, forked from a forkserver that has torch, tensordict and
  gymnasium imported already (as our multi-process workers are); exits are awaited on the process
  sentinel.
* ``"submitit"``: one submitit job per node (Slurm in production, ``cluster="local"`` on a laptop); the
  trainer's address travels in the job's arguments.
* ``"submitit_delayed"``: nothing is launched from the trainer. :func:`submitit_delayed_launcher`, run on
  the login node, submitted the trainer's job **and** the node jobs together; the trainer writes its
  address into a rendezvous file in the shared submitit folder, and the node jobs wait for that file.
  No node name is parsed (torchrl waits for ``squeue`` to print a numeric node name, forever on clusters
  whose node names are not numbers).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import hmac
import importlib
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import struct
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from .._core._mistakes import check_main_guard
from .._transport._wire import connect_retrying
from ._processes import ExternalNode, JobNode, MPNode, NodeProcess

_MAGIC = b"AIOCOLL1"
_HELLO = struct.Struct("!8s16sii")  # magic, token, rank (-1: any), pid
#: environment variable naming the rendezvous file of a delayed launch
RENDEZVOUS_ENV = "AIOCOLLECT_RENDEZVOUS"
#: environment variable overriding the address nodes use to reach the trainer
HOST_ENV = "AIOCOLLECT_TRAINER_HOST"
#: modules the node forkserver imports once
# aiocollect first: its lean tensordict import keeps torch._dynamo out of the forkserver (which any later
# collector of this process shares); the heap is frozen last (see aiocollect._workers._freeze)
_PRELOAD = ["aiocollect._remote._gloo", "gymnasium", "aiocollect._workers._freeze"]


@dataclass(frozen=True)
class TrainerAddress:
    """What a node needs to reach the trainer (picklable; travels in job arguments or a file)."""

    host: str
    port: int
    token: str  # hex

    def to_json(self) -> str:
        return json.dumps({"host": self.host, "port": self.port, "token": self.token})

    @classmethod
    def from_json(cls, text: str) -> TrainerAddress:
        data = json.loads(text)
        return cls(str(data["host"]), int(data["port"]), str(data["token"]))


def hello(token: str, rank: int) -> bytes:
    return _HELLO.pack(_MAGIC, bytes.fromhex(token), rank, os.getpid())


def check_hello(data: bytes, token: str) -> tuple[int, int] | None:
    """``(rank, pid)`` if ``data`` is a valid hello for ``token``, else ``None``."""
    if len(data) != _HELLO.size:
        return None
    magic, got, rank, pid = _HELLO.unpack(data)
    if magic != _MAGIC or not hmac.compare_digest(got, bytes.fromhex(token)):
        return None
    return rank, pid


HELLO_SIZE = _HELLO.size


def new_token() -> str:
    return secrets.token_hex(16)


def routable_host() -> str:
    """An address of this machine that other machines can reach (``AIOCOLLECT_TRAINER_HOST`` wins)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    with contextlib.suppress(OSError):
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            return address
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
        return str(probe.getsockname()[0])
    return socket.gethostname()


# -- node side -------------------------------------------------------------------------------------
def connect(address: TrainerAddress, rank: int, timeout: float = 60.0) -> socket.socket:
    """Connect to the trainer (retrying while it is not listening yet) and say hello."""
    sock = connect_retrying(address.host, address.port, timeout, retry_every=0.2)
    sock.settimeout(None)
    sock.sendall(hello(address.token, rank))
    return sock


def node_entry(address: TrainerAddress, rank: int, ignore_sigint: bool = False) -> None:
    """Entry point of a node (a process, a submitit job): connect, then serve the trainer until told to
    stop or until the trainer goes away."""
    if ignore_sigint:  # a local node: Ctrl-C goes to the trainer, which stops us
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(OSError):
            # lead a process group: the trainer kills it once we ended, with what we left (a forkserver)
            os.setpgid(0, 0)
    sock = connect(address, rank)
    try:
        anyio.run(_serve, sock, rank)
    finally:
        stop_forkserver()


def stop_forkserver() -> None:
    """End the forkserver that started this node's workers now: left alone, it notices that the node
    exited only seconds later (and outlives the collector's ``async with``), and even a graceful stop
    waits 3-5 s for its interpreter (torch preloaded) to shut down. Its workers are gone by now (the
    collector reaped them), and it holds no state: it is killed, then reaped."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is not None and pid is not None:
        with contextlib.suppress(Exception):
            os.kill(pid, signal.SIGKILL)
            server._stop()  # closes its "alive" pipe and reaps it


def _leaf(exc: BaseException) -> BaseException:
    """The one real error inside (nested) exception groups, else the group."""
    cancelled = anyio.get_cancelled_exc_class()
    while isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if not isinstance(e, cancelled)]
        if len(leaves) != 1:
            return exc
        exc = leaves[0]
    return exc


async def _serve(sock: socket.socket, rank: int) -> None:
    from .._core._errors import RemoteFailure
    from .._transport._messages import Failed
    from .._transport._wire import AsyncChannel

    chan = AsyncChannel(sock)
    where = f"node {rank - 1} ({socket.gethostname()}, pid {os.getpid()})"
    try:
        setup = await chan.receive()
        module = importlib.import_module(f"aiocollect._remote.{setup.engine}")
        await module.run_node(chan, setup, where)
    except (EOFError, ConnectionError):
        pass  # the trainer is gone: just exit
    except BaseException as exc:
        error = _leaf(exc)
        if isinstance(error, (EOFError, ConnectionError)):
            return
        with contextlib.suppress(Exception):
            await chan.send(Failed(RemoteFailure(error, where)))  # type: ignore[arg-type]
    finally:
        chan.close()


def delayed_node_entry(rendezvous: str, rank: int, timeout: float) -> None:
    """Entry point of a node job of :func:`submitit_delayed_launcher`: wait for the trainer's address in
    the rendezvous file, then run :func:`node_entry`."""
    path = Path(rendezvous)
    deadline = time.monotonic() + timeout
    # a shared file system gives no notification across machines: the file is checked twice a second,
    # in this job only (the trainer's event loop never waits on it)
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no trainer address in {path} after {timeout} s (did the main job start?)")
        time.sleep(0.5)
    node_entry(TrainerAddress.from_json(path.read_text()), rank)


# -- launchers -------------------------------------------------------------------------------------
class Launcher(abc.ABC):
    #: where the control listener binds and what address nodes are given
    local: bool = True
    #: ``launch`` may be called again for a new group (``restart=``: the whole group is relaunched)
    relaunchable: bool = False

    @abc.abstractmethod
    async def launch(self, address: TrainerAddress, ranks: list[int]) -> dict[int, NodeProcess]:
        """Start one node per rank (or arrange for them to connect)."""


def _mp_context() -> Any:
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    check_main_guard("launcher='mp'", ctx.get_start_method(), other_fix="launch the nodes with submitit")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class MPLauncher(Launcher):
    """Node processes on this machine (not daemonic: a node's own collector may start processes)."""

    local = True
    relaunchable = True

    async def launch(self, address: TrainerAddress, ranks: list[int]) -> dict[int, NodeProcess]:
        ctx = _mp_context()
        nodes: dict[int, NodeProcess] = {}
        for rank in ranks:
            process = ctx.Process(
                target=node_entry, args=(address, rank, True), name=f"aiocollect-node-{rank}", daemon=False
            )
            await anyio.to_thread.run_sync(process.start)
            nodes[rank] = MPNode(process)
        return nodes


def _import_submitit() -> Any:
    try:
        import submitit
    except ImportError as exc:
        raise ImportError(
            "launcher='submitit' needs submitit: pip install 'aiocollect[distributed]' "
            "(or pip install 'submitit>=1.5')"
        ) from exc
    return submitit


def _executor(submitit: Any, options: Mapping[str, Any]) -> Any:
    options = dict(options)
    folder = options.pop("folder", "aiocollect_submitit/%j")
    cluster = options.pop("cluster", None)
    if cluster == "debug":
        raise ValueError(
            "submitit's debug executor runs jobs inside the trainer's process; use cluster='local'"
        )
    private_folder(folder)
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    if options:
        executor.update_parameters(**options)
    return executor


def _root(folder: str | os.PathLike[str]) -> Path:
    """The part of a submitit folder before its first ``%`` pattern (``runs/%j`` -> ``runs``)."""
    text = str(folder)
    if "%" not in text:
        return Path(text)
    head = text.split("%", 1)[0]
    return Path(head) if head.endswith("/") else Path(head or ".").parent if head else Path(".")


def private_folder(folder: str | os.PathLike[str]) -> Path:
    """Create submitit's folder (its part before ``%j``) as 0700: the pickles submitit writes there
    carry the control token (and the policy). An existing folder of ours is made 0700 too."""
    root = _root(folder)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if root.resolve() != Path.cwd().resolve() and root.stat().st_uid == os.getuid():
        os.chmod(root, 0o700)
    return root


def private_files(folder: str | os.PathLike[str]) -> None:
    """The pickles submitit wrote under ``folder`` made 0600, its job folders 0700 (inside a 0700
    folder already: this closes the window for good, should that one be opened)."""
    root = _root(folder)
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            if path.stat().st_uid != os.getuid():
                continue
            if path.is_dir():
                os.chmod(path, 0o700)
            elif path.suffix == ".pkl":
                os.chmod(path, 0o600)


class SubmititLauncher(Launcher):
    """One submitit job per node; ``slurm_kwargs`` go to ``executor.update_parameters`` except ``folder``
    (logs and pickles; shared by the cluster's machines) and ``cluster`` (``None``: Slurm when available,
    else local; ``"local"``: subprocesses of this machine)."""

    relaunchable = True  # a new job per node

    def __init__(self, slurm_kwargs: Mapping[str, Any] | None) -> None:
        self.options = dict(slurm_kwargs or {})
        self.local = self.options.get("cluster") == "local"
        self._submitit = _import_submitit()

    async def launch(self, address: TrainerAddress, ranks: list[int]) -> dict[int, NodeProcess]:
        def submit() -> list[Any]:
            executor = _executor(self._submitit, self.options)
            with executor.batch():  # one job array on Slurm
                jobs = [executor.submit(node_entry, address, rank) for rank in ranks]
            private_files(self.options.get("folder", "aiocollect_submitit/%j"))
            return jobs

        jobs = await anyio.to_thread.run_sync(submit)
        return {rank: JobNode(job) for rank, job in zip(ranks, jobs, strict=True)}


class DelayedLauncher(Launcher):
    """The trainer side of :func:`submitit_delayed_launcher`: publish the address, launch nothing."""

    def __init__(self, slurm_kwargs: Mapping[str, Any] | None) -> None:
        options = dict(slurm_kwargs or {})
        path = options.get("rendezvous") or os.environ.get(RENDEZVOUS_ENV)
        if not path:
            raise RuntimeError(
                "launcher='submitit_delayed' runs inside a job started by submitit_delayed_launcher(...) "
                f"(which sets {RENDEZVOUS_ENV}); or pass slurm_kwargs={{'rendezvous': path}}"
            )
        self.path = Path(path)
        self.local = bool(options.get("local", False))

    async def launch(self, address: TrainerAddress, ranks: list[int]) -> dict[int, NodeProcess]:
        def publish() -> None:
            tmp = self.path.with_name(self.path.name + f".{uuid.uuid4().hex}.tmp")
            tmp.write_text(address.to_json())
            os.chmod(tmp, 0o600)  # the token is in there
            tmp.replace(self.path)  # atomic: a node never reads half a file

        await anyio.to_thread.run_sync(publish)
        return {rank: ExternalNode() for rank in ranks}


def make_launcher(launcher: Any, slurm_kwargs: Mapping[str, Any] | None) -> Launcher:
    if isinstance(launcher, Launcher):
        return launcher
    if launcher == "mp":
        if slurm_kwargs:
            raise ValueError("slurm_kwargs is for launcher='submitit' or 'submitit_delayed'")
        return MPLauncher()
    if launcher == "submitit":
        return SubmititLauncher(slurm_kwargs)
    if launcher == "submitit_delayed":
        return DelayedLauncher(slurm_kwargs)
    raise ValueError(f"launcher must be 'mp', 'submitit' or 'submitit_delayed', got {launcher!r}")


# -- the delayed launcher (login node) -------------------------------------------------------------
def _run_main(
    main: Callable[..., Any], rendezvous: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    os.environ[RENDEZVOUS_ENV] = rendezvous
    return main(*args, **kwargs)


def submitit_delayed_launcher(
    num_jobs: int,
    *,
    folder: str = "aiocollect_submitit/%j",
    cluster: str | None = None,
    main_parameters: Mapping[str, Any] | None = None,
    node_parameters: Mapping[str, Any] | None = None,
    node_timeout: float = 3600.0,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator for clusters whose jobs cannot submit jobs: run the decorated ``main`` (which builds a
    ``DistributedCollector(..., launcher="submitit_delayed", num_collectors=num_jobs)`` or an
    ``RPCCollector`` likewise) as one job, and ``num_jobs`` node jobs beside it, all submitted from here.

    How it works: a rendezvous file name is chosen in the submitit folder (which the cluster's machines
    share); ``main`` runs with ``AIOCOLLECT_RENDEZVOUS`` naming it; its collector opens its control
    listener and writes ``host:port`` and a random token there (atomically); each node job waits for the
    file, connects with its rank, and serves the collector. Nothing waits for ``squeue`` or parses a node
    name. Calling the decorated function blocks until every job finished and returns ``main``'s result;
    if ``main`` fails the node jobs are cancelled.

    Args:
        num_jobs: node jobs (the collector's ``num_collectors``).
        folder: submitit's folder (logs, pickles, the rendezvous file).
        cluster: ``None`` (Slurm if available), ``"slurm"`` or ``"local"``.
        main_parameters, node_parameters: ``executor.update_parameters`` for the main job and for the node
            jobs (e.g. ``{"timeout_min": 60, "slurm_partition": "cpu", "cpus_per_task": 8}``).
        node_timeout: seconds a node job waits for the main job's address.

    Example:
        >>> from aiocollect import submitit_delayed_launcher
        >>> @submitit_delayed_launcher(num_jobs=2, cluster="local")
        ... def main():
        ...     ...  # anyio.run(train) with DistributedCollector(..., launcher="submitit_delayed")
        >>> # main()  # submits 3 jobs, returns main's result
    """
    if isinstance(num_jobs, bool) or not isinstance(num_jobs, int) or num_jobs < 1:
        raise ValueError(f"num_jobs must be a positive int, got {num_jobs!r}")
    submitit = _import_submitit()

    def decorator(main: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def launch(*args: Any, **kwargs: Any) -> Any:
            main_exec = _executor(submitit, {"folder": folder, "cluster": cluster, **(main_parameters or {})})
            node_exec = _executor(submitit, {"folder": folder, "cluster": cluster, **(node_parameters or {})})
            root = Path(str(main_exec.folder).replace("%j", "rendezvous"))
            private_folder(root)
            rendezvous = str((root / f"aiocollect-{uuid.uuid4().hex}.json").absolute())
            main_job = main_exec.submit(_run_main, main, rendezvous, args, kwargs)
            with node_exec.batch():
                node_jobs = [
                    node_exec.submit(delayed_node_entry, rendezvous, rank, node_timeout)
                    for rank in range(1, num_jobs + 1)
                ]
            private_files(folder)
            try:
                result = main_job.result()
            except BaseException:
                for job in node_jobs:
                    with contextlib.suppress(Exception):
                        job.cancel(check=False)
                raise
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(rendezvous)
            for job in node_jobs:
                job.result()
            return result

        return launch

    return decorator


__all__ = [
    "HELLO_SIZE",
    "HOST_ENV",
    "RENDEZVOUS_ENV",
    "DelayedLauncher",
    "Launcher",
    "MPLauncher",
    "NodeProcess",
    "SubmititLauncher",
    "TrainerAddress",
    "check_hello",
    "connect",
    "delayed_node_entry",
    "stop_forkserver",
    "hello",
    "make_launcher",
    "new_token",
    "node_entry",
    "private_files",
    "private_folder",
    "routable_host",
    "submitit_delayed_launcher",
]
