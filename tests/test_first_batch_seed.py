"""A ``set_seed`` (or ``reset``) made before the first batch is asked for applies to every frame delivered,
the first batch included (issue 33): the multi-process collectors' workers start collecting at the first
batch asked for, not at ``async with``, as TorchRL's collectors, which collect nothing before the first
iteration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDictBase

from aiocollect import MultiAsyncCollector, MultiSyncCollector, ProcessCollector
from support import ListBuffer, cartpole, cartpole4, take_until

pytestmark = pytest.mark.anyio

BATCHES = 3


@pytest.fixture(params=["serial", "process"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def per_worker(batches: list[TensorDictBase]) -> dict[int, list[TensorDictBase]]:
    """The batches of each worker, in the order that worker delivered them (all under 0 where a batch
    holds every worker's rollout)."""
    out: dict[int, list[TensorDictBase]] = {}
    for b in batches:
        worker_id = b.get(("collector", "worker_id"), None)
        out.setdefault(0 if worker_id is None else int(worker_id.flatten()[0]), []).append(b)
    return out


def assert_same(a: list[TensorDictBase], b: list[TensorDictBase], *, skip: set[Any] = frozenset()) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        keys = set(x.keys(include_nested=True, leaves_only=True))
        assert keys == set(y.keys(include_nested=True, leaves_only=True))
        for key in keys - skip:
            assert torch.equal(x.get(key), y.get(key)), key


async def first_batches(
    make: Callable[..., Any], seed_late: int | None, *, workers: int, **kwargs: Any
) -> dict[int, list[TensorDictBase]]:
    """``BATCHES`` batches of each worker of ``make(...)``: seeded at construction (``seed_late=None``,
    kwargs carry ``seed``) or by ``set_seed(seed_late)`` right after ``async with``."""
    with anyio.fail_after(60):
        async with make(**kwargs) as c:
            if seed_late is not None:
                await c.set_seed(seed_late)
            out = await take_until(c, each=BATCHES, members=workers)
    return {i: v[:BATCHES] for i, v in per_worker(out).items()}


def multi_async(n: int, backend: str) -> Callable[..., Any]:
    def make(**kw: Any) -> MultiAsyncCollector:
        return MultiAsyncCollector([cartpole4] * n, frames_per_batch=16, worker_backend=backend, **kw)

    return make


async def test_multi_async_one_worker_seeds_the_first_batch(anyio_backend, backend):
    seeded = await first_batches(multi_async(1, backend), None, workers=1, seed=7)
    late = await first_batches(multi_async(1, backend), 7, workers=1)
    # seeded at construction, then reseeded: the second seed holds (trajectory ids: each seed resets)
    reseeded = await first_batches(multi_async(1, backend), 7, workers=1, seed=3)
    other = await first_batches(multi_async(1, backend), 8, workers=1)
    assert_same(seeded[0], late[0])
    assert_same(seeded[0], reseeded[0], skip={("collector", "traj_ids")})
    assert not torch.equal(other[0][0]["observation"], seeded[0][0]["observation"])


async def test_multi_async_workers_each_seed_their_first_batch(anyio_backend, backend):
    seeded = await first_batches(multi_async(2, backend), None, workers=2, seed=7)
    late = await first_batches(multi_async(2, backend), 7, workers=2)
    assert seeded.keys() == late.keys() == {0, 1}
    for i in (0, 1):
        assert_same(seeded[i], late[i])


async def test_process_collector_seeds_the_first_batch(anyio_backend, backend):
    def make(**kw: Any) -> ProcessCollector:
        return ProcessCollector(cartpole, frames_per_batch=16, worker_backend=backend, **kw)

    seeded = await first_batches(make, None, workers=1, seed=11)
    late = await first_batches(make, 11, workers=1)
    assert_same(seeded[0], late[0])


async def test_multi_sync_seeds_the_first_batch(anyio_backend):
    def make(**kw: Any) -> MultiSyncCollector:
        return MultiSyncCollector([cartpole4] * 2, frames_per_batch=32, worker_backend="serial", **kw)

    seeded = await first_batches(make, None, workers=1, seed=5)
    late = await first_batches(make, 5, workers=1)
    assert_same(seeded[0], late[0])  # each batch holds both workers' rollouts


async def test_fill_and_start_after_set_seed_are_seeded(anyio_backend, backend):
    """``fill()`` and ``start()`` ask for batches as ``async for`` does: the first one waits as well."""
    with anyio.fail_after(60):
        async with multi_async(1, backend)(seed=2) as c:
            expected = []
            async for batch in c:
                expected.append(batch)
                if len(expected) == BATCHES:
                    break
        for run in ("fill", "start"):
            rb = ListBuffer()
            async with MultiAsyncCollector(
                [cartpole4], frames_per_batch=16, worker_backend=backend, replay_buffer=rb
            ) as c:
                await c.set_seed(2)
                if run == "fill":
                    async for _ in c.fill():
                        if len(rb.batches) == BATCHES:
                            break
                else:
                    await c.start()
                    await rb.wait_for(BATCHES)
                    await c.aclose()
            assert_same(expected, rb.batches[:BATCHES])


async def test_reset_before_the_first_batch_discards_nothing(anyio_backend, backend):
    """Nothing is collected before the first batch is asked for: a reset and a reseed then drop no frame,
    and the first batch comes after both."""
    with anyio.fail_after(60):
        async with multi_async(2, backend)() as c:
            await c.reset()
            await c.set_seed(1)
            first = await c.__anext__()
            assert c.statistics().frames_discarded == 0
    ids = first["collector", "traj_ids"][:, 0]
    worker = int(first["collector", "worker_id"].flatten()[0])
    # worker i's ids are i, i + 2, ...; each reset of its four envs takes the next four: the first batch
    # runs on the ones of the third reset (after the one at start, reset() and set_seed)
    assert sorted(ids.tolist()) == [worker + 2 * k for k in range(8, 12)]


async def test_compat_set_seed_before_the_loop_seeds_the_first_batch(anyio_backend):
    """TorchRL's order, through ``aiocollect.compat``: ``set_seed`` first (it starts the workers), then
    iterate: two such runs give the same batches from the first one on."""
    from aiocollect import compat

    runs = []
    for _ in range(2):
        collector = compat.MultiaSyncDataCollector(
            [cartpole4] * 2, frames_per_batch=16, total_frames=96, worker_backend="serial"
        )
        with anyio.fail_after(60):
            await collector.set_seed(4)
            runs.append(per_worker([b async for b in collector]))
    for i in (0, 1):
        n = min(len(runs[0][i]), len(runs[1][i]))
        assert n >= 1
        assert_same(runs[0][i][:n], runs[1][i][:n])
