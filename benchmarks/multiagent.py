"""``PettingZooEnv`` and ``VmasEnv`` against a raw loop and against TorchRL's collector (issue 41).

    python benchmarks/multiagent.py                    # simple_spread, 4 copies; VMAS balance, 32 worlds
    python benchmarks/multiagent.py --quick            # a smoke run
    python benchmarks/multiagent.py --torchrl          # also TorchRL's collectors (torchrl 0.14 installed)

Three variants per env, in interleaved rounds, random actions:

* ``raw``: the env's own loop that stores the keys a batch has (every group's observations, actions,
  rewards and flags, next observations, the global state) into preallocated arrays, with the random
  actions drawn by torch as the collector draws them;
* ``aiocollect``: ``Collector(PettingZooEnv(...))`` / ``Collector(VmasEnv(...))``, batches of
  ``--frames-per-batch`` frames;
* ``torchrl``: ``torchrl.collectors.Collector`` over ``PettingZooWrapper`` / torchrl's ``VmasEnv``
  (``--torchrl``).

CPU-µs per frame is ``time.process_time`` (every thread of this process) over a round; the ratios are the
medians of per-round ratios (``raw / aiocollect`` of CPU per frame: 1.0 means no overhead; ``aiocollect /
torchrl`` of frames/s). The process runs torch on one thread, as a user's script does.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import anyio
import numpy as np
import torch

from aiocollect import Collector, PettingZooEnv, VmasEnv

torch.set_num_threads(1)


def spread(copies: int) -> list[Any]:
    from mpe2 import simple_spread_v3

    return [simple_spread_v3.parallel_env(max_cycles=25) for _ in range(copies)]


def raw_pettingzoo(copies: int, steps: int) -> int:
    """PettingZoo's parallel loop over ``copies`` envs, each step's keys stored, random actions by torch."""
    envs = spread(copies)
    agents = envs[0].possible_agents
    n, obs_dim = len(agents), envs[0].observation_space(agents[0]).shape[0]
    state_dim = envs[0].state_space.shape[0]
    store = {
        name: np.zeros((steps, copies, *shape), dtype)
        for name, shape, dtype in [
            ("obs", (n, obs_dim), np.float32),
            ("next_obs", (n, obs_dim), np.float32),
            ("action", (n,), np.int64),
            ("reward", (n, 1), np.float32),
            ("terminated", (n, 1), bool),
            ("truncated", (n, 1), bool),
            ("done", (n, 1), bool),
            ("state", (state_dim,), np.float32),
            ("next_state", (state_dim,), np.float32),
        ]
    }
    current = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
    for t in range(steps):
        actions = torch.randint(5, (copies, n)).numpy()
        for i, env in enumerate(envs):
            for j, agent in enumerate(agents):
                store["obs"][t, i, j] = current[i][agent]
            store["state"][t, i] = env.state()
            obs, rew, term, trunc, _ = env.step({a: int(actions[i, j]) for j, a in enumerate(agents)})
            store["action"][t, i] = actions[i]
            for j, agent in enumerate(agents):
                store["next_obs"][t, i, j] = obs[agent]
                store["reward"][t, i, j, 0] = rew[agent]
                store["terminated"][t, i, j, 0] = term[agent]
                store["truncated"][t, i, j, 0] = trunc[agent]
                store["done"][t, i, j, 0] = term[agent] or trunc[agent]
            store["next_state"][t, i] = env.state()
            current[i] = env.reset()[0] if not env.agents else obs
    return steps * copies


def raw_vmas(worlds: int, steps: int) -> int:
    import vmas

    env = vmas.make_env("balance", num_envs=worlds, max_steps=100, terminated_truncated=True, seed=0)
    n = env.n_agents
    obs_dim = env.observation_space[0].shape[0]
    low, high = torch.as_tensor(env.action_space[0].low), torch.as_tensor(env.action_space[0].high)
    store = {
        "obs": torch.zeros(steps, worlds, n, obs_dim),
        "next_obs": torch.zeros(steps, worlds, n, obs_dim),
        "action": torch.zeros(steps, worlds, n, 2),
        "reward": torch.zeros(steps, worlds, n, 1),
        "done": torch.zeros(steps, worlds, 1, dtype=torch.bool),
    }
    current = torch.stack(env.reset(), dim=1)
    for t in range(steps):
        store["obs"][t] = current
        action = low + torch.rand(worlds, n, 2) * (high - low)
        store["action"][t] = action
        obs, rew, terminated, truncated, _ = env.step([action[:, j] for j in range(n)])
        store["next_obs"][t] = nxt = torch.stack(obs, dim=1)
        store["reward"][t] = torch.stack(rew, dim=1).unsqueeze(-1)
        done = terminated | truncated
        store["done"][t, :, 0] = done
        if done.all():
            env.reset(return_observations=False)
        else:
            for i in torch.nonzero(done).flatten().tolist():
                env.reset_at(i, return_observations=False)
        current = (
            torch.stack(env.get_from_scenario(True, False, False, False)[0], dim=1) if done.any() else nxt
        )
    return steps * worlds


async def ours(make: Any, frames: int, fpb: int) -> int:
    async with Collector(make, frames_per_batch=fpb, total_frames=frames, seed=0) as collector:
        got = 0
        async for batch in collector:
            got += batch.numel()
    return got


def torchrl_pettingzoo(copies: int, frames: int, fpb: int) -> int:
    from torchrl.collectors import Collector as TorchRLCollector
    from torchrl.envs import SerialEnv
    from torchrl.envs.libs.pettingzoo import PettingZooWrapper

    def make() -> Any:
        return PettingZooWrapper(spread(1)[0], return_state=True)

    env = SerialEnv(copies, make) if copies > 1 else make()
    return _torchrl(TorchRLCollector(env, None, frames_per_batch=fpb, total_frames=frames))


def torchrl_vmas(worlds: int, frames: int, fpb: int) -> int:
    from torchrl.collectors import Collector as TorchRLCollector
    from torchrl.envs.libs.vmas import VmasEnv as TorchRLVmasEnv

    env = TorchRLVmasEnv("balance", num_envs=worlds, max_steps=100, seed=0)
    return _torchrl(TorchRLCollector(env, None, frames_per_batch=fpb, total_frames=frames))


def _torchrl(collector: Any) -> int:
    got = 0
    try:
        for batch in collector:
            got += batch.numel()
    finally:
        collector.shutdown()
    return got


def measure(run: Any) -> tuple[float, float]:
    """``(CPU-µs per frame, frames/s)`` of ``run()`` (which returns the frames it collected)."""
    cpu, wall = time.process_time(), time.perf_counter()
    frames = run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu / frames * 1e6, frames / wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--frames", type=int, default=4000, help="frames per PettingZoo round")
    parser.add_argument("--copies", type=int, default=4, help="PettingZoo copies (batch size)")
    parser.add_argument("--worlds", type=int, default=32, help="VMAS worlds")
    parser.add_argument("--torchrl", action="store_true", help="also TorchRL's collectors (torchrl 0.14)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 800 frames")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.frames = 2, 800
    warnings.filterwarnings("ignore")  # torchrl's PettingZoo version notice, pygame's greeting
    copies, worlds, frames = args.copies, args.worlds, args.frames
    vmas_frames = frames * 8
    fpb = copies * 100
    cases = {
        "simple_spread": {
            "raw": lambda: raw_pettingzoo(copies, frames // copies),
            "aiocollect": lambda: anyio.run(
                ours, lambda: PettingZooEnv(lambda: spread(1)[0], num_envs=copies), frames, fpb
            ),
        },
        "vmas balance": {
            "raw": lambda: raw_vmas(worlds, vmas_frames // worlds),
            "aiocollect": lambda: anyio.run(
                ours, lambda: VmasEnv("balance", num_envs=worlds, max_steps=100), vmas_frames, worlds * 50
            ),
        },
    }
    if args.torchrl:
        cases["simple_spread"]["torchrl"] = lambda: torchrl_pettingzoo(copies, frames, fpb)
        cases["vmas balance"]["torchrl"] = lambda: torchrl_vmas(worlds, vmas_frames, worlds * 50)
    for name, variants in cases.items():
        for run in variants.values():  # warm-up: imports, first resets
            run()
        results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant, run in variants.items():
                results[variant].append(measure(run))
        print(f"\n{name} ({args.rounds} rounds, interleaved)")
        print(f"{'variant':<12} {'CPU-us/frame':>14} {'frames/s':>12}")
        for variant, values in results.items():
            cpu = statistics.median(v[0] for v in values)
            fps = statistics.median(v[1] for v in values)
            print(f"{variant:<12} {cpu:>14.1f} {fps:>12.0f}")
        raw, mine = results["raw"], results["aiocollect"]
        ratio = statistics.median(r[0] / m[0] for r, m in zip(raw, mine, strict=True))
        print(f"raw / aiocollect, CPU per frame (median of per-round ratios): {ratio:.2f}")
        if "torchrl" in results:
            theirs = results["torchrl"]
            speed = statistics.median(m[1] / t[1] for m, t in zip(mine, theirs, strict=True))
            print(f"aiocollect / torchrl, frames/s (median of per-round ratios): {speed:.2f}")


if __name__ == "__main__":
    main()
