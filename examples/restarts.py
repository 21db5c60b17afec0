"""A long run over an env that crashes now and then: ``restart=RestartPolicy(...)`` rebuilds it.

    python examples/restarts.py                      # restarts as needed, to total_frames
    python examples/restarts.py --max-restarts 2     # a tight budget: the run ends with the env's error

The env here is CartPole behind a wrapper that raises ``SimulatorCrash`` at random, about once every
``--crash-every`` steps: a stand-in for a physics engine that goes unstable, or a simulator process that
dies. Without a restart policy the first crash ends the run. With one, the crashed env is closed, built
again from its factory (with a seed derived from its own), and reset; its running trajectory ends (its
last frame is marked truncated and done) and the run goes on to ``total_frames``. More than
``max_restarts`` crashes within ``window`` seconds end the run with the crash itself, the restart history
attached as a note. Each restart is an ``aiocollect.Restarted`` event (printed here), and
``statistics().restarts`` counts them. The same ``restart=`` works on ``MultiSyncCollector``,
``MultiAsyncCollector`` and ``AsyncEnvCollector`` (see docs/faults.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import anyio
import gymnasium as gym
import numpy as np

from aiocollect import Collector, GymEnv, RestartPolicy


@dataclass
class Args:
    env_id: str = field(default="CartPole-v1", metadata={"help": "gymnasium env id"})
    total_frames: int = field(default=20_000, metadata={"help": "frames of the whole run"})
    frames_per_batch: int = field(default=500, metadata={"help": "frames per batch"})
    crash_every: int = field(default=5_000, metadata={"help": "steps between crashes, on average"})
    max_restarts: int = field(default=10, metadata={"help": "restarts allowed within the window"})
    window: float = field(default=60.0, metadata={"help": "the budget's window, in seconds"})
    backoff: float = field(default=0.05, metadata={"help": "seconds before a restart (doubles)"})
    seed: int = field(default=1, metadata={"help": "seeds the envs and the random policy"})


def parse_args() -> Args:
    """One ``--flag`` per ``Args`` field (``total_frames`` -> ``--total-frames``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(Args):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, **f.metadata
        )
    return Args(**vars(parser.parse_args()))


class SimulatorCrash(RuntimeError):
    """What the unstable simulator raises."""


class Unstable(gym.Wrapper):
    """Raises :class:`SimulatorCrash` in ``step`` with probability ``1 / crash_every``."""

    def __init__(self, env: gym.Env, crash_every: int, seed: int) -> None:
        super().__init__(env)
        self.p = 1.0 / crash_every
        self.rng = np.random.default_rng(seed)

    def step(self, action: Any) -> Any:
        if self.rng.random() < self.p:
            raise SimulatorCrash("the simulator went unstable")
        return self.env.step(action)


class MakeEnv:
    """The env factory a restart calls again."""

    def __init__(self, args: Args) -> None:
        self.env_id, self.crash_every, self.seed = args.env_id, args.crash_every, args.seed
        self.built = itertools.count()

    def __call__(self) -> GymEnv:
        crash_seed = self.seed * 1000 + next(self.built)  # each build crashes at other steps
        return GymEnv(Unstable(gym.make(self.env_id), self.crash_every, crash_seed))


async def print_restarts(collector: Any) -> None:
    async with collector.events(kinds=["restarted"]) as events:
        async for event in events:
            print(f"restart {event.restarts} of worker {event.worker}'s env {event.env}: {event.cause}")


async def main(args: Args) -> None:
    policy = RestartPolicy(max_restarts=args.max_restarts, window=args.window, backoff=args.backoff)
    collector = Collector(
        MakeEnv(args),  # a factory, not an env: a restart builds the env again
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        seed=args.seed,
        restart=policy,
    )
    async with collector, anyio.create_task_group() as tg:
        tg.start_soon(print_restarts, collector)
        async for batch in collector:
            ends = int(batch["next", "truncated"].sum())  # restarts cut trajectories (CartPole: rarely 500)
            stats = collector.statistics()
            mean = "-" if stats.mean_return is None else f"{stats.mean_return:.1f}"
            print(
                f"frames {stats.frames:>7}  {stats.frames_per_second:>8.0f} frames/s  mean return {mean:>6}"
                f"  restarts {stats.restarts}  truncated in batch {ends}"
            )
        tg.cancel_scope.cancel()
    print(f"done: {collector.statistics().frames} frames, {collector.statistics().restarts} restarts")


if __name__ == "__main__":
    anyio.run(main, parse_args())
