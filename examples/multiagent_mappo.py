"""MAPPO on MPE ``simple_spread`` (PettingZoo, through ``mpe2``): three agents learn to cover three landmarks.

One actor shared by the agents of the group ``"agent"`` (parameter sharing: the agent dim is a batch dim
for the network) and a centralised critic on the env's global ``"state"``. ``PettingZooEnv`` steps 8
copies of the env as one batched env; the batches have TorchRL's multi-agent layout
(``("agent", "observation")`` ``[8, T, 3, 18]``, ``("next", "agent", "reward")`` ``[8, T, 3, 1]``,
``"state"`` ``[8, T, 54]``). The mean episode return (the team's: the agents' mean reward summed over an
episode's 25 steps) rises from about -27 to about -20 in about four minutes on a 2-core CPU (300k frames).

    pip install "aiocollect[multiagent]"
    python examples/multiagent_mappo.py                          # 8 copies, 300k frames
    python examples/multiagent_mappo.py --workers 2              # the copies in 2 worker processes
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from mpe2 import simple_spread_v3
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, MultiSyncCollector, PettingZooEnv


@dataclass
class Args:
    total_frames: int = 300_000
    frames_per_batch: int = 4000  # 8 copies x 500 steps: 160 episodes of 25 steps
    num_envs: int = 8
    workers: int = 0  # 0: in process (Collector); N: N worker processes (MultiSyncCollector)
    epochs: int = 4
    minibatches: int = 4
    lr: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    entropy: float = 0.01
    seed: int = 0
    uvloop: bool = False


class Actor(nn.Module):
    """One agent's observation -> a sampled action and its log-probability (shared by the group)."""

    def __init__(self, obs: int = 18, actions: int = 5) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, actions)
        )

    def distribution(self, observation: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.net(observation))

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = self.distribution(observation)
        action = dist.sample()
        return action, dist.log_prob(action)


def make_env(num_envs: int) -> Any:
    return lambda: PettingZooEnv(lambda: simple_spread_v3.parallel_env(max_cycles=25), num_envs=num_envs)


def advantages(batch: Any, critic: nn.Module, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on the team reward (the agents' mean), bootstrapped through truncations (MPE's time limit)."""
    with torch.no_grad():
        value = critic(batch["state"]).squeeze(-1)  # [..., T]
        next_value = critic(batch["next", "state"]).squeeze(-1)
    reward = batch["next", "agent", "reward"].mean((-2, -1))
    terminated = batch["next", "terminated"][..., 0].float()
    done = batch["next", "done"][..., 0].float()
    delta = reward + gamma * next_value * (1 - terminated) - value
    adv = torch.zeros_like(delta)
    running = torch.zeros_like(delta[..., 0])
    for t in range(delta.shape[-1] - 1, -1, -1):
        running = delta[..., t] + gamma * lam * (1 - done[..., t]) * running
        adv[..., t] = running
    return adv, adv + value


def train(batch: Any, actor: Actor, critic: nn.Module, optim: torch.optim.Optimizer, args: Args) -> None:
    adv, returns = advantages(batch, critic, args.gamma, args.gae_lambda)
    flat = batch.reshape(-1)
    adv, returns = adv.reshape(-1), returns.reshape(-1)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    size = len(flat) // args.minibatches
    for _ in range(args.epochs):
        for idx in torch.randperm(len(flat)).split(size):
            mb = flat[idx]
            dist = actor.distribution(mb["agent", "observation"])  # [mb, 3, 5]
            log_prob = dist.log_prob(mb["agent", "action"])
            ratio = (log_prob - mb["agent", "log_prob"]).exp()  # [mb, 3]: each agent's own ratio
            a = adv[idx].unsqueeze(-1)
            policy_loss = -torch.min(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a).mean()
            value_loss = (critic(mb["state"]).squeeze(-1) - returns[idx]).pow(2).mean()
            loss = policy_loss + 0.5 * value_loss - args.entropy * dist.entropy().mean()
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_([*actor.parameters(), *critic.parameters()], 0.5)
            optim.step()


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    actor = Actor()
    critic = nn.Sequential(nn.Linear(54, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    optim = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=args.lr)
    # a policy per group: the group "agent" runs the shared actor (a group without one would act randomly)
    policy = {
        "agent": TensorDictModule(
            actor, [("agent", "observation")], [("agent", "action"), ("agent", "log_prob")]
        )
    }
    kwargs: dict[str, Any] = {"frames_per_batch": args.frames_per_batch, "total_frames": args.total_frames}
    if args.workers:
        per_worker = max(args.num_envs // args.workers, 1)
        collector: Any = MultiSyncCollector(
            [make_env(per_worker)] * args.workers, policy, seed=args.seed, **kwargs
        )
    else:
        collector = Collector(make_env(args.num_envs), policy, seed=args.seed, **kwargs)
    start = time.perf_counter()
    first = last = None
    async with collector:
        async for batch in collector:
            train(batch, actor, critic, optim, args)
            await collector.update_weights(policy)  # the next batch runs the new weights
            # the team's return per episode: the agents' mean reward summed over the episode's steps
            done = batch["next", "done"][..., 0]
            team = batch["next", "agent", "reward"].mean((-2, -1))
            episodes = int(done.sum())
            mean_return = float(team.sum()) / max(episodes, 1)
            first = mean_return if first is None else first
            last = mean_return
            stats = collector.statistics()
            print(
                f"frames {stats.frames:>7}  episodes {episodes:>3}  mean return {mean_return:7.2f}  "
                f"frames/s {stats.frames_per_second:6.0f}"
            )
    elapsed = time.perf_counter() - start
    print(f"done: {stats.frames} frames in {elapsed:.1f} s; mean return {first:.2f} -> {last:.2f}")


def parse() -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for field in dataclasses.fields(Args):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":  # needed: workers are started with a forkserver
    args = parse()
    anyio.run(main, args, backend_options={"use_uvloop": args.uvloop})
