"""Shared fixtures: every async test runs under asyncio, asyncio+uvloop and trio (anyio's plugin).

The shared helpers (policies, env factories, test envs, the leak check) live in ``support.py``; the
fixtures imported from it here (``leaks``, ``warm_forkserver``, ``support_by_value``) serve every test.
"""

from __future__ import annotations

import pytest
import torch

from support import leaks, support_by_value, warm_forkserver

__all__ = ["anyio_backend", "leaks", "support_by_value", "warm_forkserver"]

BACKENDS = [
    pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="asyncio+uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param


@pytest.fixture(autouse=True)
def _torch_threads():
    """One intra-op thread: the CI machine has 2 cores and tests run env + policy in threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
