"""Off-policy shape: collect into a replay buffer in the background while a trainer samples from it.

    python examples/replay_buffer.py
    python examples/replay_buffer.py --total-frames 200000 --uvloop

With ``Collector(..., replay_buffer=rb)`` every batch goes to ``rb.extend(batch)``, and
``async for frames in collector.fill():`` yields the frames of each batch written.
``await collector.start()`` keeps collecting in the background (a task in the collector's task group)
until the frame budget or the end of the ``async with`` block;
``async with collector.pause():`` holds off new batches, e.g. to checkpoint the buffer and the
collector consistently.

The buffer here is a few lines so that the example needs nothing else. torchrl's ``ReplayBuffer`` has
the same ``extend`` (and a lock around ``extend`` and ``sample``) and drops in unchanged::

    from torchrl.data import LazyTensorStorage, ReplayBuffer
    rb = ReplayBuffer(storage=LazyTensorStorage(args.buffer_size))
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import gymnasium as gym
import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import nn

from aiocollect import Collector, GymEnv


@dataclass
class Args:
    env_id: str = field(default="CartPole-v1", metadata={"help": "gymnasium env id"})
    total_frames: int = field(default=50_000, metadata={"help": "frames to collect"})
    num_envs: int = field(default=8, metadata={"help": "envs stepped together (batch [num_envs])"})
    frames_per_batch: int = field(default=1_000, metadata={"help": "frames per batch"})
    buffer_size: int = field(default=20_000, metadata={"help": "replay buffer capacity (transitions)"})
    learning_starts: int = field(default=1_000, metadata={"help": "frames collected before training"})
    batch_size: int = field(default=256, metadata={"help": "transitions per training step"})
    update_every: int = field(default=10, metadata={"help": "training steps between weight updates"})
    checkpoint_every: int = field(default=200, metadata={"help": "training steps between checkpoints"})
    seed: int = field(default=1, metadata={"help": "seeds the envs, the policy and the buffer"})
    uvloop: bool = field(default=False, metadata={"help": "run the asyncio loop on uvloop"})
    torch_threads: int = field(default=1, metadata={"help": "torch intra-op threads (small MLP: 1)"})


def parse_args() -> Args:
    """One ``--flag`` per ``Args`` field (``total_frames`` -> ``--total-frames``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, **f.metadata)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, **f.metadata)
    return Args(**vars(parser.parse_args()))


class TinyReplayBuffer:
    """A ring buffer of transitions with ``extend(batch)`` and ``sample(n)``.

    The collector calls ``extend`` from its worker thread while the trainer samples on the event
    loop, so both take a lock.
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        self.capacity = capacity
        self._storage: TensorDictBase | None = None
        self._cursor = 0
        self._size = 0
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self._size

    def extend(self, transitions: TensorDictBase) -> None:
        n = transitions.batch_size[0]
        with self._lock:
            if self._storage is None:  # preallocate from the first batch's keys, shapes and dtypes
                self._storage = transitions[0].expand(self.capacity).clone()
            index = (self._cursor + torch.arange(n)) % self.capacity
            self._storage[index] = transitions
            self._cursor = (self._cursor + n) % self.capacity
            self._size = min(self._size + n, self.capacity)

    def sample(self, n: int) -> TensorDictBase:
        with self._lock:
            assert self._storage is not None, "sample() before the first extend()"
            index = torch.randint(self._size, (n,), generator=self._generator)
            return self._storage[index]


class CategoricalMLP(nn.Module):
    """observation -> 64 -> 64 -> logits; samples the action from a Categorical over the logits."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, n_actions),
        )

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = torch.distributions.Categorical(logits=self.net(observation)).sample()
        return action


def train_step(policy: CategoricalMLP, optimizer: torch.optim.Optimizer, sample: TensorDictBase) -> float:
    """A pretend update (behaviour cloning of the sampled actions): stands in for a DQN/SAC step."""
    loss = F.cross_entropy(policy.net(sample["observation"]), sample["action"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    probe = GymEnv(args.env_id)
    obs_shape, action_space = probe.observation_space.shape, probe.action_space
    assert obs_shape, "a Box observation space"
    assert isinstance(action_space, gym.spaces.Discrete), "a Discrete action space"
    policy = CategoricalMLP(obs_shape[0], int(action_space.n))
    probe.close()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    rb = TinyReplayBuffer(args.buffer_size, seed=args.seed)

    start = time.perf_counter()
    async with Collector(
        lambda: GymEnv(args.env_id, num_envs=args.num_envs),
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        postproc=lambda batch: batch.reshape(-1),  # [num_envs, T] -> transitions, as the buffer stores
        replay_buffer=rb,
        track_policy_version=True,  # every frame carries ("collector", "policy_version")
        seed=args.seed,
    ) as collector:
        # Warm-up in the foreground: fill() writes each batch to rb and yields its frame count.
        async for _frames in collector.fill():
            if len(rb) >= args.learning_starts:
                break

        await collector.start()  # collection goes on in the background until total_frames
        train_steps, staleness, loss = 0, 0.0, float("nan")
        while collector.statistics().frames < args.total_frames:
            sample = rb.sample(args.batch_size)
            staleness += (
                collector.policy_version - sample["collector", "policy_version"].float().mean().item()
            )
            # the gradient step runs in a thread: the loop (and the collector's hand-offs) stay free
            loss = await anyio.to_thread.run_sync(train_step, policy, optimizer, sample)
            train_steps += 1
            if train_steps % args.update_every == 0:
                # copies the trainer's weights into the collector's own policy between two batches
                await collector.update_weights(policy)
            if train_steps % args.checkpoint_every == 0:
                async with collector.pause():  # no batch is written to rb while this block runs
                    state, buffer_len = await collector.state_dict(), len(rb)  # save_checkpoint(state, path)
                frames = state["frames"]
                print(
                    f"train step {train_steps:5d}  loss {loss:.3f}  "
                    f"checkpoint at {frames} frames, {buffer_len} in the buffer"
                )
        stats = collector.statistics()
    elapsed = time.perf_counter() - start

    print(f"{stats.frames} frames in {elapsed:.2f} s: {stats.frames / elapsed:,.0f} frames/s")
    print(
        f"{train_steps} training steps ({train_steps / elapsed:,.0f}/s) while collecting, "
        f"policy version {stats.policy_version}, "
        f"samples {staleness / max(train_steps, 1):.1f} versions behind on average"
    )
    mean_return = "n/a" if stats.mean_return is None else f"{stats.mean_return:.1f}"
    print(f"{stats.episodes} episodes, mean return of the last 100: {mean_return}")


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(args.torch_threads)
    anyio.run(main, args, backend="asyncio", backend_options={"use_uvloop": args.uvloop})
