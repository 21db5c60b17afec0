"""MultiSyncCollector(cat_results="stack") hands its batches over in place: the workers write their rows of
one shared segment, and the segment is the batch. A lent batch is the consumer's for as long as it keeps
any tensor of it; one kept longer than the segments last is a copy."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiocollect import GymEnv, MultiSyncCollector
from support import assert_clean, segments

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("leaks")]


def cartpole3() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=3)


def _in_shared_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is one of aiocollect's ``/dev/shm`` mappings in this process."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/aiocollect_" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return True
    return False


async def _batches(backend: str, keep: bool, *, batches: int = 8) -> tuple[list, list, list]:
    """``batches`` seeded batches: each one's clone when it arrived, whether it was lent (in shared
    memory), and (``keep``) the batches themselves, kept to the end."""
    clones, lent, kept = [], [], []
    async with MultiSyncCollector(
        [cartpole3] * 2,
        frames_per_batch=48,
        total_frames=48 * batches,
        worker_backend=backend,
        seed=3,
    ) as c:
        async for batch in c:
            clones.append(batch.clone())
            lent.append(_in_shared_memory(batch["observation"]))
            if keep:
                kept.append(batch)
    return clones, lent, kept


@pytest.mark.parametrize("backend", ["serial", "process"])
async def test_a_dropped_batch_is_lent_and_a_kept_one_is_never_overwritten(backend):
    with anyio.fail_after(60):
        dropped, dropped_lent, _ = await _batches(backend, keep=False)
        clones, lent, kept = await _batches(backend, keep=True)
    # the consumer that lets go of each batch gets every one in place
    assert dropped_lent == [True] * 8
    # the one that keeps them all: in place until the segments run out (a free one is always left for
    # the workers), then copies
    assert lent[0] and not lent[-1]
    assert lent == sorted(lent, reverse=True)
    for batch, clone in zip(kept, clones, strict=True):
        assert (batch == clone).all()  # nothing the workers wrote later reached a kept batch
    # the same seeded batches either way, lent or copied
    for a, b in zip(dropped, clones, strict=True):
        assert (a == b).all()
    assert all(b.names == [None, None, "time"] for b in kept)
    del kept
    assert_clean()


async def test_a_batch_kept_past_close_stays_readable_and_holds_no_segment():
    with anyio.fail_after(60):
        clones, lent, kept = await _batches("process", keep=True, batches=2)
    assert lent == [True, True]
    assert segments() == []  # unlinked at close: the kept batches hold only their mappings
    for batch, clone in zip(kept, clones, strict=True):
        assert (batch == clone).all()
    kept[0]["observation"].add_(1)  # still the consumer's own memory
    assert_clean()  # no segment, fd or process left, whatever the batches keep


async def test_without_room_for_a_second_segment_every_batch_is_copied(monkeypatch):
    # what a container's small /dev/shm gives (Docker's 64 MB): one segment only, so it is never lent
    monkeypatch.setattr("aiocollect._transport._stacked._room_for", lambda nbytes: False)
    with anyio.fail_after(60):
        clones, lent, kept = await _batches("process", keep=True, batches=4)
    assert lent == [False] * 4
    for batch, clone in zip(kept, clones, strict=True):
        assert (batch == clone).all()


async def test_preempted_rows_are_masked_in_a_lent_batch():
    with anyio.fail_after(60):
        async with MultiSyncCollector(
            [cartpole3] * 2,
            frames_per_batch=48,
            total_frames=48 * 3,
            worker_backend="serial",
            preemptive_threshold=1.0,
        ) as c:
            async for batch in c:
                assert _in_shared_memory(batch["observation"])
                mask = batch["collector", "mask"]
                assert mask.shape == (2, 3, 8)
                assert bool(mask.all())  # threshold 1.0: every worker finished
                assert (batch["collector", "traj_ids"] != -1).all()
