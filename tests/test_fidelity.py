"""Fidelity to TorchRL's collector contract (issue 18): env classes as ``create_env_fn``, envs that start
processes inside the workers (reaped on every exit path), the real cause of a worker-side env failure first,
``replay_buffer`` receiving frames, and serial workers as reproducible as process workers."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import ProbabilisticTensorDictModule, TensorDictModule, TensorDictSequential
from torch.distributions import Categorical

from aiocollect import (
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiSyncCollector,
    ProcessCollector,
    WorkerDiedError,
    compat,
)
from support import alive, cartpole, wait_gone
from test_faults import matrix

pytestmark = pytest.mark.anyio


# -- envs (module level: the worker processes unpickle them) -----------------------------------------
class CartPoleClass(GymEnv):
    """An env *class*: ``create_env_fn=CartPoleClass`` must be called in the worker, not used as the env."""

    def __init__(self) -> None:
        super().__init__("CartPole-v1")


def _helper(conn: Any, pid_file: str) -> None:
    """A child process of the env: it lives until told to stop (or killed)."""
    Path(pid_file).write_text(str(os.getpid()))
    conn.send("ready")
    try:
        conn.recv()
    except EOFError:
        pass


class ChildProcessEnv(gym.Env):
    """Starts a (non-daemonic) helper process in its constructor, as a torchrl ``ParallelEnv`` does;
    ``hang_at``: step number at which ``step`` blocks (a hung env)."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, pid_file: str, hang_at: int | None = None) -> None:
        self.conn, child = mp.Pipe()
        self.helper = mp.get_context("fork").Process(target=_helper, args=(child, pid_file), daemon=False)
        self.helper.start()
        child.close()
        assert self.conn.recv() == "ready"  # its pid file is written
        self.hang_at = hang_at
        self.closed = False
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.hang_at is not None and self.t >= self.hang_at:
            time.sleep(3600)
        return np.full(2, self.t % 4 / 4, np.float32), 1.0, self.t % 4 == 0, False, {}

    def close(self):
        if self.closed:
            # what a half-built torchrl env says when closed after its failure
            raise RuntimeError("trying to close a closed environment")
        self.closed = True
        self.conn.send("stop")
        self.helper.join(5)


class EnvBroken(Exception):
    """The real cause of a failure (a type of our own, so the test knows it arrived as itself)."""


class ClosesTwice:
    """An env that fails while the worker reads its batch size, having closed itself (as a torchrl
    ``ParallelEnv`` whose workers failed to start does): the worker's own close then raises a second
    error."""

    def __init__(self, env: GymEnv) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    @property
    def batch_size(self) -> Any:
        self._env.close()
        raise EnvBroken("the env's start-up failed")


def child_env(pid_file: str, **kwargs: Any) -> GymEnv:
    return GymEnv(ChildProcessEnv(pid_file, **kwargs))


def broken_child_env(pid_file: str) -> ClosesTwice:
    return ClosesTwice(GymEnv(ChildProcessEnv(pid_file)))


def async_vector_env() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=2, vectorization_mode="async")


def pids_in(tmp_path: Path) -> list[int]:
    return [int(f.read_text()) for f in sorted(tmp_path.glob("helper*.pid")) if f.read_text()]


def multi(kind: str, fns: list[Any], policy: Any = None, **kwargs: Any) -> Any:
    if kind == "process":
        return ProcessCollector(fns[0], policy, **kwargs)
    cls = MultiSyncCollector if kind.startswith("sync") else MultiAsyncCollector
    return cls(fns, policy, worker_backend="serial" if kind.endswith("serial") else "process", **kwargs)


KINDS = ["process", "sync", "async", "sync-serial", "async-serial"]


# -- item 2: an env class ------------------------------------------------------------------------------
@matrix(["collector", *KINDS])  # every backend: CI's runs of the suite take one each
async def test_an_env_class_is_called_in_every_collector(kind: str) -> None:
    if kind == "collector":
        collector: Any = Collector(CartPoleClass, frames_per_batch=8, total_frames=16)
    else:
        collector = multi(kind, [CartPoleClass, CartPoleClass], frames_per_batch=8, total_frames=16)
    with anyio.fail_after(60):
        async with collector:
            batches = [b async for b in collector]
    assert sum(b.numel() for b in batches) == 16
    assert batches[0]["observation"].shape[-1] == 4


async def test_an_env_class_with_create_env_kwargs_in_compat() -> None:
    with anyio.fail_after(60):
        async with compat.MultiSyncCollector(
            GymEnv,
            num_workers=2,
            create_env_kwargs={"env": "Pendulum-v1"},
            frames_per_batch=8,
            total_frames=8,
        ) as collector:
            batch = await collector.next()
    assert batch is not None and batch["observation"].shape[-1] == 3


# -- item 3: envs that start processes ----------------------------------------------------------------
@matrix(["process", "sync", "async"])
async def test_an_env_that_starts_a_process_runs_in_a_worker(kind, leaks, tmp_path) -> None:
    fns = [
        lambda i=i: child_env(str(tmp_path / f"helper{i}.pid"))  # type: ignore[misc]
        for i in range(2)
    ]
    with anyio.fail_after(60):
        async with multi(kind, fns, frames_per_batch=8, total_frames=32) as collector:
            frames = sum([b.numel() async for b in collector])
            helpers = pids_in(tmp_path)
            assert helpers and all(alive(p) for p in helpers)
    assert frames == 32
    assert wait_gone(helpers) == []
    leaks.check()


@matrix(["sync", "async"])
async def test_a_gymnasium_async_vector_env_runs_in_a_worker(kind, leaks) -> None:
    with anyio.fail_after(60):
        async with multi(kind, [async_vector_env] * 2, frames_per_batch=16, total_frames=64) as collector:
            grandchildren = [
                c.pid
                for w in collector._pool.workers
                for c in psutil.Process(w.process.pid).children(recursive=True)
            ]
            batches = [b async for b in collector]
    assert sum(b.numel() for b in batches) == 64
    assert len(grandchildren) >= 4  # two sub-env processes per worker (and their forkserver, if any)
    assert wait_gone(grandchildren) == []
    leaks.check()


async def test_a_worker_killed_takes_its_envs_processes_with_it(leaks, tmp_path) -> None:
    """The env's helper holds a copy of the worker's socket (it was forked): the worker's death is seen
    from its exit, not from the socket's EOF, and its process group is reaped."""
    fns = [lambda: child_env(str(tmp_path / "helper0.pid")), lambda: child_env(str(tmp_path / "helper1.pid"))]
    with anyio.fail_after(30):
        with pytest.raises(WorkerDiedError) as info:
            async with MultiSyncCollector(fns, frames_per_batch=8) as collector:
                await collector.__anext__()
                helpers = pids_in(tmp_path)
                os.kill(collector._pool.workers[1].process.pid, signal.SIGKILL)
                async for _ in collector:
                    pass
    assert info.value.exitcode == -signal.SIGKILL
    assert len(helpers) == 2 and wait_gone(helpers) == []
    leaks.check()


@matrix(["cancelled", "raised", "hung"])
async def test_envs_processes_are_reaped_on_every_exit_path(kind, leaks, tmp_path) -> None:
    """Leaving ``async with`` by cancellation, by an exception of the trainer, and with the workers hung in
    ``env.step`` (then terminated): no process of any env is left."""
    how = kind
    hang = 3 if how == "hung" else None
    fns = [lambda i=i: child_env(str(tmp_path / f"helper{i}.pid"), hang_at=hang) for i in range(2)]
    helpers: list[int] = []

    async def use() -> None:
        async with MultiAsyncCollector(fns, frames_per_batch=4) as collector:
            helpers.extend(pids_in(tmp_path))
            if how == "raised":
                raise KeyError("the trainer failed")
            if how == "cancelled":
                scope.cancel()
            async for _ in collector:  # "hung": no batch ever comes
                pass

    with anyio.fail_after(30):
        # "hung" leaves by this deadline; the others must not meet it (the workers' start under load: > 3 s)
        with anyio.move_on_after(3 if how == "hung" else 20) as scope:
            if how == "raised":
                with pytest.raises(KeyError):
                    await use()
            else:
                await use()
    assert scope.cancelled_caught == (how != "raised")
    assert len(helpers) == 2 and wait_gone(helpers) == []
    leaks.check()


async def test_the_real_cause_of_an_env_failure_comes_first(leaks, tmp_path) -> None:
    """The env fails, and closing the half-built env fails too: the trainer sees the env's error
    (the close's is a note), not "trying to close a closed environment"."""
    with anyio.fail_after(30):
        with pytest.raises(EnvBroken, match="start-up failed") as info:
            async with ProcessCollector(
                lambda: broken_child_env(str(tmp_path / "helper0.pid")), frames_per_batch=8
            ):
                pass
    assert "trying to close a closed environment" in "".join(info.value.__notes__)
    assert wait_gone(pids_in(tmp_path)) == []
    leaks.check()


# -- item 4: replay_buffer gets frames -----------------------------------------------------------------
class RecordingBuffer:
    """Records the batch size of every ``extend``."""

    def __init__(self) -> None:
        self.sizes: list[tuple[int, ...]] = []
        self.frames = 0

    def extend(self, batch: TensorDict) -> None:
        self.sizes.append(tuple(batch.batch_size))
        self.frames += batch.numel()
        mask = batch.get(("collector", "mask"), None)
        self.all_valid = getattr(self, "all_valid", True) and (mask is None or bool(mask.all()))


@pytest.mark.parametrize("kind", ["process", "sync", "async", "sync-cat0", "sync-cat-1"])
async def test_replay_buffer_receives_frames(kind: str) -> None:
    rb = RecordingBuffer()
    kwargs: dict[str, Any] = {"replay_buffer": rb, "frames_per_batch": 16, "total_frames": 64}
    if kind.startswith("sync-cat"):
        kwargs["cat_results"] = int(kind.removeprefix("sync-cat"))
        kind = "sync"
    with anyio.fail_after(60):
        async with multi(kind, [cartpole] * 2, **kwargs) as collector:
            written = [frames async for frames in collector.fill()]
    assert sum(written) == rb.frames == 64
    assert all(len(size) == 1 for size in rb.sizes), rb.sizes  # frames, never [workers, T] rows


async def test_replay_buffer_gets_only_the_frames_a_preempted_batch_holds() -> None:
    rb = RecordingBuffer()
    async with MultiSyncCollector(
        [cartpole, child_env_slow],
        frames_per_batch=40,
        total_frames=40,
        preemptive_threshold=0.5,
        replay_buffer=rb,
        worker_backend="serial",
    ) as collector:
        with anyio.fail_after(60):
            async for _ in collector.fill():
                pass
    # each batch: the fast worker's 20 frames and the few the slow one had when it was stopped
    assert all(len(size) == 1 and 20 <= size[0] < 40 for size in rb.sizes), rb.sizes
    assert rb.frames >= 40 and rb.all_valid


class _Slow(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros(4, np.float32), {}

    def step(self, action):
        time.sleep(0.05)
        return np.zeros(4, np.float32), 1.0, False, False, {}


def child_env_slow() -> GymEnv:
    return GymEnv(_Slow())


async def test_batched_envs_extend_the_buffer_with_each_workers_rows() -> None:
    rb = RecordingBuffer()
    env = lambda: GymEnv("CartPole-v1", num_envs=2)  # noqa: E731
    async with MultiSyncCollector([env] * 2, frames_per_batch=16, total_frames=16, replay_buffer=rb) as c:
        with anyio.fail_after(60):
            async for _ in c.fill():
                pass
    assert rb.sizes == [(4, 4)]  # [workers * envs, T], as two torchrl workers extending [2, 4] each


# -- issue 17: the serial backend is as reproducible as the process backend ---------------------------
class _Logits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.linear(observation)


def sampling_policy() -> TensorDictSequential:
    torch.manual_seed(0)
    return TensorDictSequential(
        TensorDictModule(_Logits(), ["observation"], ["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=Categorical, return_log_prob=True
        ),
    )


def vector_cartpole() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=2)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_serial_and_process_workers_give_the_same_seeded_batches(sync: bool) -> None:
    """Each worker's batches are the same with thread and process workers: all 4 of a sync run. Async:
    which worker delivers a batch is the schedule's choice (one may deliver all of a 4-batch run), so each
    run goes on until every worker delivered 2, and those 2 are compared."""
    cls = MultiSyncCollector if sync else MultiAsyncCollector
    per_worker = 4 if sync else 2  # sync: 128 frames in 4 batches, each with a row per worker

    async def run(backend: str) -> dict[int, list[torch.Tensor]]:
        out: dict[int, list[torch.Tensor]] = {0: [], 1: []}
        async with cls(
            [vector_cartpole] * 2,
            sampling_policy(),
            frames_per_batch=32,
            total_frames=128 if sync else -1,
            seed=7,
            worker_backend=backend,
        ) as c:
            async for batch in c:
                if sync:
                    for i in range(2):
                        out[i].append(batch["action"][i])
                else:
                    worker = int(batch["collector", "worker_id"].flatten()[0])
                    out[worker].append(batch["action"])
                    if min(len(actions) for actions in out.values()) >= per_worker:
                        break
        return {worker: actions[:per_worker] for worker, actions in out.items()}

    with anyio.fail_after(120):
        runs = [await run("serial"), await run("serial"), await run("process")]
    for run_ in runs:
        assert {w: len(a) for w, a in run_.items()} == {0: per_worker, 1: per_worker}
    for run_ in runs[1:]:
        for worker, actions in runs[0].items():
            assert all(torch.equal(a, b) for a, b in zip(actions, run_[worker], strict=True)), worker


# -- the trainer killed: the worker hung in env.step and its env's process go too -----------------------
TRAINER = """
import json, sys
import anyio
from aiocollect import MultiAsyncCollector
from test_fidelity import child_env

async def main(tmp):
    fns = [lambda: child_env(tmp + "/helper0.pid", hang_at=2), lambda: child_env(tmp + "/helper1.pid")]
    async with MultiAsyncCollector(fns, frames_per_batch=4) as c:
        await c.__anext__()  # worker 1's; worker 0 is hung in env.step by now
        pids = [w.process.pid for w in c._pool.workers]
        print(json.dumps(pids), flush=True)
        await anyio.sleep_forever()

if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
"""


@pytest.mark.slow  # a trainer subprocess (torch imported twice more)
def test_trainer_killed_while_a_worker_hangs_leaves_no_process(tmp_path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    tests = str(Path(__file__).parent)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])},
    )
    try:
        workers = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        helpers = pids_in(tmp_path)
        assert len(workers) == 2 and len(helpers) == 2 and all(map(alive, workers + helpers))
        proc.kill()
        proc.wait(30)
        assert wait_gone(workers + helpers, 5.0) == []
    finally:
        proc.kill()
        proc.communicate(timeout=30)


# -- get_distant_attr and map_fn ------------------------------------------------------------------------
class Tagged(GymEnv):
    def __init__(self) -> None:
        super().__init__("CartPole-v1")
        self.tags = {"names": ["a", "b"]}
        self.calls = 0

    def scale(self, x: int, *, by: int = 1) -> int:
        self.calls += 1
        return x * by


@pytest.mark.parametrize("kind", ["sync", "async", "sync-serial"])
async def test_get_distant_attr_and_map_fn_reach_every_workers_env_and_policy(kind: str) -> None:
    policy = sampling_policy()
    with anyio.fail_after(60):
        async with multi(kind, [Tagged, Tagged], frames_per_batch=8) as c:
            await c.__anext__()
            assert await c.get_distant_attr("env.tags['names'][-1]") == ["b", "b"]
            assert await c.map_fn("env.scale", [(2,), (3,)], [{"by": 10}, {}]) == [20, 3]
            assert await c.map_fn("env.scale", [(1,), (1,)]) == [1, 1]
            assert await c.get_distant_attr("env.calls") == [2, 2]
            await c.__anext__()  # collection goes on
    with anyio.fail_after(60):
        async with multi(kind, [Tagged, Tagged], policy, frames_per_batch=8) as c:
            weights = await c.get_distant_attr("policy[0].module.linear.weight")
    assert len(weights) == 2
    assert all(torch.equal(w, policy[0].module.linear.weight.detach()) for w in weights)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c: c.get_distant_attr("_pool"), ValueError, "start with 'env' or 'policy'"),
        (lambda c: c.get_distant_attr("env.__class__()"), ValueError, "cannot read"),
        (lambda c: c.get_distant_attr(3), TypeError, "must be a str"),
        (lambda c: c.map_fn("env.scale", [(1,)]), ValueError, "one entry per worker"),
    ],
)
async def test_distant_paths_are_checked_before_any_call(call, error, match) -> None:
    async with MultiSyncCollector([Tagged, Tagged], frames_per_batch=8, worker_backend="serial") as c:
        with anyio.fail_after(30), pytest.raises(error, match=match):
            await call(c)
        assert (await c.__anext__()).batch_size == (2, 4)  # nothing was sent: the workers are fine


def test_segments_of_a_killed_trainer_are_swept_by_the_next_collector(tmp_path):
    """A SIGKILLed process group never unlinks its /dev/shm segments: the next process's first segment
    sweeps those of dead pids (and leaves live processes' and other names alone)."""
    import subprocess

    from aiocollect._transport import _shm

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists
    orphan = tmp_path / f"aiocollect_{dead.pid}_abc123"
    alive = tmp_path / f"aiocollect_{os.getpid()}_def456"
    other = tmp_path / "someone_else_1"
    for path in (orphan, alive, other):
        path.write_bytes(b"x")
    assert _shm.sweep_orphans(str(tmp_path)) == [orphan.name]
    assert not orphan.exists()
    assert alive.exists()
    assert other.exists()
