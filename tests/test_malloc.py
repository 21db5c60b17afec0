"""A worker process keeps the memory it frees for its next step: a policy's large temporaries are not
faulted in again at every step (glibc), and a user's own ``MALLOC_*_`` settings win."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from aiocollect import MultiSyncCollector
from support import freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

#: a fresh interpreter: steps that allocate and free three 8 MiB blocks, then the faults of ten more
_PROBE = textwrap.dedent(
    """
    import resource, sys
    from aiocollect._core._malloc import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "keep" else None
    def step():
        blocks = [bytearray(8 << 20) for _ in range(3)]
        del blocks
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def probe(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


def test_kept_memory_is_not_faulted_in_again() -> None:
    assert probe("keep") == ("True", 0)
    _, faults = probe("default")
    assert faults > 10 * 3 * 1000  # glibc's defaults give every 8 MiB block back: ~2,000 pages each


def test_users_own_settings_win() -> None:
    applied, faults = probe("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert applied == "False" and faults > 10 * 3 * 1000
    applied, _ = probe("keep", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert applied == "False"


@pytest.mark.anyio
async def test_a_worker_process_keeps_freed_memory() -> None:
    async with MultiSyncCollector([freed_memory, freed_memory], frames_per_batch=16, seed=0) as collector:
        batch = await anext(aiter(collector))
    faults = batch["next", "observation"].reshape(2, -1)
    # each worker's first step may still fault its heap in; none after it
    assert torch.count_nonzero(faults[:, 1:]).item() == 0, faults
