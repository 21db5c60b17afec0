"""The layout of ``PettingZooEnv`` and ``VmasEnv`` batches is TorchRL's (issue 41): the keys, shapes and
dtypes of a batch equal those of ``torchrl.collectors.Collector`` over ``PettingZooWrapper`` / ``VmasEnv``
on the same env, so TorchRL's multi-agent losses and replay buffers take them as they are.

Run in the torchrl virtualenv: ``nox -s torchrl`` (or ``.venv-torchrl/bin/python -m pytest -m torchrl``).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

pytest.importorskip("torchrl")
pettingzoo = pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")
vmas = pytest.importorskip("vmas")

from mpe2 import simple_adversary_v3, simple_spread_v3  # noqa: E402
from torchrl.collectors import Collector as TorchRLCollector  # noqa: E402
from torchrl.envs.libs.pettingzoo import PettingZooWrapper  # noqa: E402
from torchrl.envs.libs.vmas import VmasEnv as TorchRLVmasEnv  # noqa: E402

from aiocollect import Collector, PettingZooEnv, VmasEnv  # noqa: E402

pytestmark = [
    pytest.mark.torchrl,
    # torchrl warns that it tests PettingZoo 1.24.3 only: its wrapper is the reference layout here
    pytest.mark.filterwarnings("ignore:PettingZoo in TorchRL is tested:UserWarning"),
]

FRAMES = 20


def layout(batch: Any) -> dict[Any, tuple[tuple[int, ...], Any]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in batch.items(include_nested=True, leaves_only=True)}


def ours(make: Any) -> dict[Any, tuple[tuple[int, ...], Any]]:
    async def main() -> Any:
        async with Collector(make, frames_per_batch=FRAMES, total_frames=FRAMES, seed=0) as collector:
            async for batch in collector:
                return layout(batch)

    return anyio.run(main)


def torchrls(env: Any) -> dict[Any, tuple[tuple[int, ...], Any]]:
    collector = TorchRLCollector(env, None, frames_per_batch=FRAMES, total_frames=FRAMES)
    try:
        for batch in collector:
            return layout(batch)
    finally:
        collector.shutdown()
    raise AssertionError("no batch")


PETTINGZOO = {
    "simple_spread": (lambda: simple_spread_v3.parallel_env(max_cycles=5), {"return_state": True}),
    "simple_adversary": (lambda: simple_adversary_v3.parallel_env(max_cycles=5), {"return_state": True}),
    "tictactoe": (lambda: pettingzoo.make("aec", "classic/tictactoe-v3"), {"use_mask": True}),
    "connect_four": (lambda: pettingzoo.make("aec", "classic/connect_four-v3"), {"use_mask": True}),
}


@pytest.mark.parametrize("name", list(PETTINGZOO))
def test_pettingzoo_layout_is_torchrls(name: str) -> None:
    make, kwargs = PETTINGZOO[name]
    assert ours(lambda: PettingZooEnv(make, **kwargs)) == torchrls(PettingZooWrapper(make(), **kwargs))


@pytest.mark.parametrize("continuous", [True, False])
def test_vmas_layout_is_torchrls(continuous: bool) -> None:
    kwargs = {"num_envs": 4, "continuous_actions": continuous, "max_steps": 3}
    mine = ours(lambda: VmasEnv("navigation", **kwargs))
    theirs = torchrls(TorchRLVmasEnv("navigation", **kwargs))
    # VMAS tells a horizon from a termination here (TorchRL's VmasEnv calls both "terminated"): our batches
    # have the "truncated" flags every aiocollect batch has
    assert {k for k in mine if k not in theirs} == {"truncated", ("next", "truncated")}
    assert {k: v for k, v in mine.items() if k in theirs} == theirs
