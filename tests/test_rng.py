"""Seeded in-process collectors share torch's global RNG (issue 18): each swaps its own state in around a
batch under one process-wide lock, so several running at once give the batches each gives alone, and the
caller's RNG state is left as it was."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch
from tensordict.nn import ProbabilisticTensorDictModule, TensorDictModule, TensorDictSequential
from torch.distributions import Categorical

from aiocollect import Collector, GymEnv
from aiocollect._core._rng import TORCH_RNG_LOCK, RolloutRNG, forked_rng

pytestmark = pytest.mark.anyio


def sampling_policy() -> TensorDictSequential:
    torch.manual_seed(0)
    return TensorDictSequential(
        TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=Categorical
        ),
    )


def vector_cartpole() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=4)


async def actions(seed: int, policy: TensorDictSequential, into: list[torch.Tensor]) -> None:
    async with Collector(vector_cartpole, policy, frames_per_batch=400, total_frames=2000, seed=seed) as c:
        async for batch in c:
            into.append(batch["action"].clone())
            await anyio.lowlevel.checkpoint()


async def test_concurrent_seeded_collectors_are_reproducible() -> None:
    policy = sampling_policy()  # built first: it seeds torch's RNG
    alone: dict[int, list[torch.Tensor]] = {1: [], 2: []}
    with anyio.fail_after(120):
        for seed, out in alone.items():
            await actions(seed, policy, out)
        caller = torch.get_rng_state()
        together: list[list[torch.Tensor]] = [[], [], []]
        async with anyio.create_task_group() as tg:
            for seed, out in zip((1, 2, 1), together, strict=True):  # all three at once, two with seed 1
                tg.start_soon(actions, seed, policy, out)
    assert torch.equal(torch.get_rng_state(), caller)
    for seed, out in zip((1, 2, 1), together, strict=True):
        assert len(out) == len(alone[seed]) == 5
        assert all(torch.equal(a, b) for a, b in zip(out, alone[seed], strict=True))


def test_rollout_rngs_in_threads_keep_their_own_streams() -> None:
    """The swap itself, from many threads at once: each RNG's draws are those it makes alone."""

    def draws(rng: RolloutRNG, n: int) -> list[torch.Tensor]:
        # a draw long enough for the interpreter to switch threads in the middle of it
        return [rng.run(lambda: torch.stack([torch.rand(8) for _ in range(50)])) for _ in range(n)]

    expected = {seed: draws(RolloutRNG(seed), 100) for seed in range(4)}
    got: dict[int, list[torch.Tensor]] = {}
    caller = torch.get_rng_state()

    def worker(seed: int) -> None:
        got[seed] = draws(RolloutRNG(seed), 100)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.equal(torch.get_rng_state(), caller)
    for seed in range(4):
        assert all(torch.equal(a, b) for a, b in zip(got[seed], expected[seed], strict=True))


def test_the_lock_is_held_while_a_seeded_batch_runs() -> None:
    rng = RolloutRNG(0)
    held = rng.run(lambda: not TORCH_RNG_LOCK.acquire(blocking=False) or TORCH_RNG_LOCK.release())
    assert held is not False  # acquired re-entrantly by the same thread: an RLock
    other: list[bool] = []

    def probe() -> None:
        other.append(TORCH_RNG_LOCK.acquire(blocking=False))

    rng.run(lambda: (thread := threading.Thread(target=probe), thread.start(), thread.join()))
    assert other == [False]


def test_an_unseeded_rollout_does_not_draw_from_a_seeded_one() -> None:
    """An unseeded batch draws from torch's global state: never while a seeded batch in another thread
    has its own state swapped in (its draws would advance that state: the seeded run would differ)."""

    def draws(rng: RolloutRNG, n: int) -> list[torch.Tensor]:
        return [rng.run(lambda: torch.stack([torch.rand(8) for _ in range(50)])) for _ in range(n)]

    expected = draws(RolloutRNG(7), 100)
    done = threading.Event()

    def unseeded() -> None:
        rng = RolloutRNG()
        while not done.is_set():
            rng.run(lambda: [torch.rand(8) for _ in range(50)])

    threads = [threading.Thread(target=unseeded) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        got = draws(RolloutRNG(7), 100)
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_shared_holder_may_fork_and_two_may_fork_at_once() -> None:
    """A dry call forks the RNG (exclusive) inside an unseeded batch (shared): two threads doing so at
    once do not wait for each other."""
    barrier = threading.Barrier(2, timeout=10)
    results: list[bool] = []

    def batch() -> None:
        with TORCH_RNG_LOCK.shared():
            barrier.wait()  # both hold it shared
            with TORCH_RNG_LOCK:
                results.append(TORCH_RNG_LOCK.acquire(blocking=False))
                TORCH_RNG_LOCK.release()

    threads = [threading.Thread(target=batch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(thread.is_alive() for thread in threads)
    assert results == [True, True]
    assert TORCH_RNG_LOCK.acquire(blocking=False)  # free again
    TORCH_RNG_LOCK.release()


def test_a_dry_call_waits_for_seeded_batches_only() -> None:
    """``forked_rng`` (a collector's dry policy call, made where it is built: maybe on the event loop)
    does not wait for an unseeded batch running in another thread, and does wait for a seeded one."""
    for seeded in (False, True):
        inside, leave, forked = threading.Event(), threading.Event(), threading.Event()

        def batch(
            seeded: bool = seeded, inside: threading.Event = inside, leave: threading.Event = leave
        ) -> None:
            RolloutRNG(0 if seeded else None).run(lambda: (inside.set(), leave.wait(10)))

        def dry(forked: threading.Event = forked) -> None:
            with forked_rng():
                forked.set()

        runner = threading.Thread(target=batch)
        runner.start()
        assert inside.wait(10)
        builder = threading.Thread(target=dry)
        builder.start()
        assert forked.wait(0.5) is not seeded  # seeded: it waits for the batch
        leave.set()
        runner.join(10)
        builder.join(10)
        assert forked.is_set()
