"""A long run that survives preemption: stop on SIGTERM, checkpoint, and resume by running it again.

    python examples/long_run.py                      # runs, checkpointing every 5 batches
    kill -TERM <pid>                                 # (or Slurm / Kubernetes does): exits 0 after a batch
    python examples/long_run.py                      # the same command resumes where it stopped

``stop_on_signals(collector)`` turns the first SIGTERM (or Ctrl-C) into ``collector.request_stop()``:
the ``async for`` ends after the batch being collected is delivered and trained on, so the trainer,
the replay buffer and the collector agree on what was collected. Then one checkpoint holds all three,
written atomically by ``aiocollect.save_checkpoint`` (a temporary file flushed to disk, then renamed over
the path): a kill during the write leaves the previous one.
A second signal is not caught (the default: terminate, or KeyboardInterrupt).

``collector.state_dict(envs=True)`` holds the random states and the envs' own state, so a resumed
seeded run collects, from the checkpoint on, exactly the frames the uninterrupted run collects
(``--no-env-state``: the envs start from reset at a resume). The checkpoint loads with
``torch.load(path, weights_only=True)``: tensors, numbers, strings, lists and dicts only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torch import nn

from aiocollect import Collector, GymEnv, load_checkpoint, save_checkpoint, stop_on_signals


@dataclass
class Args:
    env_id: str = field(default="CartPole-v1", metadata={"help": "gymnasium env id (Discrete actions)"})
    total_frames: int = field(default=20_000, metadata={"help": "frames of the whole run"})
    num_envs: int = field(default=4, metadata={"help": "envs stepped together"})
    frames_per_batch: int = field(default=1_000, metadata={"help": "frames per batch"})
    buffer_size: int = field(default=10_000, metadata={"help": "replay buffer capacity (transitions)"})
    batch_size: int = field(default=128, metadata={"help": "transitions per training step"})
    updates_per_batch: int = field(default=4, metadata={"help": "training steps per batch"})
    checkpoint: str = field(default="long_run.pt", metadata={"help": "checkpoint file (resumed if there)"})
    checkpoint_every: int = field(default=5, metadata={"help": "batches between checkpoints"})
    env_state: bool = field(default=True, metadata={"help": "save the envs' state (exact resume)"})
    seed: int = field(default=1, metadata={"help": "seeds the envs, the policy and the buffer"})
    uvloop: bool = field(default=False, metadata={"help": "run the asyncio loop on uvloop"})
    trio: bool = field(default=False, metadata={"help": "run on trio instead of asyncio"})


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


class ReplayBuffer:
    """A ring buffer of transitions; ``state_dict()`` / ``load_state_dict()`` for the checkpoint."""

    def __init__(self, capacity: int, seed: int) -> None:
        self.capacity = capacity
        self.storage: TensorDictBase | None = None
        self.cursor = self.size = 0
        self.generator = torch.Generator().manual_seed(seed)

    def extend(self, transitions: TensorDictBase) -> None:
        n = transitions.batch_size[0]
        if self.storage is None:
            self.storage = transitions[0].expand(self.capacity).clone()
        self.storage[(self.cursor + torch.arange(n)) % self.capacity] = transitions
        self.cursor = (self.cursor + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, n: int) -> TensorDictBase:
        assert self.storage is not None
        return self.storage[torch.randint(self.size, (n,), generator=self.generator)]

    def state_dict(self) -> dict[str, Any]:
        storage = None if self.storage is None else self.storage[: self.size].to_dict()
        rng = self.generator.get_state()
        return {"storage": storage, "cursor": self.cursor, "size": self.size, "generator": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor, self.size = state["cursor"], state["size"]
        self.generator.set_state(state["generator"])
        if state["storage"] is not None:
            saved = TensorDict(state["storage"], batch_size=[self.size])
            self.storage = saved[0].expand(self.capacity).clone()
            self.storage[: self.size] = saved


class CategoricalMLP(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, n_actions))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = torch.distributions.Categorical(logits=self.net(observation)).sample()
        return action


def train_step(policy: CategoricalMLP, optimizer: torch.optim.Optimizer, sample: TensorDictBase) -> float:
    """A pretend update (behaviour cloning of the sampled actions), standing in for DQN/SAC."""
    loss = F.cross_entropy(policy.net(sample["observation"]), sample["action"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def load_if_there(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (weights only: no code runs while it loads), or ``None``; a truncated
    file is named (``CheckpointError``)."""
    return load_checkpoint(path) if path.exists() else None


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    path = Path(args.checkpoint)
    probe = GymEnv(args.env_id)
    policy = CategoricalMLP(probe.observation_space.shape[0], int(probe.action_space.n))  # type: ignore[attr-defined,index]
    probe.close()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    buffer = ReplayBuffer(args.buffer_size, args.seed)
    collector = Collector(
        lambda: GymEnv(args.env_id, num_envs=args.num_envs),
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        seed=args.seed,
    )
    batches = updates = resumed_frames = 0
    loss = float("nan")

    async def checkpoint() -> None:
        state = {
            "collector": await collector.state_dict(envs=args.env_state),
            "policy": policy.state_dict(),
            "optimizer": optimizer.state_dict(),
            "buffer": buffer.state_dict(),
            "trainer": {"batches": batches, "updates": updates, "torch_rng": torch.get_rng_state()},
        }
        await anyio.to_thread.run_sync(save_checkpoint, state, path)  # atomic; a large buffer: off the loop
        print(f"checkpoint at {state['collector']['frames']} frames", flush=True)

    start = time.perf_counter()
    async with collector, stop_on_signals(collector) as stop:
        saved = await anyio.to_thread.run_sync(load_if_there, path)
        if saved is not None:  # the same command again: resume
            policy.load_state_dict(saved["policy"])
            optimizer.load_state_dict(saved["optimizer"])
            buffer.load_state_dict(saved["buffer"])
            await collector.load_state_dict(saved["collector"])
            batches, updates = saved["trainer"]["batches"], saved["trainer"]["updates"]
            torch.set_rng_state(saved["trainer"]["torch_rng"])
            resumed_frames = saved["collector"]["frames"]
            print(f"resumed from {path} at {saved['collector']['frames']} frames, {batches} batches")
        async for batch in collector:
            buffer.extend(batch.reshape(-1))
            for _ in range(args.updates_per_batch):
                loss = await anyio.to_thread.run_sync(
                    train_step, policy, optimizer, buffer.sample(args.batch_size)
                )
                updates += 1
            await collector.update_weights(policy)
            batches += 1
            if batches % args.checkpoint_every == 0:
                await checkpoint()
        await checkpoint()  # the last batch trained on, whether the run ended or was stopped
        stats = collector.statistics()
    elapsed = time.perf_counter() - start

    how = f"stopped by {stop.received.name}" if stop.received is not None else "done"
    print(
        f"{how}: checkpoint {path} at {stats.frames} frames, {batches} batches, {updates} updates, "
        f"loss {loss:.3f}"
    )
    frames = stats.frames - resumed_frames
    print(f"{frames} frames in {elapsed:.2f} s this run: {frames / elapsed:,.0f} frames/s")
    mean_return = "n/a" if stats.mean_return is None else f"{stats.mean_return:.1f}"
    print(f"{stats.episodes} episodes, mean return of the last 100: {mean_return}")


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(1)
    if args.trio:
        anyio.run(main, args, backend="trio")
    else:
        anyio.run(main, args, backend="asyncio", backend_options={"use_uvloop": args.uvloop})
    # Everything is saved and closed: the interpreter's exit need not scan every object for garbage
    # (with torch imported that final collection takes most of the second after the run, more under
    # load: the scheduler's grace period counts it). Frozen objects are left out of it.
    gc.freeze()
