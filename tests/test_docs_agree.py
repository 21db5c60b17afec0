"""What the docs say and the code does agree (issue 43, item 11): the README lists every example;
``MultiSyncCollector`` and ``MultiAsyncCollector`` warn when they round ``frames_per_batch`` up to whole
env steps (as ``Collector`` and the docs do); a forgotten ``await`` names the user's collector class;
``examples/episodes.py`` labels its mean episode length as one. (docs/envs.md's ``AsyncVectorEnv`` in
worker processes: ``test_vector_envs.py::test_async_vector_env_in_multi_collectors[process]``.)"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from aiocollect import GymEnv, MultiAsyncCollector, MultiSyncCollector, ProcessCollector

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.anyio


def test_the_readme_lists_every_example() -> None:
    listed = set(re.findall(r"\]\(examples/([\w/]+\.py)\)", (ROOT / "README.md").read_text()))
    scripts = {p.name for p in (ROOT / "examples").glob("*.py")}  # each a runnable file (as test_examples)
    assert scripts - listed == set()


def three_cartpoles() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=3)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
async def test_multi_collectors_warn_when_they_round_frames_per_batch(cls: type) -> None:
    collector = cls([three_cartpoles] * 2, None, frames_per_batch=1000, worker_backend="serial")
    with pytest.warns(
        UserWarning,
        match=r"^frames_per_batch=1000 is not a multiple of the workers' env batch "
        r"sizes: each batch has 1002 frames$",
    ) as caught:
        async with collector:
            pass
    assert collector.frames_per_batch == 1002
    assert caught[0].filename == __file__  # at the user's line


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector, ProcessCollector])
def test_a_forgotten_await_names_the_users_class(cls: type) -> None:
    envs = three_cartpoles if cls is ProcessCollector else [three_cartpoles] * 2
    collector = cls(envs, Linear(), frames_per_batch=30, worker_backend="serial")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collector.update_weights(Linear())  # no await: the update never happens
        gc.collect()
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert f"coroutine '{cls.__name__}.update_weights' was never awaited" in messages
    for name in ("set_seed", "state_dict", "update_weights"):
        assert getattr(cls, name).__qualname__ == f"{cls.__name__}.{name}"


@pytest.mark.slow
def test_the_episodes_example_labels_the_mean_length() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "episodes.py"),
            "--total-frames",
            "2000",
            "--trajs-per-batch",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"frames/s, mean length \d+\.\d \(longest \d+\)$", last), last
