"""``Collector`` life cycle: a free event loop, cancellation, closing, errors."""

from __future__ import annotations

import threading
import time
import traceback

import anyio
import numpy as np
import pytest
import torch
from blockbuster import blockbuster_ctx
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, CollectorClosedError, GymEnv
from support import (
    EnvFactory,
    EnvFailure,
    ListBuffer,
    LoopProbe,
    rollout_threads,
    threads_in_package_code,
)

pytestmark = [pytest.mark.anyio, pytest.mark.all_loops]  # the life cycle: every loop

ASYNCIO_BACKENDS = [
    pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="asyncio+uvloop"),
]


def mlp_policy() -> TensorDictModule:
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    class Greedy(nn.Module):
        def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = net(obs)
            return logits, logits.argmax(-1)

    return TensorDictModule(Greedy(), in_keys=["observation"], out_keys=["logits", "action"])


# -- the event loop stays free ----------------------------------------------------------------------
async def test_the_loop_runs_its_tasks_while_a_batch_is_collected(anyio_backend):
    """Mid-batch, the env asks a task of the loop for an answer and waits for it: the answer comes (a rollout
    on the loop's thread would wait for a loop it blocks). No env step and no policy call runs on the
    loop's thread (but the constructor's dry call)."""
    loop_thread = threading.get_ident()
    probe = LoopProbe()
    threads: set[int] = set()

    def on_step(n: int) -> None:
        threads.add(threading.get_ident())
        if n % 100 == 50:  # mid-batch, in each batch
            probe.ask()

    class Recording(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            threads.add(threading.get_ident())
            return self.net(observation).argmax(-1)

    factory = EnvFactory(fail_step_at=None)  # a HookedEnv: its on_step runs in the rollout's thread
    collector = Collector(factory, Recording(), frames_per_batch=100, total_frames=300, seed=0)
    threads.clear()  # the constructor's dry call of the policy runs here, before any batch
    async with collector, probe.answering():
        factory.hooks[0].on_step = on_step
        with anyio.fail_after(60):
            batches = [batch async for batch in collector]
    assert [b.numel() for b in batches] == [100] * 3
    assert probe.answers == [True] * 3
    assert threads and loop_thread not in threads


@pytest.mark.timing
async def test_event_loop_lag_while_collecting(anyio_backend):
    """A task ticking every 1 ms on the same loop sees a p99 lag under 10 ms while batches stream (a speed
    figure: ``nox -s timing``; ``test_the_loop_runs_its_tasks_while_a_batch_is_collected`` and
    ``test_no_blocking_call_on_the_event_loop`` give the verdict by cause).

    Each batch takes tens of ms of env steps and policy calls: run on the loop, it would stall the ticker
    that long. Two measures per tick of the ticker:

    * the CPU time the loop thread spent during the tick (``time.thread_time``): the loop running our
      code. It ignores waits for the GIL or for a CPU.
    * the wall-clock lag. The rest of it is the GIL hand-over (up to ``sys.getswitchinterval()``, 5 ms,
      per wake-up of the loop thread) and the OS. Each collecting window is compared with an idle window
      measured just before it on the same loop; the best of three pairs must pass.
    """
    collector = Collector(lambda: GymEnv("CartPole-v1"), mlp_policy(), frames_per_batch=512, seed=0)
    lags: list[float] = []
    cpu: list[float] = []

    async def tick() -> None:
        while True:
            start, start_cpu = time.perf_counter(), time.thread_time()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)
            cpu.append(time.thread_time() - start_cpu)

    def p99(values: list[float]) -> float:
        return float(np.percentile(values, 99))

    windows: list[tuple[float, float, float, int, int]] = []  # idle, busy, busy cpu, ticks, batches
    async with collector, anyio.create_task_group() as tg:
        tg.start_soon(tick)
        with anyio.fail_after(60):
            while len(windows) < 3 and not any(busy - idle < 0.010 for idle, busy, *_ in windows):
                lags.clear()
                await anyio.sleep(0.3)  # no batch in flight: the machine's own lag (the figure's baseline)
                idle = p99(lags)
                lags.clear()
                cpu.clear()
                batches = 0
                start = time.perf_counter()
                async for _ in collector:
                    batches += 1
                    if batches >= 2 and time.perf_counter() - start > 0.5:
                        break
                windows.append((idle, p99(lags), p99(cpu), len(lags), batches))
        tg.cancel_scope.cancel()
    report = "loop lag p99, idle -> collecting (loop CPU per tick): " + ", ".join(
        f"{i * 1e3:.2f} -> {b * 1e3:.2f} ms ({c * 1e3:.2f} ms; {t} ticks, {n} batches)"
        for i, b, c, t, n in windows
    )
    print(report)
    for *_, busy_cpu, ticks, _ in windows:
        assert ticks > 50, f"the ticker hardly ran while batches were collected; {report}"
        assert busy_cpu < 0.010, report
    assert any(busy - idle < 0.010 for idle, busy, *_ in windows), report


@pytest.mark.parametrize("anyio_backend", ASYNCIO_BACKENDS)
async def test_no_blocking_call_on_the_event_loop(anyio_backend):
    """blockbuster raises if anything on the loop sleeps, does file/socket I/O or waits on a lock."""
    rb = ListBuffer()
    policy = mlp_policy()
    collector = Collector(
        lambda: GymEnv("CartPole-v1", num_envs=4),
        policy,
        frames_per_batch=64,
        total_frames=256,
        split_trajs=True,
        track_policy_version=True,
    )
    background = Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=32, replay_buffer=rb)
    with blockbuster_ctx(), anyio.fail_after(60):
        async with collector:
            async for _ in collector:
                await collector.update_weights(policy)
                async with collector.pause():
                    pass
            await collector.set_seed(1)
            await collector.reset()
            await collector.load_state_dict(await collector.state_dict())
            collector.statistics()
        async with background:
            await background.start()
            await rb.wait_for(2)
        # a failing batch closes the env on the way out
        failing = Collector(EnvFactory(fail_step_at=3), frames_per_batch=8)
        with pytest.raises(EnvFailure):
            await failing.__anext__()


# -- cancellation and closing ----------------------------------------------------------------------
async def test_cancelling_the_consumer_stops_the_batch_promptly(anyio_backend, timing):
    """Cancelled at the batch's 10th step (of 200), the rollout stops there: no batch is delivered, the
    env is not in a step, and the rollout thread is idle and still the collector's."""
    before = set(rollout_threads())
    factory = EnvFactory(step_delay=0.005)
    fpb = 200
    reached, release = threading.Event(), threading.Event()

    def hold(n: int) -> None:
        if n == 10:  # the consumer is cancelled while the rollout waits here
            reached.set()
            release.wait(30)

    async with Collector(factory, frames_per_batch=fpb) as collector:
        (env,) = factory.hooks
        env.on_step = hold
        scope = anyio.CancelScope()

        async def consume() -> None:
            with scope:
                async for _ in collector:
                    pytest.fail("a batch finished although its consumer was cancelled at step 10")

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(30):
                await anyio.to_thread.run_sync(reached.wait)
            start = time.perf_counter()
            scope.cancel()
            await anyio.wait_all_tasks_blocked()  # the consumer took the cancellation: the rollout is told
            release.set()
        timing.bound(time.perf_counter() - start, 0.5, "stopping the batch")  # well before its end (1 s)
        assert scope.cancelled_caught
        assert env.in_step == 0
        assert env.steps < fpb
        assert threads_in_package_code() == []  # the rollout thread is idle
        assert len(set(rollout_threads()) - before) == 1  # the collector's own, until it closes
        assert collector.statistics().frames == 0  # the partial batch is not delivered
        # the collector is still usable
        env.on_step = None
        env.step_delay = 0.0
        with anyio.fail_after(20):
            batch = await collector.__anext__()
        assert batch.batch_size == (fpb,)
        assert collector.statistics().frames == fpb
    assert env.steps < 2 * fpb
    assert set(rollout_threads()) <= before  # the rollout thread ended with the collector


async def test_aclose_twice_and_use_after_close(anyio_backend):
    factory = EnvFactory()
    collector = Collector(factory, frames_per_batch=8)
    async with collector:
        await collector.__anext__()
    assert collector.closed
    await collector.aclose()
    await collector.aclose()
    with pytest.raises(CollectorClosedError):
        await collector.__anext__()
    with pytest.raises(CollectorClosedError):
        async for _ in collector:
            pass
    for call in (
        collector.reset,
        lambda: collector.set_seed(0),
        collector.state_dict,
        lambda: collector.load_state_dict(
            {"frames": 0, "batches": 0, "next_traj_id": 0, "policy_version": 0}
        ),
        collector.update_weights,
        collector.start,
    ):
        with pytest.raises(CollectorClosedError):
            await call()
    with pytest.raises(CollectorClosedError):
        async with collector:
            pass


async def test_aclose_without_async_with(anyio_backend):
    collector = Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=8)
    batch = await collector.__anext__()
    assert batch.batch_size == (8,)
    await collector.aclose()
    assert collector.closed
    with pytest.raises(CollectorClosedError, match="closed"):
        await collector.__anext__()


# -- errors ----------------------------------------------------------------------------------------
def assert_original_error(info: pytest.ExceptionInfo, function: str) -> None:
    assert type(info.value) is EnvFailure  # not wrapped in an ExceptionGroup or another type
    text = "".join(traceback.format_exception(info.value))
    assert f"in {function}" in text, text


async def assert_closed_by_failure(collector: Collector) -> None:
    assert collector.closed
    with pytest.raises(CollectorClosedError, match="EnvFailure"):
        await collector.__anext__()


async def test_env_step_error_surfaces_from_async_for(anyio_backend):
    async with Collector(EnvFactory(fail_step_at=5), frames_per_batch=8) as collector:
        with pytest.raises(EnvFailure) as info:
            async for _ in collector:
                pass
        assert_original_error(info, "explode_in_step")
        await assert_closed_by_failure(collector)


async def test_env_error_surfaces_from_async_with(anyio_backend):
    """Not caught inside the block: ``async with`` lets the original exception through."""
    with pytest.raises(EnvFailure) as info:
        async with Collector(EnvFactory(fail_step_at=5), frames_per_batch=8) as collector:
            async for _ in collector:
                pass
    assert_original_error(info, "explode_in_step")
    await assert_closed_by_failure(collector)


async def test_env_reset_error_surfaces_from_async_for(anyio_backend):
    # reset #1 is the collector's first; #2 the reset after the first episode end, mid-batch
    factory = EnvFactory(fail_reset_at=2)
    async with Collector(factory, frames_per_batch=200, seed=0) as collector:
        with pytest.raises(EnvFailure) as info:
            await collector.__anext__()
        assert_original_error(info, "explode_in_reset")
        await assert_closed_by_failure(collector)


async def test_policy_error_surfaces_from_async_for(anyio_backend):
    calls = 0

    def explode_in_policy(td):
        nonlocal calls
        calls += 1
        if calls == 3:  # call 1 is the collector's dry run at construction
            raise EnvFailure("policy failed")
        td["action"] = torch.zeros(td.batch_size, dtype=torch.int64)
        return td

    async with Collector(lambda: GymEnv("CartPole-v1"), explode_in_policy, frames_per_batch=8) as c:
        with pytest.raises(EnvFailure) as info:
            async for _ in c:
                pass
        assert_original_error(info, "explode_in_policy")
        await assert_closed_by_failure(c)


async def test_background_error_surfaces_from_async_with(anyio_backend):
    rb = ListBuffer()
    with pytest.raises(EnvFailure) as info:
        async with Collector(EnvFactory(fail_step_at=20), frames_per_batch=8, replay_buffer=rb) as collector:
            await collector.start()
            await anyio.sleep_forever()  # cancelled by the failure
    assert_original_error(info, "explode_in_step")
    assert len(rb.batches) == 2
    await assert_closed_by_failure(collector)


# -- Collector.create: built off the event loop --------------------------------------------------------
class _RecordingEnv:
    """A CartPole GymEnv that records the thread it was built on and whether it was closed; built, it waits
    for ``release`` when ``hold`` (a test's synchronisation point, set after ``started``)."""

    built_on_main: list[bool] = []  # noqa: RUF012 - a test's record
    closed: list[bool] = []  # noqa: RUF012
    started = threading.Event()
    release = threading.Event()

    def __init__(self, hold: bool = False) -> None:
        _RecordingEnv.started.set()
        if hold:
            assert _RecordingEnv.release.wait(30), "the test never released the env's construction"
        _RecordingEnv.built_on_main.append(threading.current_thread() is threading.main_thread())
        self.env = GymEnv("CartPole-v1")

    def __getattr__(self, name):
        return getattr(self.env, name)

    def close(self) -> None:
        _RecordingEnv.closed.append(True)
        self.env.close()


async def test_create_builds_off_the_loop_and_works():
    _RecordingEnv.built_on_main.clear()
    collector = await Collector.create(_RecordingEnv, mlp_policy(), frames_per_batch=16, total_frames=32)
    assert isinstance(collector, Collector)
    assert _RecordingEnv.built_on_main == [False]
    async with collector:
        batches = [b async for b in collector]
    assert [b.numel() for b in batches] == [16, 16]


async def test_create_raises_the_constructors_errors():
    with pytest.raises(ValueError, match="frames_per_batch"):
        await Collector.create(_RecordingEnv, frames_per_batch=0)

    def broken():
        raise KeyError("no such env")

    with pytest.raises(KeyError, match="no such env"):
        await Collector.create(broken, frames_per_batch=8)


async def test_create_cancelled_closes_what_it_built():
    """Cancelled while the env is being built (in a worker thread), ``create`` waits for it and closes it."""
    _RecordingEnv.closed.clear()
    _RecordingEnv.started.clear()
    _RecordingEnv.release.clear()
    scope = anyio.CancelScope()

    async def create() -> None:
        with scope:
            await Collector.create(lambda: _RecordingEnv(hold=True), frames_per_batch=8)
            pytest.fail("create returned although it was cancelled while the env was built")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(create)
            await anyio.to_thread.run_sync(_RecordingEnv.started.wait)
            scope.cancel()
            await anyio.wait_all_tasks_blocked()  # create took the cancellation and waits for the env
            _RecordingEnv.release.set()
    assert scope.cancelled_caught
    assert _RecordingEnv.closed == [True]
