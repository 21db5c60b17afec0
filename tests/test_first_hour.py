"""The mistakes new users make in their first hour, each answered by one clear message that names the
user's line and the fix (issue 25)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import gymnasium
import pytest
import torch

import aiocollect
from aiocollect import (
    AsyncEnvCollector,
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
    ThreadedAsyncEnv,
)

pytestmark = pytest.mark.anyio


def make_env() -> GymEnv:
    return GymEnv("CartPole-v1")


def make_async_env() -> ThreadedAsyncEnv:
    return ThreadedAsyncEnv(gymnasium.make("CartPole-v1"))


# the public collectors with their required arguments (a typo must be reported before anything starts)
REQUIRED = {
    "Collector": (Collector, (make_env, None), {"frames_per_batch": 10}),
    "MultiSyncCollector": (MultiSyncCollector, ([make_env] * 2, None), {"frames_per_batch": 10}),
    "MultiAsyncCollector": (MultiAsyncCollector, ([make_env] * 2, None), {"frames_per_batch": 10}),
    "AsyncEnvCollector": (AsyncEnvCollector, ([make_async_env] * 2, None), {"frames_per_batch": 10}),
    "MultiAsyncEnvCollector": (
        MultiAsyncEnvCollector,
        ([[make_async_env]] * 2, None),
        {"frames_per_batch": 10},
    ),
    "ProcessCollector": (aiocollect.ProcessCollector, (make_env, None), {"frames_per_batch": 10}),
    "DistributedCollector": (
        aiocollect.DistributedCollector,
        (make_env, None),
        {"frames_per_batch": 10, "num_collectors": 1},
    ),
    "DistributedSyncCollector": (
        aiocollect.DistributedSyncCollector,
        (make_env, None),
        {"frames_per_batch": 10, "num_collectors": 1},
    ),
    "RPCCollector": (
        aiocollect.RPCCollector,
        (make_env, None),
        {"frames_per_batch": 10, "num_collectors": 1},
    ),
    "RayCollector": (
        aiocollect.RayCollector,
        (make_env, None),
        {"frames_per_batch": 10, "num_collectors": 1},
    ),
}


@pytest.mark.parametrize("name", list(REQUIRED))
def test_a_misspelt_keyword_names_the_users_class_and_the_closest_keyword(name: str) -> None:
    cls, args, kwargs = REQUIRED[name]
    with pytest.raises(TypeError) as info:
        cls(*args, **kwargs, total_frame=100)
    message = str(info.value)
    assert message.startswith(f"{name}() got an unexpected keyword argument 'total_frame'"), message
    assert "did you mean 'total_frames'?" in message, message


@pytest.mark.parametrize("name", list(REQUIRED))
def test_the_constructors_show_their_keywords(name: str) -> None:
    """help() and IDEs show the keywords, not **kwargs."""
    import inspect

    cls = REQUIRED[name][0]
    params = inspect.signature(cls).parameters
    assert "frames_per_batch" in params and "total_frames" in params, list(params)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), list(params)


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_torchrls_spellings_point_to_ours_and_to_compat(cls: type) -> None:
    with pytest.raises(TypeError) as info:
        cls(create_env_fn=make_env, policy=None, num_workers=2, frames_per_batch=10)
    message = str(info.value)
    assert f"{cls.__name__}() got an unexpected keyword argument 'create_env_fn'" in message, message
    assert "create_env_fns=[make_env] * num_workers" in message, message
    assert "aiocollect.compat" in message, message
    with pytest.raises(TypeError, match=r"num_workers=.*create_env_fns=\[make_env\] \* num_workers"):
        cls([make_env], None, num_workers=2, frames_per_batch=10)


def test_log_metrics_takes_a_loss_that_requires_grad_without_a_warning() -> None:
    """The docs say .item() is not needed: a tensor that requires grad must not warn (nor fail under
    -W error)."""
    collector = Collector(make_env, None, frames_per_batch=10, total_frames=10)
    loss = (torch.ones(3, requires_grad=True) * 2).mean()
    stream = collector.events()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collector.log_metrics({"loss": loss, "kl": torch.tensor(0.5), "lr": 1e-3})
    event = stream.receive_nowait()
    assert event is not None and event.metrics == {"loss": 2.0, "kl": 0.5, "lr": 1e-3}, event
    stream.close()


def test_a_warning_about_the_users_arguments_points_at_the_users_line() -> None:
    with pytest.warns(UserWarning, match="total_frames=1000 is not a multiple") as caught:
        Collector(make_env, None, frames_per_batch=300, total_frames=1000)
    assert [w.filename for w in caught] == [__file__], [(w.filename, w.lineno) for w in caught]


async def test_a_multi_collectors_budget_warning_points_at_the_users_line() -> None:
    collector = MultiSyncCollector(
        [make_env] * 2, None, frames_per_batch=20, total_frames=50, worker_backend="serial"
    )
    with pytest.warns(UserWarning, match="total_frames=50 is not a multiple") as caught:
        async with collector:
            pass
    assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]


UNGUARDED = """
import anyio
from aiocollect import GymEnv, MultiSyncCollector


async def main():
    async with MultiSyncCollector(
        [lambda: GymEnv("CartPole-v1")] * 2, None, frames_per_batch=20, total_frames=40
    ) as collector:
        async for batch in collector:
            print(batch)


anyio.run(main)
"""


def run_script(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False
    )


@pytest.mark.timeout(300)
def test_a_script_without_a_main_guard_is_told_what_to_add(tmp_path: Path) -> None:
    proc = run_script(tmp_path, UNGUARDED)
    assert proc.returncode == 1, proc.stderr
    stderr = proc.stderr
    assert "RuntimeError: MultiSyncCollector starts worker processes" in stderr, stderr
    assert "line 14 of train.py" in stderr, stderr  # anyio.run(main)
    assert 'if __name__ == "__main__":' in stderr, stderr
    assert "WorkerDiedError" not in stderr, stderr
    assert len(stderr.splitlines()) < 60, stderr  # one traceback, not one per worker


@pytest.mark.timeout(300)
def test_the_same_script_with_a_main_guard_runs(tmp_path: Path) -> None:
    guarded = UNGUARDED.replace("\nanyio.run(main)\n", '\nif __name__ == "__main__":\n    anyio.run(main)\n')
    proc = run_script(tmp_path, guarded)
    assert proc.returncode == 0, proc.stderr


async def test_a_collector_started_inside_a_function_of_a_guarded_script_is_not_refused() -> None:
    """pytest's own entry point is guarded: collectors started from tests (here) are never refused."""
    async with MultiSyncCollector([make_env] * 2, None, frames_per_batch=20, total_frames=20) as collector:
        async for batch in collector:
            assert batch.numel() == 20


def test_anyio_is_all_the_async_engine_needs() -> None:
    """sniffio is not a dependency (anyio dropped it): ``import aiocollect`` and the async-env engine on
    asyncio must not need it."""
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, globals=None, *a, **k):\n"  # aiocollect's own imports (anyio<4.12 has sniffio)
        "    ours = (globals or {}).get('__name__', '').startswith('aiocollect')\n"
        "    if ours and name.split('.')[0] == 'sniffio':\n"
        "        raise ModuleNotFoundError(name)\n"
        "    return real(name, globals, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import anyio, aiocollect, gymnasium as gym\n"
        "from aiocollect import AsyncEnvCollector, GymEnv, ThreadedAsyncEnv\n"
        "async def main():\n"
        "    c = AsyncEnvCollector([lambda: ThreadedAsyncEnv(gym.make('CartPole-v1'))] * 2, None,\n"
        "                          frames_per_batch=20, total_frames=40)\n"
        "    async with c:\n"
        "        async for b in c: pass\n"
        "anyio.run(main)\n"  # trio itself needs sniffio: a trio user has it
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


async def test_the_engine_tells_asyncio_from_trio(anyio_backend_name: str) -> None:
    from aiocollect._procenv._doorbell import running_asyncio_loop

    assert (running_asyncio_loop() is not None) == (anyio_backend_name == "asyncio")
