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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--loops",
        default="asyncio,uvloop,trio",
        help="the event loops the async tests run under, comma-separated (default: all three); the nox "
        "sessions that re-run the suite on other versions (minimum_versions, newest_python) take fewer",
    )


def _loop_name(backend: object) -> str | None:
    if isinstance(backend, tuple) and backend and isinstance(backend[0], str):
        options = backend[1] if len(backend) > 1 and isinstance(backend[1], dict) else {}
        return "uvloop" if options.get("use_uvloop") else backend[0]
    return backend if isinstance(backend, str) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--loops``: deselect the async tests of the other loops."""
    loops = {name.strip() for name in config.getoption("--loops").split(",") if name.strip()}
    unknown = loops - {"asyncio", "uvloop", "trio"}
    if unknown:
        choose = "choose from asyncio, uvloop, trio"
        raise pytest.UsageError(f"--loops: unknown loop(s) {sorted(unknown)}; {choose}")
    if loops == {"asyncio", "uvloop", "trio"}:
        return
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = _loop_name(callspec.params.get("anyio_backend")) if callspec is not None else None
        (dropped if name is not None and name not in loops else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(autouse=True)
def _torch_threads():
    """One intra-op thread: the CI machine has 2 cores and tests run env + policy in threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
