"""Run by test_signals.py in a subprocess: collect slow batches under ``stop_on_signals`` until a signal
stops the run, then save what the trainer received and the collector's state.

usage: python stop_child.py BACKEND KIND CHECKPOINT [STEP_SECONDS [STEP_SECONDS_AFTER_THE_STOP]]

Prints ``batch <seconds>`` after each batch and ``stopping`` when the first signal asked for the stop.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import anyio
import gymnasium as gym
import torch
from tensordict import TensorDictBase

from aiocollect import (
    AsyncEnvCollector,
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
    stop_on_signals,
)


def cartpole() -> GymEnv:
    return GymEnv("CartPole-v1")


def gym_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


class SlowPolicy:
    """Action 0 after ``seconds`` (a batch of known length, so that a signal lands mid-batch)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        time.sleep(self.seconds)
        return td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))


class Announce:
    """Passed to stop_on_signals: says when the first signal came, then asks the collector to stop (the
    steps left of the batch in flight take ``after`` seconds each, where given)."""

    def __init__(self, collector: Any, policy: SlowPolicy, after: float | None) -> None:
        self.collector = collector
        self.policy = policy
        self.after = after

    def request_stop(self) -> None:
        if self.after is not None:
            self.policy.seconds = self.after
        print("stopping", flush=True)
        self.collector.request_stop()


async def main(kind: str, path: str, step: float, after: float | None = None) -> None:
    policy = SlowPolicy(step)
    kwargs: dict[str, Any] = {"frames_per_batch": 20, "total_frames": -1, "seed": 0}
    if kind == "collector":
        collector: Any = Collector(cartpole, policy, **kwargs)
    elif kind == "sync":
        collector = MultiSyncCollector([cartpole] * 2, policy, **kwargs)
    elif kind == "asyncenv":  # one env: a policy call per step, so a batch takes 20 steps' time
        collector = AsyncEnvCollector([gym_cartpole], policy, **kwargs)
    elif kind == "multiasyncenv":
        collector = MultiAsyncEnvCollector([[gym_cartpole]] * 2, policy, **kwargs)
    else:
        collector = MultiAsyncCollector([cartpole] * 2, policy, **kwargs)
    received = 0
    async with collector, stop_on_signals(Announce(collector, policy, after)) as stop:
        started = time.monotonic()
        async for batch in collector:
            received += batch.numel()
            print(f"batch {time.monotonic() - started:.3f}", flush=True)
            started = time.monotonic()
        state = await collector.state_dict()
    signal = None if stop.received is None else int(stop.received)
    torch.save({"state": state, "received": received, "signal": signal}, path)
    gc.freeze()  # as examples/long_run.py does last: the interpreter's exit skips its final full scan


if __name__ == "__main__":
    backend = sys.argv[1]
    options = {"use_uvloop": True} if backend == "uvloop" else {}
    step = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05
    after = float(sys.argv[5]) if len(sys.argv) > 5 else None
    anyio.run(
        main,
        sys.argv[2],
        sys.argv[3],
        step,
        after,
        backend="trio" if backend == "trio" else "asyncio",
        backend_options=options,
    )
