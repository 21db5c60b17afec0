"""Start-up of the worker processes: what the forkserver imports, and how (issue 12).

``import aiocollect`` imports tensordict without ``torch._dynamo`` (and sympy, ``torch._inductor``): the
functions tensordict hands to ``torch.compiler.allow_in_graph`` are registered when ``torch._dynamo`` is
imported later, so dynamo ends up knowing exactly what it knows after a plain ``import tensordict``. Workers
are forked from a forkserver that imported only that, and froze its heap out of the garbage collector.
These run in fresh interpreters where the point is what a process imports.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from aiocollect import GymEnv, MultiAsyncCollector, MultiSyncCollector

SRC = str(Path(__file__).resolve().parents[1] / "src")

#: what dynamo knows about tensordict's functions: allowed in the graph, marked constant, its rule for them
DYNAMO_VIEW = textwrap.dedent(
    """
    import json, sys
    import torch._dynamo
    from torch._dynamo import trace_rules
    view = {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("tensordict") or module is None:
            continue
        for attr, value in sorted(vars(module).items()):
            if callable(value):
                allowed = id(value) in trace_rules._allowed_callable_ids
                marked = bool(getattr(value, "_dynamo_marked_constant", False))
                rule = getattr(trace_rules.lookup_callable(value), "__name__", None)
                if allowed or marked or rule is not None:
                    view[f"{name}.{attr}"] = [allowed, marked, rule]
    print(json.dumps(view))
    """
)


COMPILE = textwrap.dedent(
    """
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    module = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
    compiled = torch.compile(module, backend="eager")
    td = TensorDict({"x": torch.ones(4, 3)}, batch_size=[4])
    assert torch.equal(compiled(td.clone())["y"], module(td.clone())["y"])
    print("compiled")
    """
)


def _pythons(*codes: str) -> list[list[str]]:
    """Run each code in a fresh interpreter (concurrently); their stdout lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for code in codes
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outs.append(out.strip().splitlines())
    return outs


def test_aiocollect_imports_tensordict_without_dynamo_and_dynamo_learns_the_same() -> None:
    lean, plain = _pythons(
        "import sys, torch, aiocollect\n"
        "assert 'tensordict' in sys.modules\n"
        "assert not {'torch._dynamo', 'sympy', 'torch._inductor'} & set(sys.modules), 'imported'\n"
        + DYNAMO_VIEW
        + COMPILE,
        "import tensordict, aiocollect\n" + DYNAMO_VIEW,  # torch._dynamo imported by tensordict
    )
    view = json.loads(lean[-2])
    assert view == json.loads(plain[-1])
    # tensordict's allow_in_graph calls reached dynamo (they do not without the import hook)
    assert any(allowed for allowed, _, _ in view.values())
    assert any(marked for _, marked, _ in view.values())
    assert lean[-1] == "compiled"  # torch.compile works on a TensorDictModule


def test_building_a_process_collector_starts_the_forkserver() -> None:
    (out,) = _pythons(
        textwrap.dedent(
            """
            import functools
            from multiprocessing import forkserver
            from aiocollect import GymEnv, MultiSyncCollector
            make = functools.partial(GymEnv, "CartPole-v1")
            MultiSyncCollector([make], frames_per_batch=8, worker_backend="serial")
            print(forkserver._forkserver._forkserver_pid is None)  # threads: no forkserver
            MultiSyncCollector([make], frames_per_batch=8, start_method="spawn")
            print(forkserver._forkserver._forkserver_pid is None)
            MultiSyncCollector([make], frames_per_batch=8)  # built, not entered
            print(forkserver._forkserver._forkserver_pid is not None)
            """
        )
    )
    assert out == ["True", "True", "True"]


class ProbedEnv(GymEnv):
    """CartPole that says what its worker process has imported and frozen."""

    @property
    def probe(self) -> dict[str, object]:
        return {
            "dynamo": "torch._dynamo" in sys.modules,
            "sympy": "sympy" in sys.modules,
            "frozen": gc.get_freeze_count(),
        }


def probed_cartpole() -> ProbedEnv:
    return ProbedEnv("CartPole-v1")


class Argmax(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


@pytest.mark.anyio
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
async def test_workers_import_no_dynamo_and_share_a_frozen_heap(cls: type) -> None:
    collector = cls([probed_cartpole, probed_cartpole], Argmax(), frames_per_batch=32, total_frames=64)
    async with collector:
        frames = 0
        async for batch in collector:
            frames += batch.numel()
        probes = await collector.get_distant_attr("env.probe")
    assert frames == 64
    for probe in probes:
        assert probe["dynamo"] is False
        assert probe["sympy"] is False
        assert probe["frozen"] > 10_000  # the preloaded heap (torch alone has ~10^5 objects)
