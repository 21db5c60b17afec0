"""Shared fixtures, and the event loops the async tests run under (anyio's plugin).

By default every async test runs under asyncio, asyncio+uvloop and trio. ``--loops`` keeps some of them;
``--loop-tier=N`` runs each async test under one loop only, chosen from a stable hash of its node id (the
loop's own id left out) plus ``N``, so that the three runs of the suite in CI (the README's test command
with ``--loop-tier=0``, ``nox -s minimum_versions`` with 1, ``nox -s newest_python`` with 2) between them
run each test under every loop. The tests of loop-specific behaviour (marked ``all_loops``: lifecycle,
cancellation, signals, servers, waiters) keep every loop in tier 0.

The shared helpers (policies, env factories, test envs, the leak check) live in ``support.py``; the
fixtures imported from it here (``leaks``, ``warm_forkserver``, ``support_by_value``) serve every test.
"""

from __future__ import annotations

import re
import zlib
from collections import defaultdict

import pytest
import torch

from support import Timing, leaks, support_by_value, timing, warm_forkserver

__all__ = ["anyio_backend", "leaks", "support_by_value", "timing", "warm_forkserver"]

BACKENDS = [
    pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="asyncio+uvloop"),
    pytest.param(("trio", {}), id="trio"),
]
#: the loops by name, in the order a tier's choice counts them
LOOPS = ("asyncio", "uvloop", "trio")
#: the ids a loop takes in a test's id (conftest's own, and the plain backend names other modules use)
LOOP_IDS = {"asyncio", "asyncio+uvloop", "uvloop", "trio"}
#: the id pytest gives a backend parametrized without one
_UNNAMED = re.compile(r"anyio_backend\d+")


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--loops",
        default="asyncio,uvloop,trio",
        help="the event loops the async tests run under, comma-separated (default: all three)",
    )
    parser.addoption(
        "--loop-tier",
        type=int,
        default=None,
        metavar="N",
        help="run each async test under one of its loops, chosen from a stable hash of its id plus N "
        "(CI's three runs of the suite take 0, 1 and 2: between them every test meets every loop); in "
        "tier 0 the tests marked all_loops keep every loop. Default: every loop",
    )


def pytest_configure(config: pytest.Config) -> None:
    tier = config.getoption("--loop-tier")
    if tier is not None and tier < 0:
        raise pytest.UsageError(f"--loop-tier must be 0 or more (CI's runs take 0, 1 and 2), got {tier}")


def _loop_name(backend: object) -> str | None:
    if isinstance(backend, tuple) and backend and isinstance(backend[0], str):
        options = backend[1] if len(backend) > 1 and isinstance(backend[1], dict) else {}
        return "uvloop" if options.get("use_uvloop") else backend[0]
    return backend if isinstance(backend, str) else None


def _item_loop(item: pytest.Item) -> str | None:
    """The loop an async test instance runs under (``None``: not an async test)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "anyio_backend" not in callspec.params:
        return None
    return _loop_name(callspec.params["anyio_backend"])


def rotation_key(nodeid: str) -> str:
    """``nodeid`` without the ids of its loop: the same for a test's instances under every loop.

    >>> rotation_key("tests/test_a.py::test_b[asyncio+uvloop-sync]")
    'tests/test_a.py::test_b[sync]'
    >>> rotation_key("tests/test_a.py::test_b[trio-sync]")
    'tests/test_a.py::test_b[sync]'
    """
    name, bracket, ids = nodeid.partition("[")
    if not bracket:
        return name
    kept = [part for part in ids[:-1].split("-") if part not in LOOP_IDS and not _UNNAMED.fullmatch(part)]
    return f"{name}[{'-'.join(kept)}]"


def tier_loop(key: str, loops: list[str], tier: int) -> str:
    """The one loop of ``loops`` (those a test has) that tier ``tier`` runs the test ``key`` under."""
    ordered = sorted(loops, key=lambda loop: LOOPS.index(loop) if loop in LOOPS else len(LOOPS))
    return ordered[(zlib.crc32(key.encode()) + tier) % len(ordered)]


def _deselect(config: pytest.Config, items: list[pytest.Item], keep: set[int]) -> None:
    dropped = [item for i, item in enumerate(items) if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for i, item in enumerate(items) if i in keep]


@pytest.hookimpl(trylast=True)  # after -m and -k: a tier chooses among the instances they leave
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--loops``: deselect the async tests of the other loops; ``--loop-tier``: then keep one loop of
    each async test (every loop of the ``all_loops`` ones in tier 0)."""
    loops = {name.strip() for name in config.getoption("--loops").split(",") if name.strip()}
    unknown = loops - set(LOOPS)
    if unknown:
        choose = "choose from asyncio, uvloop, trio"
        raise pytest.UsageError(f"--loops: unknown loop(s) {sorted(unknown)}; {choose}")
    _deselect(config, items, {i for i, item in enumerate(items) if _item_loop(item) in loops | {None}})
    tier = config.getoption("--loop-tier")
    if tier is None:
        return
    groups: dict[str, list[int]] = defaultdict(list)
    keep = set()
    for i, item in enumerate(items):
        if _item_loop(item) is None or (tier == 0 and item.get_closest_marker("all_loops")):
            keep.add(i)
        else:
            groups[rotation_key(item.nodeid)].append(i)
    for key, members in groups.items():
        chosen = tier_loop(key, list({_item_loop(items[i]) for i in members}), tier)
        keep.update(i for i in members if _item_loop(items[i]) == chosen)
    _deselect(config, items, keep)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The speed figures of the ``timed`` tests that ran (``nox -s timing``), slowest first."""
    if Timing.figures:
        terminalreporter.section("speed figures (seconds)")
        for name, seconds in sorted(Timing.figures.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:9.3f}  {name}")


@pytest.fixture(autouse=True)
def _torch_threads():
    """One intra-op thread: the CI machine has 2 cores and tests run env + policy in threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
