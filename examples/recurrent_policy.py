"""Collect CartPole-v1 with its velocities hidden, with a GRU policy whose state the collector carries.

    python examples/recurrent_policy.py
    python examples/recurrent_policy.py --workers 2 --total-frames 20480

The policy reads ``"hidden"`` and writes ``("next", "hidden")``: a recurrent policy. The collector feeds
each step's ``("next", "hidden")`` back as the next step's ``"hidden"``, sets it back to zeros where an
episode ends and marks first steps with ``"is_init"`` (as TorchRL's ``InitTracker``), in process and in
worker processes. A loss can replay the sequence: the last lines unroll the GRU over each batch from its
stored first state and ``is_init``, and find the states the collector stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import gymnasium as gym
import torch
from tensordict import TensorDict
from tensordict.nn import ProbabilisticTensorDictModule, TensorDictModule, TensorDictSequential
from torch import nn
from torch.distributions import Categorical

from aiocollect import Collector, GymEnv, MultiSyncCollector


@dataclass
class Args:
    total_frames: int = field(default=20_480, metadata={"help": "frames to collect"})
    num_envs: int = field(default=8, metadata={"help": "envs per worker (batch [num_envs])"})
    frames_per_batch: int = field(
        default=1_024, metadata={"help": "frames per batch (all workers together: each collects its share)"}
    )
    workers: int = field(default=0, metadata={"help": "0: in process (Collector); n: MultiSyncCollector"})
    hidden: int = field(default=32, metadata={"help": "GRU state size"})
    seed: int = field(default=1, metadata={"help": "seeds the envs, the weights and sampling"})


def parse_args() -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(Args):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, **f.metadata
        )
    return Args(**vars(parser.parse_args()))


def masked_cartpole() -> gym.Env[Any, Any]:
    """Cart position and pole angle only: the velocities must be remembered."""
    env = gym.make("CartPole-v1")
    box = env.observation_space
    assert isinstance(box, gym.spaces.Box)
    space = gym.spaces.Box(box.low[[0, 2]], box.high[[0, 2]])
    return gym.wrappers.TransformObservation(env, lambda obs: obs[[0, 2]], space)


def make_env(num_envs: int) -> GymEnv:
    return GymEnv(gym.vector.SyncVectorEnv([masked_cartpole] * num_envs))


class GRUNet(nn.Module):
    """(observation, hidden) -> (logits, next hidden): one GRU cell and a linear head."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.cell = nn.GRUCell(2, hidden)
        self.head = nn.Linear(hidden, 2)

    def forward(self, observation: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = observation.shape[:-1]
        nxt = self.cell(observation.reshape(-1, 2), hidden.reshape(-1, hidden.shape[-1])).reshape(*batch, -1)
        return self.head(nxt), nxt


def make_policy(hidden: int) -> TensorDictSequential:
    policy = TensorDictSequential(
        TensorDictModule(GRUNet(hidden), ["observation", "hidden"], ["logits", ("next", "hidden")]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=Categorical, return_log_prob=True
        ),
    )
    # the initial state of one env (nn.Module's attribute typing knows only tensors and modules)
    policy.recurrent_state = {"hidden": torch.zeros(hidden)}  # type: ignore[assignment]
    return policy


def unroll(net: GRUNet, batch: TensorDict) -> torch.Tensor:
    """The GRU over the batch's time dim from its first stored state, zeroed where ``is_init``: what a
    recurrent loss computes. Returns the ``("next", "hidden")`` it finds."""
    hidden = batch["hidden"][..., 0, :]
    out = []
    for t in range(batch.shape[-1]):
        hidden = torch.where(batch["is_init"][..., t, :], 0.0, hidden)
        _, hidden = net(batch["observation"][..., t, :], hidden)
        out.append(hidden)
    return torch.stack(out, dim=-2)


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    policy = make_policy(args.hidden)
    kwargs: dict[str, Any] = {
        "frames_per_batch": args.frames_per_batch,
        "total_frames": args.total_frames,
        "seed": args.seed,
    }
    if args.workers:
        collector: Any = MultiSyncCollector(
            [partial(make_env, args.num_envs)] * args.workers, policy, **kwargs
        )
    else:
        collector = Collector(partial(make_env, args.num_envs), policy, **kwargs)
    start = time.perf_counter()
    async with collector:
        async for batch in collector:  # noqa: B007 (the last batch is replayed below)
            stats = collector.statistics()
            print(
                f"batch {stats.batches:3d}  frames {stats.frames:6d}  "
                f"{stats.frames_per_second:8,.0f} frames/s  mean return {stats.mean_return or 0.0:.1f}"
            )
        stats = collector.statistics()
    elapsed = time.perf_counter() - start
    print(f"batch {list(batch.batch_size)}: hidden {list(batch['hidden'].shape)}")
    net = policy[0].module
    assert isinstance(net, GRUNet)
    with torch.no_grad():
        replayed = unroll(net, batch)
    same = torch.allclose(replayed, batch["next", "hidden"], atol=1e-5)
    print(f"replayed states match the collected ones: {same}")
    print(f"{stats.frames} frames in {elapsed:.2f} s: {stats.frames / elapsed:,.0f} frames/s")


if __name__ == "__main__":
    torch.set_num_threads(1)
    anyio.run(main, parse_args())
