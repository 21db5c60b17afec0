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

``--node-frames 32,512`` measures what a torch.distributed/RPC node or a Ray actor adds per batch to carry
its collector's split to the trainer: a node core (``NodeCore``, hosting a ``Collector`` of CartPoles with
a random policy, the cheapest frames) produces batches of that many frames, and each is announced as a
node does (its ``BatchNotice`` pickled and unpickled, as over the control connection) and recorded as the
trainer does; the batches alternate between carrying the split (``on``: ``producer_totals`` sent, added to
the member's ``SplitWindows``) and not (``off``), the order flipping each pair. CPU time is the process's
(the rollout thread's and the event loop's).

```bash
python benchmarks/timesplit.py --rounds 9 --batches 8
python benchmarks/timesplit.py --cases none --node-frames 32,512 --rounds 15 --batches 40
```
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, GymEnv
from aiocollect._observe._timesplit import NULL_CLOCK

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

    from aiocollect._observe._timesplit import SplitClock

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


def measure_node(frames_per_batch: int, rounds: int, batches: int) -> tuple[list[float], list[float]]:
    """Per round, µs of the process's CPU per frame of a node's batches with the split carried and without
    (a node core and the trainer's side in this process; the transport's bytes are pickled, not sent)."""
    import aiocollect._remote._node as node_module
    from aiocollect._observe._timesplit import SplitWindows, producer_totals
    from aiocollect._remote._messages import BatchNotice

    def without(collector: Any) -> tuple[()]:
        return ()

    async def run() -> tuple[list[float], list[float]]:
        core = node_module.NodeCore(
            Collector(
                lambda: GymEnv("CartPole-v1"), None, frames_per_batch=frames_per_batch, total_frames=-1
            ),
            None,
        )
        windows = SplitWindows()
        async with core:
            for _ in range(5):  # warm-up
                await core.next_batch()
            on: list[float] = []
            off: list[float] = []
            for _ in range(rounds):
                cpu = {True: 0.0, False: 0.0}
                frames = {True: 0, False: 0}
                for i in range(batches):
                    for split_on in (True, False) if i % 2 == 0 else (False, True):
                        node_module.producer_totals = producer_totals if split_on else without
                        start = time.process_time()
                        out = await core.next_batch()
                        notice = pickle.loads(pickle.dumps(out.notice(i, None)))
                        assert isinstance(notice, BatchNotice)
                        if split_on:
                            windows.add(notice.time_split)
                        cpu[split_on] += time.process_time() - start
                        frames[split_on] += out.frames
                on.append(cpu[True] / frames[True] * 1e6)
                off.append(cpu[False] / frames[False] * 1e6)
        node_module.producer_totals = producer_totals
        return on, off

    return anyio.run(run)


def node_per_batch_ns(repeat: int = 7, number: int = 20_000) -> float:
    """ns of CPU per batch that carrying the split adds, timed alone (``timeit``): the node's
    ``producer_totals``, the 7 numbers more in its pickled notice, the trainer's ``SplitWindows.add``."""
    import timeit

    from aiocollect._observe._timesplit import SplitClock, SplitWindows, producer_totals
    from aiocollect._remote._messages import BatchNotice

    class Hosted:  # a Collector as producer_totals sees it: its rollout's clock
        class _rollout:
            clock = SplitClock()

    hosted, windows = Hosted(), SplitWindows()
    episodes = [(10.0, 10)]

    def carried() -> None:
        notice = BatchNotice(1, 32, None, episodes, 0, producer_totals(hosted))
        windows.add(pickle.loads(pickle.dumps(notice)).time_split)

    def bare() -> None:
        pickle.loads(pickle.dumps(BatchNotice(1, 32, None, episodes, 0)))

    cpu = time.thread_time
    with_split = min(timeit.repeat(carried, repeat=repeat, number=number, timer=cpu)) / number
    without_split = min(timeit.repeat(bare, repeat=repeat, number=number, timer=cpu)) / number
    return (with_split - without_split) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--cases", default=",".join(CASES), help="'none': only the node cases")
    parser.add_argument("--node-frames", default="", help="frames per batch of the node cases (e.g. 32,512)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = [] if args.cases == "none" else args.cases.split(",")
    load = os.getloadavg()[0]
    print(f"load average {load:.1f}; {args.rounds} rounds x {args.batches} batch pairs")
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
    if args.node_frames:
        carried = node_per_batch_ns()
        print(f"a node carrying its split: {carried:.0f} ns per batch (timeit, CPU time)")
        for fpb in (int(n) for n in args.node_frames.split(",")):
            on, off = measure_node(fpb, args.rounds, args.batches)
            ratios = [a / b for a, b in zip(on, off, strict=True)]
            bound = carried / 1e3 / fpb / statistics.median(off)
            name = f"node, batches of {fpb}"
            print(
                f"{name:24} {statistics.median(off):13.2f} {statistics.median(on):12.2f} "
                f"{statistics.median(ratios):16.4f} {min(ratios):7.4f}-{max(ratios):.4f} {bound:7.2%}"
            )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
