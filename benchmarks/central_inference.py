"""Central inference (issue 31): ``AsyncEnvCollector`` over ``ProcessVectorEnv`` (the envs step in 2 worker
processes, one policy in the trainer batches the ready workers' observations) against
``MultiAsyncCollector`` (the same envs in 2 worker processes, a copy of the policy in each).

    python benchmarks/central_inference.py               # 3 interleaved rounds, both policies
    python benchmarks/central_inference.py --quick       # smoke run
    python benchmarks/central_inference.py --components  # the trainer's CPU per policy call, by piece

The envs: 2 workers x 64 CartPole-v1 (``gym.make_vec``'s numpy-vectorised CartPole, the same vector env in
both collectors) with a 2x64 MLP and a 3x512 MLP (argmax of 2 logits), or (``--env pong``) 2 workers x 8
ALE/Pong-v5 with a small CNN on the uint8 frames. Variants per round, in turn: ``central``
(``AsyncEnvCollector(env.split(), min_batch=64)``: the policy runs on whichever worker is ready; the fused
path), ``central-engine`` (the same with ``fused=False``: the engine on the loop), ``central-whole``
(``AsyncEnvCollector([env])``: one policy call on all 128 envs per step), ``loop``, ``pipe`` and ``bound``
(upper bounds of the transport, of ``split()`` with a task per part, and of the fused path: see each
function) and ``multi`` (``MultiAsyncCollector``, 1 torch thread per worker). The trainer's torch runs 1
thread (which the collector's threads inherit), ``NAME@N`` (e.g. ``central-whole@2``) runs a variant with
N: a batched forward pass on every core. Each skips its first two batches and times ``--frames``.
Printed per variant: frames/s (median of rounds), the median of the per-round ratios to ``multi``, CPU µs
per frame of all processes (the trainer and its children: user + system from ``/proc``), the policy's
batch sizes p5/p50/p95 (``multi``: always its worker's 64), and the round trip from an observation written
to its action read, p50/p99, timed inside the worker by a wrapper around its vector env (the time between
two of its steps: the obs written, the doorbell, the trainer's collector and the policy's forward pass,
the actions read); the forward pass alone is printed beside it. The machine may be shared: the load
average is printed, compare ratios within one run.

``--components`` times the trainer's side of one policy call over 64 envs, in CPU µs of the trainer
process (median of rounds): a ``split()`` part's step without a policy (the doorbell, the results),
``AsyncEnvCollector`` over two in-process vector envs of 64 whose step returns at once (the engine, the
policy thread's hand-off and the 2x64 MLP's forward pass), that forward pass alone, and the policy thread's
hand-off alone (``hop``: an empty call through it; CPU µs of both threads, and its wall time p50/p99).
"""

from __future__ import annotations

import argparse
import functools
import os
import select
import statistics
import tempfile
import time
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import gymnasium as gym
import numpy as np
import psutil
import torch
from torch import nn

from aiocollect import AsyncEnvCollector, GymEnv, MultiAsyncCollector, ProcessVectorEnv


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        n = 4
        for _ in range(depth):
            layers += [nn.Linear(n, width), nn.Tanh()]
            n = width
        self.net = nn.Sequential(*layers, nn.Linear(n, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


class CNN(nn.Module):
    """A small Atari CNN on uint8 frames ``[N, 210, 160, 3]`` (argmax of 6 logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(32 * 16, 6),
        )

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation.permute(0, 3, 1, 2).float() / 255).argmax(-1)


#: per env: (gymnasium id, sub-envs per worker, an observation for the forward pass alone)
ENVS = {
    "cartpole": ("CartPole-v1", 64, (4,), torch.float32),
    "pong": ("ALE/Pong-v5", 8, (210, 160, 3), torch.uint8),
}


class Timed(gym.vector.VectorWrapper):
    """Records the time between the end of a step and the start of the next (the obs-to-action round
    trip as the env sees it) and writes the samples (µs) to ``folder`` when closed."""

    def __init__(self, env: gym.vector.VectorEnv, folder: str) -> None:
        super().__init__(env)
        self.folder, self.samples, self.last = folder, [], 0.0

    def step(self, actions: Any) -> Any:
        now = time.perf_counter()
        if self.last:
            self.samples.append(1e6 * (now - self.last))
        out = self.env.step(actions)
        self.last = time.perf_counter()
        return out

    def reset(self, **kwargs: Any) -> Any:
        self.last = 0.0
        return self.env.reset(**kwargs)

    def close(self, **kwargs: Any) -> None:
        np.save(os.path.join(self.folder, f"{os.getpid()}_{id(self)}.npy"), np.asarray(self.samples))
        self.env.close(**kwargs)


def vec64(folder: str, env: str = "cartpole") -> gym.vector.VectorEnv:
    """One worker's vector env (64 CartPoles, or 8 Pongs), timed."""
    name, n, _, _ = ENVS[env]
    if env == "cartpole":  # its numpy-vectorised vector env
        return Timed(gym.make_vec(name, num_envs=n), folder)
    import ale_py

    gym.register_envs(ale_py)
    return Timed(gym.make_vec(name, num_envs=n, vectorization_mode="sync"), folder)


def gym_vec64(folder: str, env: str = "cartpole") -> GymEnv:
    return GymEnv(vec64(folder, env))


def cpu_seconds() -> np.ndarray:
    """User + system CPU seconds of this process and of every process below it, and of this process
    alone (the trainer: its loop and policy threads)."""
    total = 0.0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return np.array([total, time.process_time()])


async def timed(collector: Any, frames: int) -> tuple[float, np.ndarray, list[int]]:
    """Frames/s and CPU µs/frame over ``frames`` frames after the first two batches; the policy's batch
    sizes (an ``AsyncEnvCollector``'s)."""
    async with collector:
        it = aiter(collector)
        await anext(it)
        await anext(it)
        cpu0, start, got = cpu_seconds(), time.perf_counter(), 0
        sizes0 = len(getattr(collector, "policy_batch_sizes", []))
        while got < frames:
            got += (await anext(it)).numel()
        elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
        sizes = list(getattr(collector, "policy_batch_sizes", []))[sizes0:]
    return got / elapsed, 1e6 * cpu / got, sizes


async def plain_loop(
    env: ProcessVectorEnv, policy: nn.Module, frames: int
) -> tuple[float, np.ndarray, list[int]]:
    """The transport's upper bound: the policy on all 128 observations, inline, then one ``await step``;
    nothing stored (timed after 20 steps)."""
    obs, _ = await env.reset(seed=0)
    got, start, cpu0 = 0, 0.0, np.zeros(2)
    for i in range(20 + frames // env.num_envs):
        if i == 20:
            got, start, cpu0 = 0, time.perf_counter(), cpu_seconds()
        with torch.no_grad():
            actions = policy(torch.from_numpy(obs)).numpy()
        obs, *_ = await env.step(actions)
        got += env.num_envs
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    return got / elapsed, 1e6 * cpu / got, [env.num_envs]


async def pipelined(
    env: ProcessVectorEnv, policy: nn.Module, frames: int
) -> tuple[float, np.ndarray, list[int]]:
    """``split()``'s upper bound: one task per part, each running the policy on its part's observations
    inline, then ``await part.step``; nothing stored (timed after 20 steps of each part)."""
    parts = env.split()
    got, start, cpu0 = [0], [0.0], [np.zeros(2)]
    started = anyio.Event()

    async def drive(part: Any, seed: int) -> None:
        obs, _ = await part.reset(seed=seed)
        for _ in range(20):
            with torch.no_grad():
                actions = policy(torch.from_numpy(obs)).numpy()
            obs, *_ = await part.step(actions)
        if not started.is_set():
            start[0], cpu0[0] = time.perf_counter(), cpu_seconds()
            started.set()
        while got[0] < frames:
            with torch.no_grad():
                actions = policy(torch.from_numpy(obs)).numpy()
            obs, *_ = await part.step(actions)
            got[0] += part.num_envs

    try:
        async with anyio.create_task_group() as tg:
            for k, part in enumerate(parts):
                tg.start_soon(drive, part, 1000 * k)
        elapsed, cpu = time.perf_counter() - start[0], cpu_seconds() - cpu0[0]
    finally:
        for part in parts:
            await part.close()
    return got[0] / elapsed, 1e6 * cpu / got[0], [parts[0].num_envs]


async def fused_bound(
    env: ProcessVectorEnv, policy: nn.Module, frames: int
) -> tuple[float, np.ndarray, list[int]]:
    """The bound of a fused central-inference path (not built, docs/async-envs.md): ONE thread (not the
    loop) drives both workers through their doorbells (``select`` on their sockets, private internals of
    ``ProcessVectorEnv``), and for whichever is ready stores its observations and rewards into a
    ``[T, 64]`` batch, runs the policy and rings it back; the loop only awaits the thread. Observation
    fields only, no flags, ids or TensorDict (timed after 20 steps of each worker)."""
    await env.reset(seed=0)
    workers = env._workers  # a bound, measured on the transport's own slots
    for worker in workers:
        worker.reader.unwatch()  # the thread reads the replies, not the loop
    steps = 64

    def run() -> tuple[float, np.ndarray, int]:
        by_fd = {w.sock.fileno(): w for w in workers}
        store = {}
        for fd, worker in by_fd.items():
            obs0 = worker.slots.obs["observation"]
            store[fd] = (np.empty((steps, *obs0.shape), obs0.dtype), np.empty((steps, len(obs0)), np.float32))
        n = len(workers[0].slots.obs["observation"])
        t = dict.fromkeys(by_fd, 0)
        got, start, cpu0 = -20 * n * len(workers), 0.0, np.zeros(2)

        def act(fd: int) -> None:
            slots = by_fd[fd].slots
            obs = slots.obs["observation"]
            buf_obs, buf_rew = store[fd]
            buf_obs[t[fd] % steps], buf_rew[t[fd] % steps] = obs, slots.reward
            t[fd] += 1
            with torch.no_grad():
                slots.actions["action"][...] = policy(torch.from_numpy(obs)).numpy()
            by_fd[fd].sock.send(b"S")

        for fd in by_fd:
            act(fd)
        while got < frames:
            ready, _, _ = select.select(list(by_fd), [], [])
            for fd in ready:
                if by_fd[fd].sock.recv(1) != b"D":
                    raise RuntimeError("a worker failed")
                got += n
                if got == 0:
                    start, cpu0 = time.perf_counter(), cpu_seconds()
                act(fd)
        elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
        for fd in by_fd:  # the replies in flight
            select.select([fd], [], [])
            by_fd[fd].sock.recv(1)
        return elapsed, cpu, got

    elapsed, cpu, got = await anyio.to_thread.run_sync(run)
    return got / elapsed, 1e6 * cpu / got, [len(workers[0].slots.obs["observation"])]


def round_trips(folder: str) -> list[float]:
    out: list[float] = []
    for name in os.listdir(folder):
        out += np.load(os.path.join(folder, name))[10:].tolist()  # past the start-up
        os.remove(os.path.join(folder, name))
    return out


def forward_us(policy: nn.Module, n: int, env: str = "cartpole") -> float:
    _, _, shape, dtype = ENVS[env]
    obs = (
        torch.randn(n, *shape) if dtype == torch.float32 else torch.randint(0, 255, (n, *shape), dtype=dtype)
    )
    times = []
    with torch.no_grad():
        for _ in range(200):
            start = time.perf_counter()
            policy(obs)
            times.append(1e6 * (time.perf_counter() - start))
    return statistics.median(times)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


KINDS = ["central", "central-engine", "central-whole", "loop", "pipe", "bound", "multi"]


def parse_variant(name: str) -> tuple[str, int]:
    """``central-whole@2`` -> ``("central-whole", 2)``: the variant with the trainer's torch at 2 threads
    (its intra-op threads, which the collector's own threads inherit); 1 thread without a suffix."""
    kind, _, threads = name.partition("@")
    if kind not in KINDS or (threads and not threads.isdigit()):
        raise SystemExit(f"unknown variant {name!r}: one of {KINDS}, each optionally @THREADS")
    return kind, int(threads or 1)


async def variant(name: str, policy: nn.Module, args: argparse.Namespace, r: int, folder: str) -> Any:
    kind, threads = parse_variant(name)
    torch.set_num_threads(threads)
    try:
        return await _variant(kind, policy, args, r, folder)
    finally:
        torch.set_num_threads(1)


async def _variant(kind: str, policy: nn.Module, args: argparse.Namespace, r: int, folder: str) -> Any:
    fns = [functools.partial(vec64, folder, args.env)] * 2
    per_worker = ENVS[args.env][1]
    if kind == "multi":
        collector: Any = MultiAsyncCollector(
            [functools.partial(gym_vec64, folder, args.env)] * 2,
            policy,
            frames_per_batch=args.frames_per_batch,
            seed=r,
        )
        out = await timed(collector, args.frames)
        return (*out[:2], [per_worker]), round_trips(folder)
    env = await anyio.to_thread.run_sync(functools.partial(ProcessVectorEnv, fns, num_workers=2))
    if kind in ("loop", "pipe", "bound"):
        try:
            out = await {"loop": plain_loop, "pipe": pipelined, "bound": fused_bound}[kind](
                env, policy, args.frames
            )
        finally:
            await env.close()
        return out, round_trips(folder)
    envs = env.split() if kind in ("central", "central-engine") else [env]
    collector = AsyncEnvCollector(
        envs,
        policy,
        frames_per_batch=args.frames_per_batch,
        min_batch=per_worker,
        seed=r,
        fused=kind != "central-engine",
    )
    out = await timed(collector, args.frames)
    return out, round_trips(folder)


async def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    policies = {"2x64 MLP": MLP(64, 2), "3x512 MLP": MLP(512, 3)}
    policies = {name: p for name, p in policies.items() if name.split()[0] in args.policies.split(",")}
    if args.env == "pong":
        policies = {"cnn": CNN()}
    kinds = args.variants.split(",")
    for name in kinds:
        parse_variant(name)
    if "multi" not in kinds:
        raise SystemExit("--variants must include multi (the ratios' reference)")
    rows: dict[tuple[str, str], dict[str, list[Any]]] = {
        (p, k): {"fps": [], "cpu": [], "own": [], "sizes": [], "rtt": [], "ratio": []}
        for p in policies
        for k in kinds
    }
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for pname, policy in policies.items():
                fps = {}
                for kind in kinds:
                    (f, cpu, sizes), rtt = await variant(kind, policy, args, r, folder)
                    row = rows[(pname, kind)]
                    fps[kind] = f
                    row["fps"].append(f)
                    row["cpu"].append(cpu[0])
                    row["own"].append(cpu[1])
                    row["sizes"] += sizes
                    row["rtt"] += rtt
                    print(
                        f"round {r} {pname:9} {kind:13} {f:9,.0f} frames/s {cpu[0]:6.1f} CPU-µs/frame "
                        f"(trainer {cpu[1]:4.1f})",
                        flush=True,
                    )
                for kind in kinds:
                    rows[(pname, kind)]["ratio"].append(fps[kind] / fps["multi"])
            load.append(os.getloadavg()[0])
    print(
        f"\nload average (1 min) during the run: {min(load):.1f} to {max(load):.1f}; {os.cpu_count()} cores"
    )
    print(
        "| policy | variant | frames/s (median) | x multi (median of rounds) | CPU µs/frame (trainer) | "
        "policy batch p5/p50/p95 | obs-to-action p50 / p99 µs | forward µs (batch) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (pname, kind), row in rows.items():
        sizes = row["sizes"]
        base, threads = parse_variant(kind)
        batch = ENVS[args.env][1] * (2 if base in ("central-whole", "loop") else 1)
        torch.set_num_threads(threads)
        fwd = forward_us(policies[pname], batch, args.env)
        torch.set_num_threads(1)
        fps, ratio, cpu, own = (statistics.median(row[k]) for k in ("fps", "ratio", "cpu", "own"))
        print(
            f"| {pname} | {kind} | {fps:,.0f} | {ratio:.2f} | {cpu:.1f} ({own:.1f}) | "
            f"{pct(sizes, 5):.0f}/{pct(sizes, 50):.0f}/{pct(sizes, 95):.0f} | "
            f"{pct(row['rtt'], 50):.0f} / {pct(row['rtt'], 99):.0f} | {fwd:.0f} ({batch}) |"
        )


class Instant:
    """An async vector env of 64 CartPole-like sub-envs whose step returns at once (one sub-env ends per
    step): the engine's own cost."""

    num_envs = 64
    single_observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    single_action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.rng, self.t = np.random.default_rng(0), 0

    async def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        return self.rng.standard_normal((64, 4), dtype=np.float32), {}

    async def step(self, actions: Any) -> Any:
        await anyio.lowlevel.checkpoint()
        self.t += 1
        obs = self.rng.standard_normal((64, 4), dtype=np.float32)
        ended = np.zeros(64, bool)
        ended[self.t % 64] = True
        final = np.empty(64, object)
        final[self.t % 64] = obs[self.t % 64]
        return obs, np.ones(64), ended, np.zeros(64, bool), {"final_obs": final, "_final_obs": ended}

    async def close(self) -> None:
        pass


async def components(rounds: int) -> None:
    torch.set_num_threads(1)
    policy, steps = MLP(64, 2), 2000
    out: dict[str, list[float]] = {"part step": [], "engine + policy": [], "forward": [], "hop": []}
    hop_wall: list[float] = []
    for _ in range(rounds):
        out["hop"].append(await hop(policy, hop_wall))
        env = await anyio.to_thread.run_sync(
            functools.partial(ProcessVectorEnv, [vec64_plain] * 2, num_workers=2)
        )
        part = env.split()
        try:
            await part[0].reset(seed=0)
            actions = np.zeros(64, np.int64)
            for i in range(steps + 100):
                if i == 100:
                    cpu0 = time.process_time()
                await part[0].step(actions)
            out["part step"].append(1e6 * (time.process_time() - cpu0) / steps)
        finally:
            for p in part:
                await p.close()
        collector = AsyncEnvCollector([Instant, Instant], policy, frames_per_batch=2560, min_batch=64, seed=0)
        async with collector:
            it = aiter(collector)
            await anext(it)
            cpu0 = time.process_time()
            for _ in range(40):
                await anext(it)
            frames = 40 * 2560
            out["engine + policy"].append(1e6 * (time.process_time() - cpu0) / frames * 64)
        cpu0 = time.process_time()
        forward_us(policy, 64)
        out["forward"].append((time.process_time() - cpu0) * 1e6 / 200)
    print(f"trainer CPU µs per policy call of 64 envs (median of {rounds}); load {os.getloadavg()[0]:.1f}")
    for name, values in out.items():
        print(f"  {name:16} {statistics.median(values):7.1f}   ({', '.join(f'{v:.0f}' for v in values)})")
    print(f"  hop wall p50 / p99 µs: {pct(hop_wall, 50):.0f} / {pct(hop_wall, 99):.0f}")


async def hop(policy: nn.Module, wall: list[float], calls: int = 2000) -> float:
    """The policy thread's hand-off alone: CPU µs of the trainer (both threads) per empty call through
    ``AsyncEnvCollector``'s policy thread, and each call's wall time (into ``wall``)."""
    from tensordict.nn import InteractionType

    from aiocollect._asyncenv._policy import BatchPolicy

    space = gym.spaces.Discrete(2)
    mode = InteractionType.MODE
    batch = BatchPolicy(
        policy, action_space=space, obs_keys=["observation"], exploration_type=mode, name="hop"
    )
    batch.start()
    try:
        for i in range(calls + 100):
            if i == 100:
                cpu0 = time.process_time()
            start = time.perf_counter()
            await batch.in_thread(int)
            if i >= 100:
                wall.append(1e6 * (time.perf_counter() - start))
        return 1e6 * (time.process_time() - cpu0) / calls
    finally:
        await batch.stop()


def vec64_plain() -> gym.vector.VectorEnv:
    return gym.make_vec("CartPole-v1", num_envs=64)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--frames-per-batch", type=int, default=2560)
    parser.add_argument("--quick", action="store_true", help="1 round of 20,000 frames")
    parser.add_argument("--policies", default="2x64,3x512", help="comma-separated: 2x64, 3x512 (CartPole)")
    parser.add_argument(
        "--env",
        default="cartpole",
        choices=sorted(ENVS),
        help="2 x 64 CartPole-v1, or 2 x 8 ALE/Pong-v5 with a small CNN",
    )
    parser.add_argument(
        "--variants",
        default="central,central-engine,central-whole,loop,pipe,bound,multi",
        help="comma-separated, in the order they run; multi always; NAME@N runs NAME with the trainer's "
        "torch at N threads (default 1; multi's workers have 1 each)",
    )
    parser.add_argument("--uvloop", action="store_true", help="the trainer's loop on uvloop")
    parser.add_argument("--components", action="store_true", help="the trainer's CPU per call, by piece")
    args = parser.parse_args()
    if args.components:
        anyio.run(components, args.rounds, backend_options={"use_uvloop": True} if args.uvloop else {})
        return
    if args.quick:
        args.rounds, args.frames = 1, 20_000
    anyio.run(run, args, backend_options={"use_uvloop": True} if args.uvloop else {})


if __name__ == "__main__":
    main()
