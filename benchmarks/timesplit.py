"""What the time split (``statistics().time_split``) costs: CPU per frame with its clock and without.

The split is on by default, so its clock must stay under 1% of a frame's CPU time on the cheapest paths
users take. Each case builds a ``Collector``'s rollout and collects ``--batches`` pairs of batches per round
in this thread: one with the rollout's ``SplitClock`` (``on``), one with a clock that measures nothing
(``off``: ``NULL_CLOCK``), the order flipping each pair, so that the shared machine's drift hits both
alike. CPU time is this thread's (``time.thread_time``: other processes' load does not count). The report
gives, per case, the median µs per frame of each and the median of the per-round ratios ``on / off``
with their range; on a loaded machine that ratio's noise (a few %) hides a cost this small, so ``bound``
also gives the clock's own CPU per frame (its cost per policy call and per batch, timed alone with
``timeit`` in CPU time) over the frame's CPU without it. (Per batch the clock also reads the time around
the rollout thread's wait, and a worker sends 7 numbers with its batch notice: a few µs per batch of 512
frames, not counted here.)

Cases: CartPole with a random policy (fused loop, actions drawn once per batch), CartPole with an MLP
(fused loop, a policy call per step), 8 CartPoles with a TensorDictModule MLP (the generic loop), and
Pendulum with an MLP and ``max_frames_per_traj`` (the generic loop, one env).

```bash
python benchmarks/timesplit.py --rounds 9 --batches 8
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, GymEnv
from aiocollect._timesplit import NULL_CLOCK

FRAMES_PER_BATCH = 512


class Argmax(nn.Module):
    def __init__(self, n_obs: int = 4, n_act: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_obs, 64), nn.Tanh(), nn.Linear(64, n_act))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


class Box(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).tanh() * 2


CASES: dict[str, Callable[[], tuple[Any, Any, dict[str, Any]]]] = {
    "cartpole-random": lambda: (lambda: GymEnv("CartPole-v1"), None, {}),
    "cartpole-mlp": lambda: (lambda: GymEnv("CartPole-v1"), Argmax(), {}),
    "cartpole8-tdmodule": lambda: (
        lambda: GymEnv("CartPole-v1", num_envs=8),
        TensorDictModule(Argmax(), in_keys=["observation"], out_keys=["action"]),
        {},
    ),
    "pendulum-mlp-maxsteps": lambda: (lambda: GymEnv("Pendulum-v1"), Box(), {"max_frames_per_traj": 100}),
}


#: policy calls per frame of each case (a random policy draws a batch's actions at once: none)
CALLS_PER_FRAME = {
    "cartpole-random": 0.0,
    "cartpole-mlp": 1.0,
    "cartpole8-tdmodule": 1 / 8,
    "pendulum-mlp-maxsteps": 1.0,
}


def measure(case: str, rounds: int, batches: int) -> tuple[list[float], list[float]]:
    """Per round, µs of CPU per frame with the clock and without: one rollout, its batches alternating
    between the two (the order flipping each pair), so that drift cancels."""
    env_fn, policy, kwargs = CASES[case]()
    collector = Collector(env_fn, policy, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1, **kwargs)
    rollout = collector._rollout
    clock = rollout.clock
    try:
        for _ in range(3):  # warm-up
            rollout.collect()
        on: list[float] = []
        off: list[float] = []
        for _ in range(rounds):
            cpu = {True: 0.0, False: 0.0}
            frames = {True: 0, False: 0}
            for i in range(batches):
                for clock_on in (True, False) if i % 2 == 0 else (False, True):
                    rollout.clock = clock if clock_on else NULL_CLOCK
                    start = time.thread_time()
                    result = rollout.collect()
                    cpu[clock_on] += time.thread_time() - start
                    frames[clock_on] += result.frames
            on.append(cpu[True] / frames[True] * 1e6)
            off.append(cpu[False] / frames[False] * 1e6)
        return on, off
    finally:
        anyio.run(collector.aclose)


def per_call_ns(repeat: int = 7, number: int = 200_000) -> tuple[float, float]:
    """The clock's own cost, precise where the ratios are noisy: ns added to each policy call by the
    timing wrapper (best of ``repeat``), and ns per batch of the loop/batch marks."""
    import timeit

    from aiocollect._timesplit import SplitClock

    clock = SplitClock()

    def call(x: Any) -> Any:
        return x

    timed = clock.timed_policy(call)
    cpu = time.thread_time  # this thread's CPU time: the time it waits for a core does not count
    bare = min(timeit.repeat(lambda: call(1), repeat=repeat, number=number, timer=cpu)) / number
    wrapped = min(timeit.repeat(lambda: timed(1), repeat=repeat, number=number, timer=cpu)) / number

    def marks() -> None:
        since = clock.loop_ended(clock.loop_started())
        clock.batch_written(since, 1)

    batch = min(timeit.repeat(marks, repeat=repeat, number=number // 10, timer=cpu)) / (number // 10)
    return (wrapped - bare) * 1e9, batch * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = args.cases.split(",")
    load = os.getloadavg()[0]
    print(f"load average {load:.1f}; {args.rounds} rounds x {args.batches} batch pairs of {FRAMES_PER_BATCH}")
    per_call, per_batch = per_call_ns()
    head = f"{'case':24} {'off µs/frame':>13} {'on µs/frame':>12} {'on/off (median)':>16} {'range':>16}"
    print(f"{head} {'bound':>7}")
    for case in cases:
        on, off = measure(case, args.rounds, args.batches)
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        # the clock's own CPU per frame over the frame's CPU without it
        bound = (
            (CALLS_PER_FRAME[case] * per_call + per_batch / FRAMES_PER_BATCH) / 1e3 / statistics.median(off)
        )
        print(
            f"{case:24} {statistics.median(off):13.2f} {statistics.median(on):12.2f} "
            f"{statistics.median(ratios):16.4f} {min(ratios):7.4f}-{max(ratios):.4f} {bound:7.2%}"
        )
    print(f"clock cost: {per_call:.0f} ns per policy call, {per_batch:.0f} ns per batch (timeit, CPU time)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
