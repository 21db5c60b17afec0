"""MultiSyncCollector, MultiAsyncCollector, ProcessCollector: shapes, semantics, faults, leaks."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from typing import ClassVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import gymnasium as gym
import numpy as np
import pytest
import torch

from aiocollect import (
    CollectorClosedError,
    GymEnv,
    MultiAsyncCollector,
    MultiCollector,
    MultiSyncCollector,
    ProcessCollector,
    WorkerDiedError,
)
from support import ConstantPolicy, assert_clean, broken_factory, cartpole, cartpole4, pendulum
from support import children as our_children

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("leaks")]

BACKENDS = ["serial", "process"]


class SlowEnv(gym.Env):
    """CartPole-like env whose step sleeps (a slow worker)."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.delay = delay
        self.fail_at = fail_at
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.fail_at is not None and self.t >= self.fail_at:
            raise ZeroDivisionError("env exploded on purpose")
        if self.delay:
            time.sleep(self.delay)
        return np.full(2, self.t % 7 / 7, np.float32), 1.0, self.t % 5 == 0, False, {}


def slow_env():
    return GymEnv(SlowEnv(delay=0.05))


def fast_env():
    return GymEnv(SlowEnv())


def failing_env():
    return GymEnv(SlowEnv(fail_at=30))


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


async def test_sync_stack_shapes_and_traj_ids(backend):
    with anyio.fail_after(60):
        async with MultiSyncCollector(
            [cartpole4, cartpole4], frames_per_batch=64, total_frames=256, worker_backend=backend, seed=0
        ) as c:
            batches = [b async for b in c]
    assert len(batches) == 4
    for b in batches:
        assert b.batch_size == (2, 4, 8)
        assert b.names == [None, None, "time"]
        assert b["next", "reward"].shape == (2, 4, 8, 1)
    ids = torch.stack([b["collector", "traj_ids"] for b in batches])
    # worker i draws ids i, i+N, ...: the two workers never share one
    assert set(ids[:, 0].unique().tolist()).isdisjoint(ids[:, 1].unique().tolist())
    assert c.statistics().frames == 256
    assert_clean()


async def test_cat_results_and_per_worker_frames():
    async with MultiSyncCollector(
        [cartpole4, cartpole4], frames_per_batch=64, total_frames=64, cat_results=0, worker_backend="serial"
    ) as c:
        (b,) = [b async for b in c]
    assert b.batch_size == (8, 8)
    async with MultiSyncCollector(
        [cartpole4, cartpole4], frames_per_batch=64, total_frames=64, cat_results=-1, worker_backend="serial"
    ) as c:
        (b,) = [b async for b in c]
    assert b.batch_size == (4, 16)
    async with MultiSyncCollector(
        [cartpole, cartpole],
        frames_per_batch=[10, 30],
        cat_results=-1,
        total_frames=40,
        worker_backend="serial",
    ) as c:
        (b,) = [b async for b in c]
    assert b.batch_size == (40,)
    with pytest.raises(ValueError, match="frames_per_batch has 3 values for 2 workers"):
        MultiSyncCollector([cartpole, cartpole], frames_per_batch=[1, 2, 3])
    with pytest.raises(ValueError, match="cat_results='stack' needs equal"):
        async with MultiSyncCollector(
            [cartpole, cartpole], frames_per_batch=[10, 30], worker_backend="serial"
        ):
            pass


async def test_process_and_serial_give_identical_batches():
    out = {}
    for backend in BACKENDS:
        async with MultiSyncCollector(
            [cartpole4, cartpole4],
            frames_per_batch=[40, 40],
            total_frames=160,
            worker_backend=backend,
            seed=3,
        ) as c:
            out[backend] = [b async for b in c]
    for a, b in zip(out["serial"], out["process"], strict=True):
        assert (a == b).all()
    assert_clean()


async def test_async_collector(backend):
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [cartpole, cartpole4], frames_per_batch=32, total_frames=320, worker_backend=backend
        ) as c:
            batches = [b async for b in c]
    assert sum(b.numel() for b in batches) >= 320
    workers = {int(b["collector", "worker_id"].unique()) for b in batches}
    assert workers <= {0, 1}
    for b in batches:
        assert b.numel() == 32
        assert b.names[-1] == "time"
    assert_clean()


async def test_process_collector_and_factory():
    async with ProcessCollector(cartpole, frames_per_batch=16, total_frames=48) as c:
        shapes = [b.batch_size async for b in c]
    assert shapes == [(16,)] * 3
    assert isinstance(MultiCollector([cartpole], sync=True, frames_per_batch=8), MultiSyncCollector)
    assert isinstance(MultiCollector([cartpole], sync=False, frames_per_batch=8), MultiAsyncCollector)
    with pytest.raises(TypeError, match="sync must be True or False"):
        MultiCollector([cartpole], sync=None, frames_per_batch=8)
    assert_clean()


async def test_preemption_marks_missing_frames(backend, timing):
    with anyio.fail_after(60):
        async with MultiSyncCollector(
            [fast_env, slow_env],
            frames_per_batch=400,
            preemptive_threshold=0.5,
            worker_backend=backend,
            total_frames=800,
        ) as c:
            start = time.monotonic()
            batch = await c.__anext__()
            elapsed = time.monotonic() - start
    # the slow worker needs 200 * 50 ms = 10 s for its share; preemption delivers before it has it all
    timing.bound(elapsed, 5, "the preempted batch")
    mask = batch["collector", "mask"]
    assert mask[0].all()
    assert not mask[1].all()
    assert (batch["collector", "traj_ids"][~mask] == -1).all()
    assert c.statistics().frames == int(mask.sum())
    assert_clean()


async def test_preemption_argument_checked():
    with pytest.raises(ValueError, match="preemptive_threshold"):
        MultiSyncCollector([cartpole], frames_per_batch=8, preemptive_threshold=0)
    with pytest.raises(ValueError, match="preemptive_threshold"):
        MultiSyncCollector([cartpole], frames_per_batch=8, preemptive_threshold=1.5)


async def test_worker_exception_keeps_type_and_traceback(backend):
    with anyio.fail_after(30):
        with pytest.raises(ZeroDivisionError) as info:
            async with MultiSyncCollector(
                [fast_env, failing_env], frames_per_batch=40, worker_backend=backend
            ) as c:
                async for _ in c:
                    pass
    text = "".join(traceback.format_exception(info.value))
    assert "env exploded on purpose" in text
    assert "raised in worker 1; worker traceback" in text and "in step" in text
    assert c.closed
    with pytest.raises(CollectorClosedError):
        await c.__anext__()
    assert_clean()


async def test_startup_error_raised_from_async_with(backend):
    with anyio.fail_after(30), pytest.raises(KeyError, match="no such env"):
        async with MultiSyncCollector([cartpole, broken_factory], frames_per_batch=8, worker_backend=backend):
            pass
    assert_clean()


async def test_killed_worker_raises_worker_died_error():
    with anyio.fail_after(30):
        with pytest.raises(WorkerDiedError) as info:
            async with MultiAsyncCollector([slow_env, slow_env], frames_per_batch=4) as c:
                pids = [w.process.pid for w in c._pool.workers]
                os.kill(pids[1], signal.SIGKILL)
                async for _ in c:
                    pass
    assert info.value.exitcode == -signal.SIGKILL
    assert_clean()


async def test_iterating_unentered_collector_raises():
    c = MultiSyncCollector([cartpole], frames_per_batch=8)
    with pytest.raises(RuntimeError, match="async with"):
        await c.__anext__()


async def test_bad_input_before_any_process():
    with pytest.raises(TypeError, match="create_env_fns must be a list"):
        MultiSyncCollector(cartpole, frames_per_batch=8)
    with pytest.raises(TypeError, match=r"create_env_fns\[1\]"):
        MultiSyncCollector([cartpole, "CartPole-v1"], frames_per_batch=8)
    with pytest.raises(ValueError, match="frames_per_batch"):
        MultiSyncCollector([cartpole], frames_per_batch=0)
    with pytest.raises(ValueError, match="backend"):
        MultiSyncCollector([cartpole], frames_per_batch=8, backend="threads")
    with pytest.raises(TypeError, match="cannot be pickled"):
        lock = threading.Lock()
        MultiSyncCollector([lambda: (lock, cartpole())[1]], frames_per_batch=8)
    assert our_children() == []


class WatchedPolicy(torch.nn.Module):
    """Records, each time it is pickled, whether that happened on the main (event-loop) thread."""

    on_main_thread: ClassVar[list[bool]] = []

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, observation):
        return self.linear(observation).argmax(-1)

    def __getstate__(self):
        WatchedPolicy.on_main_thread.append(threading.current_thread() is threading.main_thread())
        return super().__getstate__()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_policy_is_pickled_once_and_off_the_event_loop(backend):
    """A large policy's pickling would hold the loop: it happens once, in a thread, on entering."""
    WatchedPolicy.on_main_thread.clear()
    c = MultiSyncCollector([cartpole] * 3, WatchedPolicy(), frames_per_batch=12, worker_backend=backend)
    assert WatchedPolicy.on_main_thread == []  # the constructor does not pickle it
    async with c:
        batch = await c.__anext__()
    assert batch.numel() == 12
    assert WatchedPolicy.on_main_thread == [False]


class LockedPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.lock = threading.Lock()  # does not pickle

    def forward(self, observation):
        return self.linear(observation).argmax(-1)


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_unpicklable_policy_fails_on_entering_before_any_process(cls, backend):
    c = cls([cartpole] * 2, LockedPolicy(), frames_per_batch=8, worker_backend=backend)
    with pytest.raises(TypeError, match="the policy cannot be pickled for the worker processes"):
        async with c:
            pass
    assert our_children() == []
    with pytest.raises(CollectorClosedError, match="failed to start"):
        await c.__anext__()


async def test_update_weights_reaches_workers(backend):
    trainer = ConstantPolicy(0.0)
    async with MultiSyncCollector(
        [pendulum, pendulum], trainer, frames_per_batch=8, worker_backend=backend, track_policy_version=True
    ) as c:
        b0 = await c.__anext__()
        assert (b0["action"] == 0).all()
        with torch.no_grad():
            trainer.value.fill_(0.5)  # in place, no update: must not leak into the workers
        b1 = await c.__anext__()
        assert (b1["action"] == 0).all()
        version = await c.update_weights(wait=True)
        assert version == 1
        b2 = await c.__anext__()
        assert torch.allclose(b2["action"], torch.tensor(0.5))
        assert (b2["collector", "policy_version"] == 1).all()
        assert c.worker_policy_versions() == [1, 1]
        # weights as a state dict; mismatched ones are refused before anything is published
        await c.update_weights({"value": torch.tensor([-0.25])})
        b3 = await c.__anext__()
        assert torch.allclose(b3["action"], torch.tensor(-0.25))
        with pytest.raises(ValueError, match="value"):
            await c.update_weights({"value": torch.zeros(3)})
    assert_clean()


async def test_async_weights_reach_all_frames_within_two_batches():
    trainer = ConstantPolicy(0.0)
    async with MultiAsyncCollector(
        [pendulum, pendulum], trainer, frames_per_batch=8, track_policy_version=True
    ) as c:
        await c.__anext__()
        with torch.no_grad():
            trainer.value.fill_(1.0)
        await c.update_weights()
        # each worker has at most two batches in flight with the old weights; from its third batch
        # after the update on, every frame runs the new ones, and versions never go backwards
        per_worker: dict[int, list[int]] = {0: [], 1: []}
        with anyio.fail_after(30):
            while min(len(v) for v in per_worker.values()) < 3:
                b = await c.__anext__()
                versions = b["collector", "policy_version"].unique().tolist()
                assert len(versions) == 1
                per_worker[int(b["collector", "worker_id"][0])].append(versions[0])
                if versions[0] == 1:
                    assert (b["action"] == 1.0).all()
        for versions in per_worker.values():
            assert versions == sorted(versions)
            assert versions[2:] == [1] * (len(versions) - 2)


async def test_control_calls(backend):
    async with MultiSyncCollector(
        [cartpole4, cartpole4], frames_per_batch=16, worker_backend=backend, total_frames=64
    ) as c:
        assert await c.set_seed(10) == 17  # worker 0 uses seeds 10..13, worker 1 14..17
        assert await c.getattr_env("batch_size") == torch.Size([4])
        await c.__anext__()
        state = await c.state_dict()
        assert state["frames"] == 16 and "worker0" in state and "worker1" in state
        await c.reset()
        await c.load_state_dict(state)
        assert c.statistics().frames == 16
        rest = [b async for b in c]
        assert len(rest) == 3  # the budget continues from the saved 16 frames


async def test_getattr_reaches_any_worker():
    """``getattr_env``/``getattr_policy`` ask worker 0, or the worker ``node=`` names (as on the remote
    collectors: one method for every fleet)."""
    async with MultiAsyncCollector(
        [cartpole, cartpole4], frames_per_batch=16, worker_backend="serial", total_frames=32
    ) as c:
        with anyio.fail_after(30):
            assert await c.getattr_env("batch_size") == torch.Size([])
            assert await c.getattr_env("batch_size", node=1) == torch.Size([4])
            with pytest.raises(AttributeError):
                await c.getattr_policy("no_such_attribute", node=1)


class Buffer:
    def __init__(self):
        self.batches = []
        self.grew = anyio.Event()

    def extend(self, batch):  # called in a worker thread
        self.batches.append(batch)
        anyio.from_thread.run_sync(self.grew.set)


async def test_replay_buffer_start_and_pause():
    rb = Buffer()
    async with MultiSyncCollector(
        [cartpole, cartpole], frames_per_batch=16, replay_buffer=rb, worker_backend="serial"
    ) as c:
        with anyio.fail_after(20):
            await c.start()
            await rb.grew.wait()
            async with c.pause():
                n = len(rb.batches)
                for _ in range(20):
                    await anyio.lowlevel.checkpoint()
                assert len(rb.batches) == n
            rb.grew = anyio.Event()
            await rb.grew.wait()
    assert len(rb.batches) > n


async def test_cancel_mid_batch_then_continue():
    async with MultiSyncCollector([slow_env, fast_env], frames_per_batch=200, worker_backend="process") as c:
        with anyio.move_on_after(0.3) as scope:
            await c.__anext__()
        assert scope.cancelled_caught
        with anyio.fail_after(20):
            b = await c.__anext__()
        assert b.batch_size == (2, 100)
    assert_clean()


async def test_leaving_by_break_exception_or_cancellation_reaps_everything():
    async with MultiAsyncCollector([cartpole, cartpole], frames_per_batch=8) as c:
        async for _ in c:
            break
    assert_clean()
    with pytest.raises(LookupError):
        async with MultiSyncCollector([cartpole, cartpole], frames_per_batch=8) as c:
            await c.__anext__()
            raise LookupError("trainer bug")
    assert_clean()
    with anyio.move_on_after(1.0) as scope:
        async with MultiSyncCollector([slow_env, slow_env], frames_per_batch=400) as c:
            await c.__anext__()  # 10 s of work: cancelled mid-batch
    assert scope.cancelled_caught
    assert_clean()


async def test_getattr_policy():
    async with MultiSyncCollector(
        [pendulum], ConstantPolicy(0.5), frames_per_batch=8, worker_backend="serial"
    ) as c:
        value = await c.getattr_policy("value")
    assert torch.allclose(value, torch.tensor([0.5]))
