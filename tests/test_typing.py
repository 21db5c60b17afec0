"""The public API under ``mypy --strict``: the examples type-check, and a user's script
(tests/typing_user.py) sees ``async with Collector(...) as c`` as the collector's class and
``async for batch in c`` as ``TensorDictBase`` batches, for every public collector.

mypy keeps its cache in ``.mypy_cache/strict`` at the repository root: the first run takes ~30 s,
later runs ~2 s. aiocollect itself is type-checked (non-strict) by ``mypy src``; here its errors are
silenced (``--follow-imports=silent``) and only its types are read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aiocollect

ROOT = Path(__file__).resolve().parents[1]
USER_SCRIPT = ROOT / "tests" / "typing_user.py"
TYPO_SCRIPT = ROOT / "tests" / "typing_typo.py"
COLLECTORS = [
    "Collector",
    "MultiSyncCollector",
    "MultiAsyncCollector",
    "ProcessCollector",
    "DistributedCollector",
    "DistributedSyncCollector",
    "RPCCollector",
    "RayCollector",
]
#: the collectors whose misspelt keyword tests/typing_typo.py writes: every public one
TYPO_COLLECTORS = [*COLLECTORS, "AsyncEnvCollector", "MultiAsyncEnvCollector"]

pytest.importorskip("mypy", reason="the typing test needs mypy (pip install 'aiocollect[test]')")


def run_mypy(*paths: Path) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` on ``paths``; aiocollect is read from this checkout's ``src``."""
    env = {**os.environ, "MYPYPATH": str(ROOT / "src")}
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        # torch's own functions are not annotated (Tensor.backward, distributions): calling them is fine
        "--untyped-calls-exclude=torch",
        "--follow-imports=silent",
        "--cache-dir",
        str(ROOT / ".mypy_cache" / "strict"),
        "--no-error-summary",
        "--show-error-codes",
        *map(str, paths),
    ]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def qualified(name: str) -> str:
    cls = getattr(aiocollect, name)
    return f"{cls.__module__}.{cls.__qualname__}"


def test_examples_and_a_user_script_pass_mypy_strict() -> None:
    result = run_mypy(ROOT / "examples", USER_SCRIPT)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert not errors, "\n".join(errors)
    assert result.returncode == 0, result.stdout + result.stderr
    revealed = re.findall(r'typing_user\.py:\d+: note: Revealed type is "([^"]+)"', result.stdout)
    # per collector: `async with ... as c` then `async for batch in c`; then `async for frames in c.fill()`
    pairs = list(zip(revealed[0:-1:2], revealed[1:-1:2], strict=True))
    assert pairs == [(qualified(name), "tensordict.base.TensorDictBase") for name in COLLECTORS]
    assert revealed[-1] == "int"


def test_a_misspelt_keyword_is_a_type_error_and_a_did_you_mean_at_run_time() -> None:
    """Each public collector's keyword list reaches mypy (``**kwargs: Unpack[...]``): a misspelt keyword is
    an error on its line; at run time the same call raises ``TypeError`` with the keyword meant."""
    import importlib.util

    result = run_mypy(TYPO_SCRIPT)
    flagged = re.findall(
        r'typing_typo\.py:\d+: error: Unexpected keyword argument "total_frame" for "(\w+)"', result.stdout
    )
    assert flagged == TYPO_COLLECTORS, result.stdout
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == len(TYPO_COLLECTORS), "\n".join(errors)
    spec = importlib.util.spec_from_file_location("typing_typo", TYPO_SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for call, name in zip(script.CALLS, TYPO_COLLECTORS, strict=True):
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"{name}() got an unexpected keyword argument 'total_frame'"), message
        assert "did you mean 'total_frames'?" in message, message
