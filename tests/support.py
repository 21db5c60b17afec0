"""What the tests share: policies, env factories, test envs and buffers, and the leak check.

Import it as ``support`` (``from support import pendulum``): pytest puts ``tests/`` on ``sys.path`` before it
loads ``conftest.py`` (the rootdir-relative "prepend" import mode, ``tests/`` having no ``__init__.py``).
Worker processes import these factories and policies by module path too: multiprocessing's forkserver
starts with this process's ``sys.path``, and the subprocess trainers get it as ``PYTHONPATH``. Ray actors,
torch.distributed nodes and submitit jobs do not: a test module sending this module's objects there uses
the ``support_by_value`` fixture (they then travel by value, with ``cloudpickle``).

The leak check is one fixture, ``leaks`` (registered for every test by ``conftest.py``): a baseline of
child processes, open fds, ``/dev/shm/aiocollect_<pid>_*`` segments and threads, taken inside the test
(the event loop's own fds count in it), and checked again when the test ends. ``leaks.check()`` checks
in the middle of a test, and ``assert_clean()`` checks against the running test's baseline.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, ClassVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import cloudpickle
import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch

import aiocollect
from aiocollect import GymEnv

__all__ = [
    "BufferedConstantPolicy",
    "ConstantPolicy",
    "CrashesAt",
    "ENV_ID",
    "EnvFactory",
    "EnvFailure",
    "HookedEnv",
    "Leaks",
    "ListBuffer",
    "LoopProbe",
    "Timing",
    "alive",
    "assert_clean",
    "blocked_in",
    "broken_factory",
    "cartpole",
    "cartpole2",
    "cartpole3",
    "cartpole4",
    "children",
    "crashing",
    "fd_count",
    "gone",
    "leaks",
    "mp_helpers",
    "native_threads",
    "pendulum",
    "poll_until",
    "process_tree",
    "rollout_threads",
    "segments",
    "support_by_value",
    "take",
    "take_until",
    "threads_in_package_code",
    "timing",
    "wait_gone",
    "wait_until",
    "warm_forkserver",
]


# -- policies ----------------------------------------------------------------------------------------
class ConstantPolicy(torch.nn.Module):
    """Box action = a parameter value: shows which weights a worker (node, actor) runs."""

    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor([value]))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.value.expand(*observation.shape[:-1], 1).clone()


class BufferedConstantPolicy(torch.nn.Module):
    """:class:`ConstantPolicy` plus a buffer ``count`` (buffers travel too) and, with ``big``, the last
    element of a ``big``-element parameter (so that a test sees the whole flat buffer arrive)."""

    def __init__(self, value: float = 0.0, big: int = 0) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor([value]))
        self.big = torch.nn.Parameter(torch.zeros(big)) if big else None
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        value = self.value if self.big is None else self.value + self.big[-1:]
        return (value + self.count).expand(*observation.shape[:-1], 1).clone()


# -- env factories (top-level functions: worker processes unpickle them by name) ---------------------
def cartpole(num_envs: int | None = None) -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=num_envs)


def cartpole2() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=2)


def cartpole3() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=3)


def cartpole4() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=4)


def pendulum() -> GymEnv:
    return GymEnv("Pendulum-v1")


class FreedMemory(gym.Env):
    """Each step allocates and frees three 8 MiB blocks, as a policy's temporaries do, and observes the
    page faults that took: zero once the process keeps freed memory (a worker process does)."""

    observation_space = gym.spaces.Box(0, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._faults(), {}

    def step(self, action):
        return self._faults(), 0.0, False, False, {}

    @staticmethod
    def _faults() -> np.ndarray:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [bytearray(8 << 20) for _ in range(3)]
        del blocks
        return np.array([resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before], np.float32)


def freed_memory() -> GymEnv:
    return GymEnv(FreedMemory())


def broken_factory() -> GymEnv:
    raise KeyError("no such env")


@pytest.fixture(scope="module")
def support_by_value() -> Iterator[None]:
    """This module's functions and classes travel by value (``cloudpickle``) while the module's tests run:
    for Ray actors, torch.distributed nodes and submitit jobs, which cannot import ``support``."""
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(module)


# -- in-process test envs and buffers (the Collector tests) ------------------------------------------
class EnvFailure(Exception):
    """Raised by the test envs (a type of our own, so a test sees it is the original exception)."""


def explode_in_step() -> None:
    raise EnvFailure("step failed")


def explode_in_reset() -> None:
    raise EnvFailure("reset failed")


class HookedEnv(gym.Wrapper):
    """A gymnasium env whose ``step`` can sleep or raise, and whose ``reset`` can raise; counts calls.

    ``in_step`` is the number of ``step`` calls running now (0 once a rollout has really stopped).
    ``on_step(n)``, when set, is called (in the rollout thread) after the ``n``-th step.
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        step_delay: float = 0.0,
        fail_step_at: int | None = None,
        fail_reset_at: int | None = None,
    ) -> None:
        super().__init__(env)
        self.step_delay = step_delay
        self.fail_step_at = fail_step_at
        self.fail_reset_at = fail_reset_at
        self.steps = 0
        self.resets = 0
        self.in_step = 0
        self.on_step: Any = None

    def step(self, action: Any) -> Any:
        self.in_step += 1
        try:
            self.steps += 1
            if self.step_delay:
                time.sleep(self.step_delay)  # a slow env, running in the rollout thread
            if self.fail_step_at is not None and self.steps >= self.fail_step_at:
                explode_in_step()
            out = self.env.step(action)
            if self.on_step is not None:
                self.on_step(self.steps)
            return out
        finally:
            self.in_step -= 1

    def reset(self, **kwargs: Any) -> Any:
        self.resets += 1
        if self.fail_reset_at is not None and self.resets >= self.fail_reset_at:
            explode_in_reset()
        return self.env.reset(**kwargs)


class CrashesAt(gym.Wrapper):
    """Raises at its ``at``-th step (every env built does: a restart meets it again ``at`` steps on)."""

    def __init__(self, env: gym.Env, at: int) -> None:
        super().__init__(env)
        self.at, self.steps = at, 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.steps == self.at:
            raise ZeroDivisionError(f"the simulator went unstable at step {self.steps}")
        return self.env.step(action)


def crashing() -> GymEnv:
    """A Pendulum that raises at its 25th step (:class:`CrashesAt`), each time it is built."""
    return GymEnv(CrashesAt(gym.make("Pendulum-v1"), at=25))


class EnvFactory:
    """``create_env_fn`` that records its calls; ``hooks`` (a :class:`HookedEnv` per env) when hooked."""

    def __init__(self, env_id: str = "CartPole-v1", *, num_envs: int | None = None, **hooks: Any):
        self.env_id = env_id
        self.num_envs = num_envs
        self.hook_kwargs = hooks
        self.calls = 0
        self.envs: list[GymEnv] = []
        self.hooks: list[HookedEnv] = []

    def __call__(self) -> GymEnv:
        self.calls += 1
        if self.hook_kwargs:
            hooked = HookedEnv(gym.make(self.env_id), **self.hook_kwargs)
            self.hooks.append(hooked)
            env = GymEnv(hooked)
        else:
            env = GymEnv(self.env_id, num_envs=self.num_envs)
        self.envs.append(env)
        return env


class ListBuffer:
    """A minimal replay buffer: ``extend`` appends; ``await wait_for(n)`` waits for ``n`` batches.

    ``extend`` may run in a worker thread (the collector's rollout thread): it then wakes the waiter
    through ``anyio.from_thread``. Create it inside the async test (its thread is the loop's).
    While ``paused`` is True, every ``extend`` is counted in ``violations``.
    """

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.paused = False
        self.violations = 0
        self._loop_thread = threading.get_ident()
        self._token = anyio.lowlevel.current_token()
        self._grew: anyio.Event | None = None

    def extend(self, batch: Any) -> None:
        if self.paused:
            self.violations += 1
        self.batches.append(batch)
        if threading.get_ident() == self._loop_thread:
            self._notify()
        else:
            anyio.from_thread.run_sync(self._notify, token=self._token)

    def _notify(self) -> None:
        if self._grew is not None:
            self._grew.set()

    async def wait_for(self, n: int) -> None:
        while len(self.batches) < n:
            self._grew = anyio.Event()
            await self._grew.wait()


# -- processes -----------------------------------------------------------------------------------------
def mp_helpers() -> set[int]:
    """The pids of multiprocessing's forkserver and resource tracker (shared by every test; not leaks)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    return {pid for pid in pids if pid is not None}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pid: int) -> bool:
    return not alive(pid)


def children() -> list[psutil.Process]:
    """Our live descendant processes, except multiprocessing's forkserver and resource tracker."""
    helpers = mp_helpers()
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in helpers and alive(p.pid)]


def process_tree(pids: Iterable[int]) -> set[int]:
    """The given pids and their descendants (a node's or an actor's own worker processes)."""
    out: set[int] = set()
    for pid in pids:
        try:
            out |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    return out


def _describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"{pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:120]}"
    except psutil.Error:
        return str(pid)


def wait_gone(pids: Iterable[int], seconds: float = 5.0) -> list[str]:
    """Wait (at most ``seconds``) for ``pids`` to exit; those still running, described (``[]``: all gone).

    Nothing is reaped here: a zombie counts as gone, and its parent's ``join`` still sees its exit code.
    """
    pids = list(pids)
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [_describe(p) for p in pids if alive(p)]


# -- threads, fds, segments --------------------------------------------------------------------------
def rollout_threads() -> list[threading.Thread]:
    """Threads other than the main one and the idle worker threads of anyio (asyncio) and trio."""
    return [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread()
        and "AnyIO worker thread" not in t.name
        and not t.name.startswith("Trio thread")
    ]


_PACKAGE_DIR = os.path.dirname(aiocollect.__file__)


def threads_in_package_code() -> list[str]:
    """Names of the threads (other than this one) now running aiocollect code: a rollout still going.

    Idle worker threads (anyio's or trio's) wait in their own modules, and an idle rollout thread waits
    for a job, so they do not count.
    """
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    busy = []
    for ident, frame in sys._current_frames().items():
        f: Any = frame
        while ident != me and f is not None:
            if f.f_code.co_filename.startswith(_PACKAGE_DIR):
                # the innermost package frame in _rollout/_thread.py: a collector's rollout thread between
                # jobs, or ringing a doorbell (through the event loop's wake-up) after one: idle
                if not f.f_code.co_filename.endswith("_rollout/_thread.py"):
                    busy.append(names.get(ident, str(ident)))
                break
            f = f.f_back
    return busy


def native_threads() -> int:
    """Threads of this process that Python does not know of: gloo's, the store's (Linux)."""
    return len(os.listdir("/proc/self/task")) - len(threading.enumerate())


def segments(pid: int | None = None) -> list[str]:
    """The shared-memory segments of process ``pid`` (default: this one) in ``/dev/shm``."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"aiocollect_{pid or os.getpid()}_")]


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- the leak check ------------------------------------------------------------------------------------
#: seconds the end-of-test check waits for processes to be reaped and threads to end
SETTLE = 5.0


class Leaks:
    """A baseline of threads and open fds; ``check()`` asserts that no child process (but multiprocessing's
    helpers) and no shared-memory segment of ours is left, no thread running aiocollect code, and no thread
    or fd added since the baseline. Without a baseline (``baseline=False``) only the first two are checked."""

    #: the baseline of the test running now (set by the ``leaks`` fixture), for :func:`assert_clean`
    active: ClassVar[Leaks | None] = None

    def __init__(self, *, baseline: bool = True) -> None:
        self.fds = fd_count() if baseline else None
        self.threads = {t.ident for t in rollout_threads()} if baseline else None

    def problems(self) -> list[str]:
        out = []
        if left := children():
            out.append(f"child processes left: {left}")
        if left_segments := segments():
            out.append(f"shared-memory segments left: {left_segments}")
        known, me = self.threads, threading.get_ident()  # me: the worker thread of settle()
        if known is not None:
            threads = [t.name for t in rollout_threads() if t.ident not in known | {me}]
            if threads or threads_in_package_code():
                out.append(f"threads left: {threads} {threads_in_package_code()}")
        if self.fds is not None and fd_count() > self.fds:
            out.append(f"fds: {self.fds} before, {fd_count()} after: {os.listdir('/proc/self/fd')}")
        return out

    def check(self, wait: float = 0.0, *, native_before: int | None = None) -> None:
        """Assert no leak, waiting at most ``wait`` seconds for one to go; with ``native_before``, also that
        the native threads are no more than that many (waiting up to :data:`SETTLE` for them to end)."""
        deadline = time.monotonic() + wait
        while (problems := self.problems()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not problems, problems
        if native_before is not None:
            # not more than before: a native thread left over from an earlier test may end meanwhile, and an
            # ending Python thread leaves threading.enumerate() a moment before its OS thread ends
            deadline = time.monotonic() + SETTLE
            while native_threads() > native_before and time.monotonic() < deadline:
                time.sleep(0.02)
            assert native_threads() <= native_before

    async def settle(self, seconds: float = SETTLE) -> None:
        """:meth:`check`, waiting at most ``seconds`` for the leaks to go, in a worker thread (the event loop
        runs meanwhile: what it still has to close or reap, it does)."""
        with anyio.fail_after(seconds + SETTLE):
            await anyio.to_thread.run_sync(functools.partial(self.check, seconds))


def assert_clean(native_before: int | None = None) -> None:
    """:meth:`Leaks.check` against the running test's baseline (the ``leaks`` fixture's), or without one."""
    (Leaks.active or Leaks(baseline=False)).check(native_before=native_before)


@pytest.fixture(scope="module")
def warm_forkserver() -> None:
    """Start multiprocessing's forkserver (with the collectors' preload) and resource tracker, so that
    their fds and processes exist before a test takes its leak baseline."""
    from multiprocessing import forkserver, resource_tracker

    from aiocollect._workers._forkserver import context

    context("forkserver")
    forkserver.ensure_running()
    resource_tracker.ensure_running()


@pytest.fixture
async def leaks(warm_forkserver: None) -> AsyncIterator[Leaks]:
    """The leak baseline, taken inside the test's event loop; checked (after a bounded wait for processes
    to be reaped and threads to end) when the test ends."""
    baseline = Leaks()
    Leaks.active = baseline
    try:
        yield baseline
        await baseline.settle()
    finally:
        Leaks.active = None


async def take(collector: Any, n: int | None = None, seconds: float = 30) -> list[Any]:
    """The batches of ``collector``'s ``async for`` (the first ``n`` when given), within ``seconds``."""
    out: list[Any] = []
    with anyio.fail_after(seconds):
        async for batch in collector:
            out.append(batch)
            if n is not None and len(out) == n:
                break
    return out


#: the key that names the member (worker, actor) a frame came from, and the env
WORKER_ID = ("collector", "worker_id")
ENV_ID = ("collector", "env_id")


async def take_until(
    collector: Any,
    *,
    each: int,
    members: int | None = None,
    key: tuple[str, str] = WORKER_ID,
    frames: bool = False,
    seconds: float = 60,
) -> list[Any]:
    """The batches of ``collector``'s ``async for`` until every member has delivered ``each`` of them.

    A batch counts for each member whose frames it holds (``("collector", "worker_id")``); a batch with no
    such key (a sync collector's stack holds every member's rollout) counts for every member. ``members``
    defaults to the collector's ``num_workers``. With ``key=("collector", "env_id")`` and ``frames=True``
    (``members``: the number of envs), it counts each env's frames instead. Stop on this, not on a shared
    frame budget, wherever a test needs each member's data: one fast member can take a whole budget alone.
    Raises an ``AssertionError`` with the counts if the iteration ends first; ``seconds`` only stops a hang.
    """
    if each < 1:
        raise ValueError(f"each must be 1 or more, got {each}")
    n = members if members is not None else collector.num_workers
    counts = dict.fromkeys(range(n), 0)
    out: list[Any] = []
    with anyio.fail_after(seconds):
        async for batch in collector:
            out.append(batch)
            ids = batch.get(key, None)
            if ids is None:
                for member in counts:
                    counts[member] += batch.numel() if frames else 1
            else:
                found, times = ids.flatten().unique(return_counts=True)
                for member, k in zip(found.tolist(), times.tolist(), strict=True):
                    counts[member] = counts.get(member, 0) + (k if frames else 1)
            if all(counts[m] >= each for m in range(n)):
                return out
    what = "frames" if frames else "batches"
    raise AssertionError(f"the iteration ended before every member delivered {each} {what}: {counts}")


async def wait_until(predicate: Any, seconds: float = 30, *, poll: float = 0.01) -> None:
    """Poll ``predicate()`` until it is true (for what no event tells: another process's exit or file).

    ``seconds`` only stops a hang (``TimeoutError``); the verdict is the condition itself.
    """
    with anyio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on but the condition
            await anyio.sleep(poll)


class LoopProbe:
    """A question from another thread to a task of the event loop, to show the loop runs meanwhile.

    ``ask()`` (in a rollout, fused or worker thread: an env's step, a policy's call) waits for the loop's
    answer and records whether it came within ``seconds``; ``async with probe.answering():`` runs the task
    that answers. A thread that holds the loop (or runs on it) never gets its answer: a verdict by cause,
    where a ticker's rate would be a speed figure. A copy of the probe (a collector deep-copies its
    policy) is the probe itself.
    """

    def __init__(self, seconds: float = 20.0) -> None:
        self.seconds = seconds
        self.answers: list[bool] = []
        self.threads: set[int] = set()
        self._asked = threading.Event()
        self._answered = threading.Event()
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> LoopProbe:
        return self

    def ask(self) -> bool:
        """Wait for the loop's answer (recorded in ``answers``, with this thread in ``threads``)."""
        with self._lock:  # one question at a time
            self.threads.add(threading.get_ident())
            self._answered.clear()
            self._asked.set()
            answered = self._answered.wait(self.seconds)
            self.answers.append(answered)
            return answered

    @contextlib.asynccontextmanager
    async def answering(self) -> AsyncIterator[None]:
        """A task of this loop answers every question while the block runs."""

        async def answer() -> None:
            while True:
                await anyio.to_thread.run_sync(self._asked.wait, abandon_on_cancel=True)
                self._asked.clear()
                self._answered.set()

        self._asked.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(answer)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
                self._asked.set()  # ends the abandoned wait of the worker thread (asyncio's do not die)


def poll_until(predicate: Any, seconds: float = 30, *, poll: float = 0.005) -> None:
    """:func:`wait_until` for a test that is not async (or that must hold the loop meanwhile)."""
    deadline = time.monotonic() + seconds  # only stops a hang
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{predicate} still false after {seconds} s")
        time.sleep(poll)


def blocked_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` runs ``function`` now, innermost (a thread blocked in a call: a synchronisation
    point for which no event exists, read from its stack)."""
    frame = sys._current_frames().get(thread.ident or -1)
    return frame is not None and frame.f_code.co_name == function


# -- speed figures ---------------------------------------------------------------------------------------
class Timing:
    """A speed figure of a test (how long a fault took to surface, a restart, a close), bounded only in the
    test's ``timed`` instance.

    A test that takes the ``timing`` fixture runs twice: its default instance (``[cause]``) asserts what
    happened; its ``[timed]`` instance, marked ``timing``, also asserts the bound.
    The default suite and CI's gate leave ``timing`` tests out: ``nox -s timing`` runs them alone, on a
    quiet machine, and prints the figures. A verdict never depends on the machine's speed or load.
    """

    #: the figures of the ``timed`` instances run in this session, by test id (printed at its end)
    figures: ClassVar[dict[str, float]] = {}

    def __init__(self, name: str, checked: bool) -> None:
        self.name = name
        self.checked = checked

    def bound(self, seconds: float, limit: float, what: str = "") -> None:
        """Record ``seconds`` (as ``what``); assert it is under ``limit`` in the ``timed`` instance."""
        if self.checked:
            Timing.figures[f"{self.name} {what}".strip()] = round(seconds, 4)
            assert seconds < limit, f"{what or 'it'} took {seconds:.3f} s, over the {limit} s bound"

    def share(
        self, value: float | None, *, above: float | None = None, below: float | None = None, what: str
    ) -> None:
        """A share of time (``time_split``, ``trainer_wait``) or a rate: in the ``timed`` instance, assert it
        lies above ``above`` and below ``below``."""
        if self.checked:
            assert value is not None, f"{what}: not measured"
            Timing.figures[f"{self.name} {what}"] = round(value, 4)
            assert above is None or value > above, f"{what} is {value:.3f}, not above {above}"
            assert below is None or value < below, f"{what} is {value:.3f}, not below {below}"


@pytest.fixture(
    params=[pytest.param(False, id="cause"), pytest.param(True, id="timed", marks=pytest.mark.timing)]
)
def timing(request: pytest.FixtureRequest) -> Timing:
    """:class:`Timing` for this test: the ``timed`` instance (marked ``timing``) asserts the bounds."""
    return Timing(request.node.nodeid, request.param)


def check_remote_split(collector: Any, members: int) -> None:
    """A remote collector's (nodes', actors') time split, measured by each member's collector and carried
    with its batches: the collector's and each member's fractions sum to 1, µs per frame are positive,
    ``collector_wait`` is the ``"wait"`` part, and ``metrics_text`` gives each member's by worker label."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from aiocollect import metrics_text

    stats = collector.statistics()
    assert len(stats.workers) == members
    parts = {"env", "policy", "transfer", "wait", "other"}
    for owner in (stats, *stats.workers):
        split, per_frame = owner.time_split, owner.time_split_us
        assert split is not None and per_frame is not None, owner
        assert set(split) == parts == set(per_frame)
        assert all(v >= 0 for v in split.values()) and sum(split.values()) == pytest.approx(1.0, abs=1e-6)
        assert all(v >= 0 for v in per_frame.values()) and per_frame["env"] > 0
        assert owner.collector_wait == split["wait"]
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text(collector, name="remote")):
        for sample in family.samples:
            if sample.name == "aiocollect_worker_time_split":
                found[sample.labels["worker"], sample.labels["part"]] = sample.value
    assert set(found) == {(str(i), part) for i in range(members) for part in parts}
    for i in range(members):
        assert sum(found[str(i), part] for part in parts) == pytest.approx(1.0, abs=1e-6)
