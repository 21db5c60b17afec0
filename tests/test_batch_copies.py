"""The trainer's copy of a batch out of its workers' shared-memory slots (``_multi/_copies.py``, issue 42):
the batches equal those ``TensorDict.clone`` / ``torch.stack`` / ``torch.cat`` made (the path it replaced,
run here as the reference), bit for bit, and a delivered batch is the consumer's: never written again, its
memory reused only once it is dropped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from aiocollect import MultiAsyncCollector, MultiSyncCollector
from aiocollect._multi import _copies
from aiocollect._rollout._storage import POOL_MIN_BYTES
from aiocollect._transport._flat import layout_of
from aiocollect._transport._shm import SharedBlock
from support import cartpole, cartpole4, take

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("leaks")]


def batch(seed: int, pixels: tuple[int, ...], lead: tuple[int, ...] = (2, 8)) -> TensorDict:
    """A batch with the kinds of entries a rollout writes: frames, flags, ids, floats, bfloat16, an empty
    entry, nested keys; ``lead``: its batch dims (time last)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "observation": torch.randint(0, 255, (*lead, *pixels), generator=g, dtype=torch.uint8),
            ("next", "observation"): torch.randint(0, 255, (*lead, *pixels), generator=g, dtype=torch.uint8),
            "action": torch.randint(0, 6, lead, generator=g),
            "logits": torch.randn(*lead, 6, generator=g),
            "half": torch.randn(*lead, 3, generator=g).to(torch.bfloat16),
            "nothing": torch.zeros(*lead, 0),
            ("next", "reward"): torch.randn(*lead, 1, generator=g),
            ("next", "done"): torch.rand(*lead, 1, generator=g) < 0.3,
            ("collector", "traj_ids"): torch.randint(0, 100, lead, generator=g),
        },
        batch_size=lead,
    )


def slots(tds: Sequence[TensorDict]) -> list[SharedBlock]:
    """One shared-memory block per batch, written as a worker writes its slot."""
    blocks = [SharedBlock(layout_of(td)) for td in tds]
    for block, td in zip(blocks, tds, strict=True):
        block.td.update_(td)
    return blocks


def close(blocks: Sequence[SharedBlock]) -> None:
    for block in blocks:
        block.close()
        block.unlink()


def timed(td: TensorDictBase) -> TensorDictBase:
    """``td`` with its last dim named ``"time"``, as the collectors deliver batches."""
    td.names = [None] * (td.ndim - 1) + ["time"]
    return td


def assert_identical(a: TensorDictBase, b: TensorDictBase) -> None:
    """Same batch size, names, keys, shapes, dtypes, bytes; every tensor contiguous and owning memory
    apart from the other's."""
    assert a.batch_size == b.batch_size
    assert a.names == b.names
    keys = sorted(a.keys(include_nested=True, leaves_only=True), key=str)
    assert keys == sorted(b.keys(include_nested=True, leaves_only=True), key=str)
    for key in keys:
        x, y = a.get(key), b.get(key)
        assert (x.shape, x.dtype) == (y.shape, y.dtype), key
        assert x.is_contiguous(), key
        assert torch.equal(x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y)
        assert x.numel() == 0 or x.data_ptr() != y.data_ptr(), key


@pytest.mark.parametrize("pixels", [(4, 4, 3), (210, 160, 3)], ids=["small", "pooled"])
async def test_copies_are_those_of_clone_stack_and_cat(pixels: tuple[int, ...]) -> None:
    tds = [batch(0, pixels), batch(1, pixels)]
    assert (tds[0].bytes() >= POOL_MIN_BYTES) == (pixels == (210, 160, 3))
    blocks = slots(tds)
    try:
        copies = _copies.BatchCopies()
        views = [b.td for b in blocks]
        assert_identical(copies.one(blocks[1]), timed(views[1].clone()))
        assert_identical(copies.stack(blocks), timed(torch.stack(views, 0)))
        for dim in (0, -1):
            assert_identical(copies.cat(views, dim), timed(torch.cat(views, dim)))
        cut = [views[0][..., :3], views[1][..., :5]]  # preempted workers' shorter rollouts, along time
        assert_identical(copies.cat(cut, -1), timed(torch.cat(cut, -1)))
    finally:
        close(blocks)


async def test_a_batch_is_the_consumers_and_its_memory_is_reused_once_dropped() -> None:
    blocks = slots([batch(0, (210, 160, 3))])
    try:
        copies = _copies.BatchCopies()
        first = copies.one(blocks[0])
        kept = first.clone()
        blocks[0].td.update_(batch(1, (210, 160, 3)))  # the worker collects into its slot again
        second = copies.one(blocks[0])
        assert_identical(first, kept)  # the kept batch was not written
        assert not torch.equal(second["observation"], first["observation"])
        ptr = first["observation"].data_ptr()
        observation = first["observation"]
        del first, second
        # one entry of the first batch still held: its memory is not reused
        assert copies.one(blocks[0])["observation"].data_ptr() != ptr
        del observation
        reused = [copies.one(blocks[0]) for _ in range(2)]  # once dropped, it is
        assert ptr in {b["observation"].data_ptr() for b in reused}
    finally:
        close(blocks)


class Reference:
    """The delivery's copies before ``BatchCopies``: ``clone``, ``torch.stack``, ``torch.cat``."""

    def one(self, block: SharedBlock) -> TensorDictBase:
        return timed(block.td.clone())

    def stack(self, blocks: Sequence[SharedBlock]) -> TensorDictBase:
        return timed(torch.stack([b.td for b in blocks], 0))  # type: ignore[arg-type]

    def cat(self, parts: Sequence[TensorDictBase], dim: int) -> TensorDictBase:
        return timed(torch.cat(list(parts), dim))  # type: ignore[arg-type]


async def collect(kind: str, cat_results: Any, reference: bool, monkeypatch: Any) -> list[TensorDictBase]:
    """Seeded batches of a 2-worker collector (episodes end inside them), all kept to the end."""
    with monkeypatch.context() as patch:
        if reference:
            patch.setattr(_copies, "BatchCopies", Reference)
        if kind == "sync":  # equal worker batches: any cat_results
            collector: Any = MultiSyncCollector(
                [cartpole4, cartpole4], frames_per_batch=96, total_frames=960, seed=5, cat_results=cat_results
            )
        elif kind == "sync-single":  # single envs, batches of two lengths: joined along time
            collector = MultiSyncCollector(
                [cartpole, cartpole], frames_per_batch=[32, 64], total_frames=960, seed=5, cat_results=-1
            )
        else:
            collector = MultiAsyncCollector(
                [cartpole, cartpole4], frames_per_batch=48, total_frames=960, seed=5
            )
        async with collector:
            batches = await take(collector, seconds=60)
    return batches


def by_worker(batches: list[TensorDictBase]) -> dict[int, list[TensorDictBase]]:
    """Each worker's batches in order (the workers' interleaving, and so how many batches each delivers
    before the budget is reached, is timing's)."""
    out: dict[int, list[TensorDictBase]] = {}
    for b in batches:
        out.setdefault(int(b["collector", "worker_id"].flatten()[0]), []).append(b)
    return out


@pytest.mark.parametrize(
    ("kind", "cat_results"),
    [("sync", "stack"), ("sync", 0), ("sync", -1), ("sync-single", -1), ("async", None)],
)
async def test_delivered_batches_are_those_of_the_reference_copies(
    kind: str, cat_results: Any, monkeypatch: Any
) -> None:
    ours = await collect(kind, cat_results, False, monkeypatch)
    theirs = await collect(kind, cat_results, True, monkeypatch)
    assert sum(int(b["next", "done"].sum()) for b in ours) > 0  # episodes ended inside the batches
    if kind == "async":
        mine, reference = by_worker(ours), by_worker(theirs)
        assert sorted(mine) == sorted(reference) == [0, 1]
        pairs = [p for w in mine for p in zip(mine[w], reference[w], strict=False)]
        assert len(pairs) >= 10
    else:
        assert len(ours) == len(theirs) >= 10
        pairs = list(zip(ours, theirs, strict=True))
    for a, b in pairs:
        assert_identical(a, b)
