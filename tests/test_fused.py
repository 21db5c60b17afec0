"""The fused central-inference path of ``AsyncEnvCollector`` (``fused=``): one thread drives the
``ProcessVectorEnv`` workers' doorbells, writes their frames and runs the policy, the loop only receives
batches. Its batches against the engine on the loop (bit for bit), the policy off the loop, weights and
their versions, pauses, seeds and checkpoints, errors (type and traceback, a killed worker, dropped
parts), the refusals of ``fused=True``, cancellation and leaks."""

from __future__ import annotations

import functools
import os
import signal
import threading
import traceback

import anyio
import anyio.to_thread
import gymnasium as gym
import pytest
import torch
from tensordict import TensorDictBase

from aiocollect import AsyncEnvCollector, ProcessVectorEnv, RestartPolicy, WorkerDiedError
from support import ENV_ID, EnvFailure, HookedEnv, LoopProbe, take_until, wait_until

pytestmark = pytest.mark.anyio


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def hooked(**hooks: object) -> gym.Env:
    return HookedEnv(gym.make("CartPole-v1"), **hooks)  # type: ignore[arg-type]


class Argmax(torch.nn.Module):
    """A small policy that records the threads it runs in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 2)
        self.threads: set[int] = set()

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.get_ident())
        return self.net(observation).argmax(-1)


class Constant(torch.nn.Module):
    """Action 1 where its weight is positive, else 0: the action says which weights computed it."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(value))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (self.weight > 0).long().expand(observation.shape[0]).clone()


async def make(fns: list, workers: int = 2) -> ProcessVectorEnv:
    return await anyio.to_thread.run_sync(functools.partial(ProcessVectorEnv, fns, num_workers=workers))


async def collect(envs, policy, *, fused, **kwargs) -> tuple[list[TensorDictBase], str]:
    async with AsyncEnvCollector(envs, policy, fused=fused, **kwargs) as c:
        with anyio.fail_after(60):
            batches = [b async for b in c]
        kind = type(c._engine.stepper).__name__
        assert c.fused == (kind == "FusedSteps")
    return batches, kind


def assert_same(a: list[TensorDictBase], b: list[TensorDictBase]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert set(x.keys(True, True)) == set(y.keys(True, True))
        for key in x.keys(True, True):
            assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("policy", ["random", "module"])
async def test_fused_batches_equal_the_engines_bit_for_bit(anyio_backend, leaks, policy):
    """One whole ``ProcessVectorEnv`` (every call on all its sub-envs): the fused path writes the frames the
    engine on the loop writes, key for key, with episodes ending inside and across batches."""
    kwargs = {"frames_per_batch": 50, "total_frames": 1_000, "seed": 3, "track_policy_version": True}
    runs = {}
    for fused in (True, False):
        env = await make([cartpole] * 6, workers=3)
        runs[fused] = await collect(
            [lambda e=env: e], None if policy == "random" else Argmax(), fused=fused, **kwargs
        )
    (fused_batches, fused_kind), (engine_batches, engine_kind) = runs[True], runs[False]
    assert (fused_kind, engine_kind) == ("FusedSteps", "LoopSteps")
    assert_same(fused_batches, engine_batches)
    done = torch.cat([b["next", "done"] for b in fused_batches])
    assert done.sum() > 10  # episodes ended (and their sub-envs were reset in the same step)


async def test_split_parts_give_each_env_the_frames_of_the_whole_env(leaks):
    """``split()`` parts under the fused path: whichever worker is ready is stepped, and each env's frames
    (in order) are those of the whole env."""
    per_env = {}
    for split in (True, False):
        env = await make([cartpole] * 6)
        envs = env.split() if split else [env]
        async with AsyncEnvCollector(
            envs, Argmax(), fused=True, frames_per_batch=60, seed=7, min_batch=3
        ) as c:
            # until every env has 30 frames (a shared frame budget could go to the parts that step faster)
            batches = await take_until(c, each=30, members=6, key=ENV_ID, frames=True)
            assert type(c._engine.stepper).__name__ == "FusedSteps"
        data = torch.cat(batches)
        per_env[split] = {i: data[data["collector", "env_id"] == i] for i in range(6)}
    for i in range(6):
        a, b = per_env[True][i], per_env[False][i]
        n = min(len(a), len(b))
        assert n >= 30
        for key in ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done")):
            assert torch.equal(a[key][:n], b[key][:n]), (i, key)


class Asking(Argmax):
    """:class:`Argmax` whose every 10th call asks a task of the event loop for an answer and waits for it."""

    def __init__(self, probe: LoopProbe) -> None:
        super().__init__()
        self.probe, self.calls = probe, 0

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % 10 == 0:
            self.probe.ask()
        return super().forward(observation)


async def test_the_policy_runs_off_the_loop_and_the_loop_stays_free(anyio_backend, leaks):
    """The fused thread runs the policy (never the loop's thread), and while it drives the workers the loop
    runs its tasks: a policy call that waits for a task of the loop gets its answer (a thread that held the
    loop would wait for ever)."""
    probe = LoopProbe()
    env = await make([cartpole] * 8)
    loop_thread = threading.get_ident()
    async with (
        probe.answering(),
        AsyncEnvCollector(
            env.split(), Asking(probe), frames_per_batch=512, total_frames=5_120, fused=True
        ) as c,
    ):
        with anyio.fail_after(120):
            async for _ in c:
                pass
        copy = c.policy
    assert copy is not None and copy.threads and loop_thread not in copy.threads
    assert len(probe.answers) >= 10 and all(probe.answers), probe.answers
    assert loop_thread not in probe.threads


async def test_update_weights_applies_between_calls_with_its_version(leaks):
    """Each frame's action comes from the weights of the version it is tagged with."""
    env = await make([cartpole] * 4)
    async with AsyncEnvCollector(
        env.split(),
        Constant(-1.0),
        frames_per_batch=64,
        total_frames=64 * 40,
        track_policy_version=True,
        fused=True,
    ) as c:
        batches = []
        with anyio.fail_after(60):
            async for batch in c:
                batches.append(batch)
                if len(batches) == 10:
                    assert await c.update_weights(Constant(1.0)) == 1
                    assert c.policy.weight.item() == 1.0
    data = torch.cat(batches)
    version = data["collector", "policy_version"]
    assert set(version.tolist()) == {0, 1}
    assert torch.equal(data["action"], version)  # version 0: action 0, version 1: action 1


async def test_pause_starts_no_call_and_waits_for_the_steps(anyio_backend, leaks):
    env = await make([functools.partial(hooked, step_delay=0.002)] * 4)
    async with AsyncEnvCollector(env.split(), Argmax(), frames_per_batch=64, fused=True) as c:
        it = aiter(c)
        with anyio.fail_after(60):
            await anext(it)
            async with c.pause():
                engine = c._engine
                assert engine.idle
                calls = len(c.policy_batch_sizes)
                await anyio.sleep(0.2)  # a window for a call that must not come
                assert len(c.policy_batch_sizes) == calls and engine.idle
            await anext(it)
            assert len(c.policy_batch_sizes) > calls


async def test_set_seed_and_checkpoints(anyio_backend, leaks):
    """``set_seed`` restarts the fused engine (its successor reads the replies left owed): the frames
    are a fresh seeded collector's; a checkpoint loads into another fused collector."""

    async def first_batches(seed: int | None, set_to: int | None, n: int = 3) -> tuple[list, dict]:
        env = await make([cartpole] * 4)
        async with AsyncEnvCollector(
            [lambda: env], Argmax(), frames_per_batch=40, seed=seed, fused=True
        ) as c:
            it = aiter(c)
            with anyio.fail_after(60):
                if set_to is not None:
                    await anext(it)
                    await c.set_seed(set_to)
                out = [await anext(it) for _ in range(n)]
                state = await c.state_dict()
        return out, state

    fresh, _ = await first_batches(5, None)
    reseeded, state = await first_batches(11, 5)
    for a, b in zip(fresh, reseeded, strict=True):
        for key in ("observation", "action", ("next", "observation"), ("next", "reward")):
            assert torch.equal(a[key], b[key]), key
    assert state["frames"] == 4 * 40 and set(state) >= {"policy", "rng", "next_traj_id"}
    env = await make([cartpole] * 4)
    async with AsyncEnvCollector(
        [lambda: env], Argmax(), frames_per_batch=40, total_frames=400, seed=11, fused=True
    ) as c:
        await c.load_state_dict(state)
        with anyio.fail_after(60):
            rest = [b async for b in c]
    assert sum(b.numel() for b in rest) == 400 - 160


async def test_trajs_per_batch_whole_episodes(leaks):
    env = await make([cartpole] * 4)
    batches, kind = await collect(
        [lambda: env], Argmax(), fused=True, trajs_per_batch=6, total_frames=600, seed=0
    )
    assert kind == "FusedSteps" and batches
    for batch in batches:
        done = batch["next", "done"].squeeze(-1)
        ids = batch["collector", "traj_ids"]
        assert done.sum() == 6 == ids.unique().numel()


@pytest.mark.parametrize("where", ["step", "reset"])
async def test_an_env_error_keeps_its_type_and_the_workers_traceback(anyio_backend, leaks, where):
    fault = functools.partial(hooked, **{f"fail_{where}_at": 3})
    env = await make([cartpole, cartpole, fault, cartpole])
    with anyio.fail_after(60), pytest.raises(EnvFailure) as info:
        async with AsyncEnvCollector(env.split(), Argmax(), frames_per_batch=16, seed=0, fused=True) as c:
            async for _ in c:
                pass
    text = "".join(traceback.format_exception(info.value))
    assert f"explode_in_{where}" in text and "ProcessVectorEnv worker 1" in text, text


async def test_a_killed_worker_raises_worker_died_error(leaks):
    env = await make([cartpole] * 4)
    with anyio.fail_after(60), pytest.raises(WorkerDiedError) as info:
        async with AsyncEnvCollector(env.split(), Argmax(), frames_per_batch=64, fused=True) as c:
            k = 0
            async for _ in c:
                k += 1
                if k == 2:
                    os.kill(env._workers[1].process.pid, signal.SIGKILL)
    assert info.value.exitcode == -signal.SIGKILL


async def test_on_env_error_drop_drops_the_part_and_goes_on(leaks):
    fault = functools.partial(hooked, fail_step_at=10)
    env = await make([cartpole, cartpole, fault, cartpole])
    async with AsyncEnvCollector(
        env.split(), Argmax(), frames_per_batch=32, total_frames=32 * 30, on_env_error="drop", fused=True
    ) as c:
        events = c.events(kinds={"worker_failed"})
        with anyio.fail_after(60):
            batches = [b async for b in c]
        stats = c.statistics()
    failed = []
    async for event in events:
        failed.append(event.worker_id)
    assert failed == [2, 3]
    late = torch.cat(batches[-5:])["collector", "env_id"]
    assert set(late.tolist()) == {0, 1}
    assert [w.state for w in stats.workers] == ["stopped", "stopped", "failed", "failed"]


async def test_cancelled_mid_run_leaves_nothing(anyio_backend, leaks):
    env = await make([functools.partial(hooked, step_delay=0.001)] * 4)
    with anyio.move_on_after(1.0) as scope:
        async with AsyncEnvCollector(env.split(), Argmax(), frames_per_batch=100, fused=True) as c:
            async for _ in c:
                pass
    assert scope.cancelled_caught
    with pytest.raises(RuntimeError, match="closed"):
        await env.reset()


async def test_fused_true_refusals_and_fused_none_falls_back(leaks):
    async def async_policy(td):
        return td

    with pytest.raises(TypeError, match="fused must be None"):
        AsyncEnvCollector([cartpole], fused="yes")
    with pytest.raises(ValueError, match="fused=True needs a torch policy"):
        AsyncEnvCollector([cartpole], async_policy, fused=True)
    with pytest.raises(ValueError, match="fused=True cannot restart"):
        AsyncEnvCollector([cartpole], fused=True, restart=RestartPolicy())
    with pytest.raises(ValueError, match="every env must be a ProcessVectorEnv"):
        async with AsyncEnvCollector([cartpole], frames_per_batch=8, fused=True):
            pass
    _, kind = await collect([cartpole] * 2, None, fused=None, frames_per_batch=8, total_frames=16)
    assert kind == "LoopSteps"
    env = await make([cartpole] * 2)
    _, kind = await collect(env.split(), async_policy_random, fused=None, frames_per_batch=8, total_frames=16)
    assert kind == "LoopSteps"


async def async_policy_random(td):
    td["action"] = torch.zeros(td.batch_size[0], dtype=torch.int64)
    return td


async def test_backpressure_bounds_the_frames_ahead_of_the_consumer(leaks):
    """At most ``(1 + prefetch) * frames_per_batch`` frames are collected or stepping ahead of ``async for``
    (a unit is never split: one unit's width more at most); the driver waits, and goes on when a batch is
    taken."""
    env = await make([cartpole] * 4)
    async with AsyncEnvCollector(env.split(), Argmax(), frames_per_batch=40, prefetch=1, fused=True) as c:
        it = aiter(c)
        seen: list[int] = []

        def filled() -> bool:  # a slow consumer: the driver fills what it may, then waits
            ahead = engine.completed - engine.delivered
            seen.append(ahead + engine.in_flight)
            return ahead >= 40 and engine.in_flight == 0  # nothing stepping: it waits

        with anyio.fail_after(60):
            for _ in range(3):
                await anext(it)
                engine = c._engine
                await wait_until(filled)
                assert 40 <= engine.completed - engine.delivered <= 2 * 40 + 2
        assert max(seen) <= 2 * 40 + 2, seen  # never more collected or stepping ahead


async def test_dict_spaces_and_uint8_pixels_bit_for_bit(anyio_backend, leaks):
    """Dict observations (uint8 pixels, a nested entry) and a Dict action of a Discrete and a Tuple: every
    leaf travels through the slots both ways, and the batches are the engine's."""
    from test_process_vector_env import Echo

    kwargs = {"frames_per_batch": 30, "total_frames": 120, "seed": 1}
    runs = {}
    for fused in (True, False):
        env = await make([Echo] * 4)
        runs[fused] = await collect([lambda e=env: e], None, fused=fused, **kwargs)
    (fused_batches, kind), (engine_batches, _) = runs[True], runs[False]
    assert kind == "FusedSteps"
    assert_same(fused_batches, engine_batches)
    batch = torch.cat(fused_batches)
    assert batch["pixels"].dtype == torch.uint8 and batch["next", "state", "echo"].shape == (120, 3)
    # the env echoes its action: the frames' next observations carry the actions the policy chose
    echo = batch["next", "state", "echo"]
    assert torch.equal(echo[:, 0], batch["action", "move"].float())
    assert torch.equal(echo[:, 2], batch["action", "pair", "1"].float())
