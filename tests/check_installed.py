"""What a user gets from ``pip install aiocollect`` with no extras: run by ``nox -s package`` in a fresh
virtualenv holding only the built wheel, its base dependencies and torch, from outside the source tree.

1. every public module imports, and every public name resolves (or, for a name of an extra, raises an
   ``ImportError`` that names the extra to install);
2. a 1,000-frame ``Collector`` and a 1,000-frame ``MultiSyncCollector`` (two worker processes) run;
3. each extra's public entry point, called with the extra missing, raises an ``ImportError`` that names
   ``pip install 'aiocollect[<extra>]'``.

Not a pytest module (pytest is not installed there): ``python tests/check_installed.py``; exits non-zero
with the failures listed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

failures: list[str] = []


def check(label: str, ok: bool, detail: str = "") -> None:
    print(("ok   " if ok else "FAIL ") + label + (f": {detail}" if detail and not ok else ""))
    if not ok:
        failures.append(f"{label}: {detail}")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def names_extra(label: str, extra: str, fn: Callable[[], Any]) -> None:
    """``fn()`` raises an ImportError naming ``aiocollect[extra]``."""
    try:
        fn()
    except ImportError as exc:
        check(label, f"aiocollect[{extra}]" in str(exc), f"the message does not name the extra: {exc}")
    else:
        check(label, False, "no ImportError without the extra")


def names_extra_async(label: str, extra: str, fn: Callable[[], Awaitable[Any]]) -> None:
    names_extra(label, extra, lambda: anyio.run(fn))


def public_modules() -> None:
    import aiocollect

    source = Path(__file__).resolve().parent.parent / "src"
    check("aiocollect is the installed wheel", not Path(aiocollect.__file__).is_relative_to(source))
    for module in ("aiocollect", "aiocollect.compat", "aiocollect.dashboard"):
        try:
            importlib.import_module(module)
            check(f"import {module}", True)
        except Exception as exc:
            check(f"import {module}", False, repr(exc))
    serve_names = {name for name, where in aiocollect._LAZY.items() if where == "._serve"}
    for name in aiocollect.__all__:
        if name in serve_names and not installed("wsproto"):
            names_extra(f"aiocollect.{name}", "serve", lambda name=name: getattr(aiocollect, name))
            continue
        try:
            getattr(aiocollect, name)
            check(f"aiocollect.{name}", True)
        except Exception as exc:
            check(f"aiocollect.{name}", False, repr(exc))
    typed = Path(aiocollect.__file__).with_name("py.typed")
    check("py.typed is shipped", typed.exists())
    check("the dashboard's page is shipped", any(Path(aiocollect.__file__).parent.glob("dashboard/*.html")))


def make_policy() -> Any:
    import torch
    from torch import nn

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            return torch.distributions.Categorical(logits=self.net(observation)).sample()

    return Policy()


def make_env() -> Any:
    from aiocollect import GymEnv

    return GymEnv("CartPole-v1", num_envs=4)


async def collect(kind: str) -> int:
    from aiocollect import Collector, MultiSyncCollector

    policy = make_policy()
    if kind == "Collector":
        collector: Any = Collector(make_env, policy, frames_per_batch=200, total_frames=1000, seed=0)
    else:
        collector = MultiSyncCollector(
            [make_env] * 2, policy, frames_per_batch=200, total_frames=1000, seed=0
        )
    frames = 0
    async with collector:
        async for batch in collector:
            frames += batch.numel()
            await collector.update_weights(policy)
    return frames


def collectors() -> None:
    for kind in ("Collector", "MultiSyncCollector"):
        try:
            frames = anyio.run(collect, kind)
            check(f"a 1,000-frame {kind}", frames == 1000, f"{frames} frames")
        except Exception as exc:
            check(f"a 1,000-frame {kind}", False, repr(exc))


def extras() -> None:
    import aiocollect
    from aiocollect import Collector

    if not installed("starlette"):
        import aiocollect.dashboard

        collector = Collector(make_env, None, frames_per_batch=200, total_frames=200)
        names_extra("dashboard.create_app", "dashboard", lambda: aiocollect.dashboard.create_app(collector))
    if not installed("uvicorn"):
        import aiocollect.dashboard

        async def serve() -> None:
            async with aiocollect.dashboard.serve(Collector(make_env, None, frames_per_batch=200)):
                pass

        names_extra_async("dashboard.serve", "dashboard", serve)
    if not installed("tensorboard"):
        names_extra("TensorBoardSink", "tensorboard", lambda: aiocollect.TensorBoardSink(tempfile.mkdtemp()))
    if not installed("wandb"):
        names_extra("WandbSink", "wandb", lambda: aiocollect.WandbSink(project="check"))
    if not installed("prometheus_client"):
        collector = Collector(make_env, None, frames_per_batch=200, total_frames=200)
        names_extra("metrics_text", "metrics", lambda: aiocollect.metrics_text(collector))
    if not installed("pettingzoo"):
        names_extra("PettingZooEnv", "multiagent", lambda: aiocollect.PettingZooEnv(lambda: None))
    if not installed("vmas"):
        names_extra("VmasEnv", "multiagent", lambda: aiocollect.VmasEnv("balance", num_envs=2))
    if not installed("ray"):

        async def ray_collector() -> None:
            async with aiocollect.RayCollector(
                make_env, None, frames_per_batch=200, total_frames=200, num_collectors=1
            ):
                pass

        names_extra_async("RayCollector", "ray", ray_collector)
    if not installed("submitit"):

        async def submitit_collector() -> None:
            async with aiocollect.DistributedCollector(
                make_env, None, frames_per_batch=200, total_frames=200, num_collectors=1, launcher="submitit"
            ):
                pass

        names_extra_async("DistributedCollector(launcher='submitit')", "distributed", submitit_collector)
        names_extra(
            "submitit_delayed_launcher", "distributed", lambda: aiocollect.submitit_delayed_launcher(1)
        )


if __name__ == "__main__":
    public_modules()
    collectors()
    extras()
    if failures:
        print(f"\n{len(failures)} failed:", *failures, sep="\n  ")
        sys.exit(1)
    print("\nthe installed wheel works with no extras")
