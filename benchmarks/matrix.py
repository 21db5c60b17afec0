"""Benchmark matrix (issue 12): aiocollect's collectors on the workloads users run, against the raw
gymnasium loop (the limit) and TorchRL's collectors, measured in one run with rounds interleaved.

``nox -s bench`` or ``python benchmarks/matrix.py [--quick] [--markdown] [filters]``; see
docs/benchmarks.md for the method. Cells: env x number of envs x policy; in each cell every variant
(raw loop, each collector, TorchRL's collectors where ``torchrl`` imports) is measured once per round,
idle and with a "busy trainer" thread, the order rotated every round.

Like a user's script, this process calls ``torch.set_num_threads(1)`` first thing (below the imports).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import psutil
import torch
from gymnasium.vector import AutoresetMode
from tensordict.nn import (
    NormalParamExtractor,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictSequential,
)
from torch import nn

# What a user's training script does first: one intra-op thread for this process.
torch.set_num_threads(1)

ENVS = ("CartPole-v1", "Pendulum-v1", "HalfCheetah-v5", "ALE/Pong-v5")
NUM_ENVS = (1, 8, 32)
#: near-free envs (issue 34): EnvPool's C++ pools, measured with their own numbers of envs (not by default)
POOL_ENVS = ("EnvPool/CartPole-v1",)
POOL_NUM_ENVS = (256, 1024)
POLICIES = ("module", "tdseq", "prob", "random", "cnn")
#: the policies a cell runs unless named (``cnn``, a conv net on pixels only, when named: issue 42)
DEFAULT_POLICIES = ("module", "tdseq", "prob", "random")
#: the raw loops: ``bare`` steps and stores nothing (the limit of issue 12), ``store`` writes every key a
#: batch holds into preallocated arrays (the limit of issue 42)
RAW_KINDS = ("bare", "store")
COLLECTORS = ("collector", "multisync", "multiasync")
WORKERS = 2
#: steps per env in one batch (of one worker): frames per batch = steps x envs (pixels: smaller batches)
STEPS = {1: 256, 8: 128, 32: 64, 256: 64, 1024: 16}
PIXEL_STEPS = {1: 64, 8: 16, 32: 8}
HIDDEN = 64
#: the pixel encoder: every 5th row and column, grey (mean of RGB), / 255, flattened: 42 x 32 = 1344 inputs
PIXEL_STRIDE = 5
ME = psutil.Process()
#: ``--limits`` (issue 42): the cells where the collectors' own cost showed against the limit, each with its
#: collectors, measured against the raw loop that stores every key a batch holds
LIMIT_CELLS: tuple[tuple[str, int, str, tuple[str, ...]], ...] = (
    ("ALE/Pong-v5", 8, "cnn", COLLECTORS),
    ("ALE/Pong-v5", 1, "random", ("collector",)),
    ("CartPole-v1", 8, "tdseq", COLLECTORS),
)


def is_pixels(env_id: str) -> bool:
    return env_id.startswith("ALE/")


def is_pool(env_id: str) -> bool:
    return env_id.startswith("EnvPool/")


def gym_id(env_id: str) -> str:
    """The gymnasium id of an env (an EnvPool task has gymnasium's spaces)."""
    return env_id.removeprefix("EnvPool/")


def make_pool(env_id: str, num_envs: int) -> Any:
    """``envpool.make_gymnasium(task, num_envs=N, seed=0)`` (its spaces' float64-bounds warnings hushed)."""
    import warnings

    import envpool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = envpool.make_gymnasium(gym_id(env_id), num_envs=num_envs, seed=0)
        pool.observation_space, pool.action_space  # noqa: B018 (the spaces warn when first read)
    return pool


def _mujoco_warning(message: str) -> None:
    # mujoco 4 deprecates an attribute of gymnasium's HalfCheetah model; its default handler would write
    # MUJOCO_LOG.TXT into the working directory
    if "settotalmass" not in message:
        print(f"MuJoCo warning: {message}", file=sys.stderr)


def register(env_id: str) -> None:
    """Make ``env_id`` available in this process (ALE's ids are registered by ``ale_py``)."""
    if is_pixels(env_id):
        import ale_py

        gym.register_envs(ale_py)
    elif env_id.startswith("HalfCheetah"):
        import mujoco

        mujoco.set_mju_user_warning(_mujoco_warning)


# -- policies --------------------------------------------------------------------------------------
class Pixels(nn.Module):
    """uint8 frames ``[..., 210, 160, 3]`` -> float ``[..., 1344]``: strided, grey, scaled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[..., ::PIXEL_STRIDE, ::PIXEL_STRIDE, :].float().mean(-1) / 255.0
        return x.flatten(-2)


class Float(nn.Module):
    """float32 input (MuJoCo observations are float64; a no-op on float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def mlp(env: gym.Env[Any, Any], n_out: int) -> nn.Module:
    """2 x 64 tanh MLP (behind the pixel encoder for an image observation)."""
    shape = env.observation_space.shape
    assert shape is not None
    if len(shape) == 3:
        h, w = math.ceil(shape[0] / PIXEL_STRIDE), math.ceil(shape[1] / PIXEL_STRIDE)
        return nn.Sequential(
            Pixels(), nn.Linear(h * w, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
            nn.Linear(HIDDEN, n_out),
        )  # fmt: skip
    return nn.Sequential(
        Float(),
        nn.Linear(shape[0], HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, n_out),
    )


class ConvNet(nn.Module):
    """A small Atari conv net on uint8 frames ``[..., 210, 160, 3]`` -> ``n_out`` logits (the ``cnn`` policy):
    two strided convolutions, a 4 x 4 average pool, one linear layer."""

    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 8, stride=4), nn.ReLU(), nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 16, n_out),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-3]
        out = self.net(x.reshape(-1, *x.shape[-3:]).permute(0, 3, 1, 2).float() / 255.0)
        return out.reshape(*lead, -1)


class Plain(nn.Module):
    """A plain ``nn.Module`` policy: argmax (Discrete) or ``high * tanh`` (Box)."""

    def __init__(self, net: nn.Module, discrete: bool, high: float) -> None:
        super().__init__()
        self.net, self.discrete, self.high = net, discrete, high

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        out = self.net(observation)
        return out.argmax(-1) if self.discrete else self.high * torch.tanh(out)


class SampleCategorical(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=logits).sample()


class SampleGaussian(nn.Module):
    """``loc`` plus N(0, 0.1) noise, clipped to the action bounds."""

    def __init__(self, low: float, high: float) -> None:
        super().__init__()
        self.low, self.high = low, high

    def forward(self, loc: torch.Tensor) -> torch.Tensor:
        return (loc + 0.1 * torch.randn_like(loc)).clamp(self.low, self.high)


class Loc(nn.Module):
    def __init__(self, net: nn.Module, high: float) -> None:
        super().__init__()
        self.net, self.high = net, high

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.high * torch.tanh(self.net(observation))


@dataclass
class PolicySpec:
    """The policy given to the collectors and the same computation on plain tensors for the raw loop."""

    policy: Any  # None: random actions
    raw: Callable[[torch.Tensor], torch.Tensor] | None  # None: action_space.sample()


def make_policy(kind: str, env_id: str, obs_key: str = "observation") -> PolicySpec:
    """``module`` | ``tdseq`` | ``prob`` | ``random``, seeded: the same weights every call."""
    if kind == "random":
        return PolicySpec(None, None)
    env_id = gym_id(env_id)
    register(env_id)
    env = gym.make(env_id)
    space = env.action_space
    torch.manual_seed(0)
    if isinstance(space, gym.spaces.Discrete):
        n_act, discrete, low, high = int(space.n), True, 0.0, 0.0
    else:
        assert isinstance(space, gym.spaces.Box)
        n_act, discrete = int(np.prod(space.shape)), False
        low, high = float(space.low.flat[0]), float(space.high.flat[0])
    if kind == "module":
        plain = Plain(mlp(env, n_act), discrete, high).eval()
        env.close()
        return PolicySpec(plain, plain)
    if kind == "cnn":  # TorchRL style as tdseq, a conv net writing "logits" (issue 42)
        if not (discrete and is_pixels(env_id)):
            raise ValueError(f"the cnn policy is for pixel envs with a Discrete action space, not {env_id}")
        env.close()
        conv, categorical = ConvNet(n_act), SampleCategorical()
        cnn_policy = TensorDictSequential(
            TensorDictModule(conv, in_keys=[obs_key], out_keys=["logits"]),
            TensorDictModule(categorical, in_keys=["logits"], out_keys=["action"]),
        ).eval()
        return PolicySpec(cnn_policy, lambda obs: categorical(conv(obs)))
    if kind == "tdseq":
        if discrete:
            head: nn.Module = mlp(env, n_act)
            sampler: nn.Module = SampleCategorical()
            key = "logits"
        else:
            head, sampler, key = Loc(mlp(env, n_act), high), SampleGaussian(low, high), "loc"
        env.close()
        td_policy = TensorDictSequential(
            TensorDictModule(head, in_keys=[obs_key], out_keys=[key]),
            TensorDictModule(sampler, in_keys=[key], out_keys=["action"]),
        ).eval()
        return PolicySpec(td_policy, lambda obs: sampler(head(obs)))
    if kind == "prob":
        if discrete:
            net = mlp(env, n_act)
            env.close()
            prob = ProbabilisticTensorDictSequential(
                TensorDictModule(net, in_keys=[obs_key], out_keys=["logits"]),
                ProbabilisticTensorDictModule(
                    in_keys=["logits"],
                    out_keys=["action"],
                    distribution_class=torch.distributions.Categorical,
                    return_log_prob=True,
                ),
            ).eval()

            def raw_categorical(obs: torch.Tensor) -> torch.Tensor:
                dist = torch.distributions.Categorical(logits=net(obs))
                action = dist.sample()
                dist.log_prob(action)
                return action

            return PolicySpec(prob, raw_categorical)
        net = nn.Sequential(mlp(env, 2 * n_act), NormalParamExtractor())
        env.close()
        prob = ProbabilisticTensorDictSequential(
            TensorDictModule(net, in_keys=[obs_key], out_keys=["loc", "scale"]),
            ProbabilisticTensorDictModule(
                in_keys=["loc", "scale"],
                out_keys=["action"],
                distribution_class=torch.distributions.Normal,
                return_log_prob=True,
            ),
        ).eval()

        def raw_normal(obs: torch.Tensor) -> torch.Tensor:
            loc, scale = net(obs)
            dist = torch.distributions.Normal(loc, scale)
            action = dist.sample()
            dist.log_prob(action)
            return action

        return PolicySpec(prob, raw_normal)
    raise ValueError(f"unknown policy kind {kind!r}; choose from {POLICIES}")


# -- env factories (module level: worker processes unpickle them) ---------------------------------
def ours_env(env_id: str, num_envs: int) -> Any:
    from aiocollect import GymEnv

    if is_pool(env_id):
        return GymEnv(make_pool(env_id, num_envs))
    register(env_id)
    return GymEnv(env_id, num_envs=None if num_envs == 1 else num_envs)


def torchrl_env(env_id: str, num_envs: int) -> Any:
    from torchrl.envs import GymEnv, GymWrapper

    register(env_id)
    if num_envs == 1:
        return GymEnv(env_id, categorical_action_encoding=True)
    vec = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": AutoresetMode.DISABLED},
    )
    return GymWrapper(vec, categorical_action_encoding=True)


def torchrl_available() -> bool:
    try:
        import torchrl.collectors  # noqa: F401
    except ImportError:
        return False
    return True


# -- CPU accounting --------------------------------------------------------------------------------
def proc_cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def descendants() -> dict[int, psutil.Process]:
    return {p.pid: p for p in ME.children(recursive=True)}


class Busy:
    """The "busy trainer": a thread of this process doing 512 x 512 matmuls until stopped.

    Its own CPU time (its thread's CPU clock) is left out of every figure.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.clock: int | None = None
        self.matmuls = 0
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        torch.set_num_threads(1)  # a trainer limited to one core, in its own thread too
        self.clock = time.pthread_getcpuclockid(threading.get_ident())
        a = torch.randn(512, 512)
        self._ready.set()
        while not self._stop.is_set():
            a = torch.tanh(a @ a)
            self.matmuls += 1

    def start(self) -> None:
        self._stop.clear()
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name="busy-trainer", daemon=True)
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None

    def cpu(self) -> float:
        """The thread's CPU seconds so far (0 when it is not running)."""
        if self._thread is None or self.clock is None:
            return 0.0
        return time.clock_gettime(self.clock)


BUSY = Busy()


class Account:
    """CPU of one variant during a measurement: this process (every thread but the busy trainer's, from
    the process CPU clock, ns resolution) plus the processes that appeared while the variant was opened
    (its workers and their helpers), read with psutil while they run (clock-tick resolution, 10 ms). A
    process gone before the end of a measurement keeps its last reading (and is counted in
    ``lost_processes``)."""

    def __init__(self) -> None:
        self.procs: dict[int, psutil.Process] = {}
        self.last: dict[int, float] = {}
        self.lost: set[int] = set()

    def adopt(self, before: set[int]) -> None:
        self.procs = {pid: p for pid, p in descendants().items() if pid not in before}
        self.workers()

    @staticmethod
    def main() -> float:
        """CPU seconds so far of this process, less the busy trainer's thread."""
        return time.process_time() - BUSY.cpu()

    def workers(self) -> float:
        """CPU seconds so far of the variant's own processes."""
        for pid, p in self.procs.items():
            try:
                self.last[pid] = proc_cpu(p)
            except psutil.Error:
                self.lost.add(pid)
        return sum(self.last.values())

    def read(self) -> float:
        return self.main() + self.workers()


# -- variants --------------------------------------------------------------------------------------
@dataclass
class Sample:
    frames: int
    wall_s: float
    cpu_s: float

    @property
    def fps(self) -> float:
        return self.frames / self.wall_s

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu_s / self.frames


class Variant:
    """One way of collecting; ``measure(seconds)`` collects whole batches for at least ``seconds``."""

    lib = "aiocollect"
    kind = ""
    #: workers keep collecting between batches (the MultiAsync collectors)
    run_ahead = False

    def __init__(self, label: str) -> None:
        self.label = label
        self.samples: dict[str, list[Sample]] = {"idle": [], "busy": []}
        self.account = Account()
        self.settled = 0.0  # the workers' CPU seconds when they were last settled (run-ahead only)

    async def open(self, stack: AsyncExitStack) -> None:
        before = set(descendants())
        await self._open(stack)
        await self.batch()  # warm-up, untimed
        self.account.adopt(before)
        if self.run_ahead:
            await self.settle()

    async def _open(self, stack: AsyncExitStack) -> None:
        raise NotImplementedError

    async def batch(self) -> int:
        raise NotImplementedError

    async def measure(self, seconds: float) -> Sample:
        if self.run_ahead:
            return await self._measure_run_ahead(seconds)
        cpu0 = self.account.read()
        frames, wall = await self._collect(seconds)
        return Sample(frames, wall, self.account.read() - cpu0)

    async def _collect(self, seconds: float) -> tuple[int, float]:
        """Whole batches for at least ``seconds``: (frames, wall seconds)."""
        frames = 0
        t0 = time.perf_counter()
        while True:
            frames += await self.batch()
            if time.perf_counter() - t0 >= seconds:
                return frames, time.perf_counter() - t0

    async def _measure_run_ahead(self, seconds: float) -> Sample:
        """A collector whose workers keep collecting between batches (up to two ready per worker).

        Every measurement starts and ends with the workers settled (every slot full, nothing running), so
        between two settled points the workers produced exactly the batches taken: their CPU over that
        span, with this process's CPU while taking them, divided by those frames, is the cost per frame.
        Frames/s is timed after the ready batches are taken: the clock starts with every worker
        collecting and none ready.
        """
        main0 = self.account.main()
        ready = 0
        for _ in range(2 * WORKERS):
            ready += await self.batch()
        frames, wall = await self._collect(seconds)
        main = self.account.main() - main0
        since = self.settled
        await self.settle()  # the workers' CPU is read once they are idle again
        workers = self.settled - since
        cpu_per_frame = (main + workers) / (ready + frames)
        return Sample(frames, wall, cpu_per_frame * frames)

    async def settle(self) -> None:
        """Wait until the workers stop running ahead (their CPU time stands still for 100 ms), so that
        they do not take the cores from the next variant's measurement."""
        deadline = time.perf_counter() + 20.0
        before = self.account.workers()
        still = 0
        while still < 4 and time.perf_counter() < deadline:
            await anyio.sleep(0.025)
            now = self.account.workers()
            still = still + 1 if now - before < 0.002 else 0
            before = now
        self.settled = self.account.workers()


class Raw(Variant):
    """gymnasium stepped in a plain loop: the policy on ``torch.from_numpy(obs)``, then ``env.step``."""

    lib = "raw"
    kind = "raw"

    def __init__(self, env_id: str, num_envs: int, spec: PolicySpec, steps: int) -> None:
        super().__init__("raw gymnasium loop")
        self.env_id, self.num_envs, self.fn, self.steps = env_id, num_envs, spec.raw, steps

    async def _open(self, stack: AsyncExitStack) -> None:
        register(self.env_id)
        if self.num_envs == 1:
            self.env: Any = gym.make(self.env_id)
        else:  # what GymEnv(id, num_envs=N) builds
            self.env = gym.make_vec(
                self.env_id,
                num_envs=self.num_envs,
                vectorization_mode="sync",
                vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
            )
        stack.callback(self.env.close)
        self.obs, _ = self.env.reset(seed=0)
        self.env.action_space.seed(0)
        self.discrete = isinstance(self.env.action_space, gym.spaces.Discrete)

    async def batch(self) -> int:
        env, fn, obs = self.env, self.fn, self.obs
        single = self.num_envs == 1
        with torch.no_grad():
            for _ in range(self.steps):
                if fn is None:
                    action = env.action_space.sample()
                else:
                    action = fn(torch.from_numpy(obs)).numpy()
                    if single and self.discrete:
                        action = int(action)
                obs, _r, terminated, truncated, _i = env.step(action)
                if single and (terminated or truncated):
                    obs, _ = env.reset()
        self.obs = obs
        return self.steps * self.num_envs


class RawStore(Raw):
    """:class:`Raw` that also stores what a batch holds (issue 42's limit): the observation, the next
    observation (the final one where an episode ended), the action, the reward, terminated, truncated and
    done, into arrays ``[T, (N,) ...]`` preallocated once and reused by every batch, as a user's loop
    filling a rollout buffer does."""

    def __init__(self, env_id: str, num_envs: int, spec: PolicySpec, steps: int) -> None:
        super().__init__(env_id, num_envs, spec, steps)
        self.label = "raw loop, stores the keys"

    async def _open(self, stack: AsyncExitStack) -> None:
        await super()._open(stack)
        obs = np.asarray(self.obs)
        lead = (self.steps,) if self.num_envs == 1 else (self.steps, self.num_envs)
        space = self.env.single_action_space if self.num_envs > 1 else self.env.action_space
        action = ((), np.int64) if self.discrete else (space.shape, np.float32)
        self.store = {
            "observation": np.empty((self.steps, *obs.shape), obs.dtype),
            "next_observation": np.empty((self.steps, *obs.shape), obs.dtype),
            "action": np.empty((*lead, *action[0]), action[1]),
            "reward": np.empty(lead, np.float32),
            **{flag: np.empty(lead, bool) for flag in ("terminated", "truncated", "done")},
        }
        for array in self.store.values():  # its pages mapped once, as the collectors' reused buffers
            array.fill(0)

    async def batch(self) -> int:
        env, fn, obs, s = self.env, self.fn, self.obs, self.store
        observation, nxt, actions, rewards = s["observation"], s["next_observation"], s["action"], s["reward"]
        terms, truncs = s["terminated"], s["truncated"]
        single = self.num_envs == 1
        with torch.no_grad():
            for t in range(self.steps):
                observation[t] = obs
                if fn is None:
                    action = env.action_space.sample()
                else:
                    action = fn(torch.from_numpy(obs)).numpy()
                    if single and self.discrete:
                        action = int(action)
                obs, reward, terminated, truncated, info = env.step(action)
                nxt[t] = obs
                if single:
                    if terminated or truncated:
                        obs, _ = env.reset()
                else:
                    done = terminated | truncated
                    if done.any():
                        finals = info["final_obs"]
                        for i in np.flatnonzero(done):
                            nxt[t, i] = finals[i]
                actions[t] = action
                rewards[t] = reward
                terms[t] = terminated
                truncs[t] = truncated
            np.logical_or(terms, truncs, out=s["done"])
        self.obs = obs
        return self.steps * self.num_envs


class RawPool(Variant):
    """An EnvPool pool stepped in a plain loop that stores what a batch holds (observation, next
    observation, action, reward, terminated, truncated) into preallocated ``[T, N]`` arrays, new ones each
    batch. ``same_step``: the ended envs are also reset at once (``reset(env_ids)``) and their reset
    observations acted on, as the collectors' same-step data need; without it the pool resets them at
    their next step itself (next-step autoreset: a frame per episode end whose action is ignored)."""

    lib = "raw"
    kind = "raw"

    def __init__(self, env_id: str, num_envs: int, spec: PolicySpec, steps: int, *, same_step: bool) -> None:
        label = "raw EnvPool loop" + (", same-step resets" if same_step else "")
        super().__init__(label)
        self.env_id, self.num_envs, self.fn, self.steps = env_id, num_envs, spec.raw, steps
        self.same_step = same_step

    async def _open(self, stack: AsyncExitStack) -> None:
        self.env = make_pool(self.env_id, self.num_envs)
        stack.callback(self.env.close)
        self.obs, _ = self.env.reset()
        self.n_actions = int(self.env.action_space.n)
        self.rng = np.random.default_rng(0)

    async def batch(self) -> int:
        env, fn, obs, n, T = self.env, self.fn, self.obs, self.num_envs, self.steps
        obs_b = np.empty((T, *obs.shape), obs.dtype)
        next_b = np.empty_like(obs_b)
        act_b = np.empty((T, n), np.int64)
        rew_b = np.empty((T, n), np.float32)
        term_b = np.empty((T, n), bool)
        trunc_b = np.empty((T, n), bool)
        with torch.no_grad():
            for t in range(T):
                if fn is None:
                    action = self.rng.integers(0, self.n_actions, n)
                else:
                    action = fn(torch.from_numpy(obs)).numpy()
                obs_b[t] = obs
                obs, reward, terminated, truncated, _ = env.step(action)
                next_b[t] = obs
                act_b[t] = action
                rew_b[t] = reward
                term_b[t] = terminated
                trunc_b[t] = truncated
                if self.same_step:
                    done = terminated | truncated
                    if done.any():
                        obs = obs.copy()
                        new_obs, info = env.reset(np.flatnonzero(done).astype(np.int32))
                        obs[info["env_id"]] = new_obs
        self.obs = obs
        return T * n


class Ours(Variant):
    def __init__(self, kind: str, label: str, make: Callable[[], Any]) -> None:
        super().__init__(label)
        self.kind, self.make = kind, make
        self.run_ahead = kind == "multiasync"

    async def _open(self, stack: AsyncExitStack) -> None:
        collector = await stack.enter_async_context(self.make())
        self.it = aiter(collector)

    async def batch(self) -> int:
        return int((await anext(self.it)).numel())


class TorchRL(Variant):
    """TorchRL's collector iterated as TorchRL is used: ``next()`` on its iterator."""

    lib = "torchrl"

    def __init__(self, kind: str, label: str, make: Callable[[], Any]) -> None:
        super().__init__(label)
        self.kind, self.make = kind, make
        self.run_ahead = kind == "multiasync"

    async def _open(self, stack: AsyncExitStack) -> None:
        self.collector: Any = self.make()
        stack.callback(self._close)
        self.it: Any = iter(self.collector)

    def _close(self) -> None:
        self.collector.shutdown()
        # torchrl 0.14.1's weight-sync scheme starts a thread in its __del__: collected at interpreter
        # exit, that deadlocks (the process never ends); collect it now instead
        self.it = self.collector = None
        gc.collect()

    async def batch(self) -> int:
        return int(next(self.it).numel())


def torchrl_obs_key(env_id: str, num_envs: int) -> str:
    """The observation key of TorchRL's env (its GymEnv names a single env's image ``"pixels"``)."""
    env = torchrl_env(env_id, 1 if num_envs == 1 else 2)
    try:
        return str(next(iter(env.observation_spec.keys())))
    finally:
        env.close()


def build(
    env_id: str, num_envs: int, policy: str, collectors: list[str], with_torchrl: bool, raw: str = "bare"
) -> list[Variant]:
    """The variants of a cell, the raw loop first (``raw``: one of :data:`RAW_KINDS`)."""
    import aiocollect

    steps = (PIXEL_STEPS if is_pixels(env_id) else STEPS)[num_envs]
    fpb = steps * num_envs  # one worker's batch
    spec = make_policy(policy, env_id)
    env_fn = functools.partial(ours_env, env_id, num_envs)
    out: list[Variant] = [(RawStore if raw == "store" else Raw)(env_id, num_envs, spec, steps)]
    if is_pool(env_id):  # no TorchRL here: its EnvPool wrapper is another env than ours
        out = [RawPool(env_id, num_envs, spec, steps, same_step=s) for s in (False, True)]
        with_torchrl = False
    p = spec.policy
    ours = {
        "collector": ("Collector", lambda: aiocollect.Collector(env_fn, p, frames_per_batch=fpb, seed=0)),
        "multisync": (
            f"MultiSyncCollector x{WORKERS}",
            lambda: aiocollect.MultiSyncCollector(
                [env_fn] * WORKERS, p, frames_per_batch=WORKERS * fpb, seed=0
            ),
        ),
        "multiasync": (
            f"MultiAsyncCollector x{WORKERS}",
            lambda: aiocollect.MultiAsyncCollector([env_fn] * WORKERS, p, frames_per_batch=fpb, seed=0),
        ),
    }
    for kind in collectors:
        label, make = ours[kind]
        out.append(Ours(kind, label, make))
    if with_torchrl:
        from torchrl import collectors as trc

        key = torchrl_obs_key(env_id, num_envs)
        tspec = make_policy(policy, env_id, obs_key=key)
        tp = tspec.policy
        if policy == "module":  # what TorchRL does with a plain module: a TensorDictModule around it
            tp = TensorDictModule(tp, in_keys=[key], out_keys=["action"])
        trl_fn = functools.partial(torchrl_env, env_id, num_envs)
        kw = {"total_frames": -1, "auto_register_policy_transforms": False}
        theirs = {
            "collector": ("Collector", lambda: trc.Collector(trl_fn, tp, frames_per_batch=fpb, **kw)),
            "multisync": (
                f"MultiSyncCollector x{WORKERS}",
                lambda: trc.MultiSyncCollector([trl_fn] * WORKERS, tp, frames_per_batch=WORKERS * fpb, **kw),
            ),
            "multiasync": (
                f"MultiAsyncCollector x{WORKERS}",
                lambda: trc.MultiAsyncCollector([trl_fn] * WORKERS, tp, frames_per_batch=fpb, **kw),
            ),
        }
        for kind in collectors:
            label, make = theirs[kind]
            out.append(TorchRL(kind, f"torchrl {label}", make))
    return out


# -- the run ---------------------------------------------------------------------------------------
@dataclass
class CellResult:
    env_id: str
    num_envs: int
    policy: str
    frames_per_batch: int
    rows: list[dict[str, Any]] = field(default_factory=list)


def median_ratio(a: list[Sample], b: list[Sample], attr: str, invert: bool = False) -> float:
    """Median over rounds of ``a.attr / b.attr`` (``b / a`` with ``invert``)."""
    pairs = list(zip(a, b, strict=False))
    if not pairs:
        return math.nan
    values = [
        getattr(y, attr) / getattr(x, attr) if invert else getattr(x, attr) / getattr(y, attr)
        for x, y in pairs
    ]
    return statistics.median(values)


def summarise(variants: list[Variant]) -> list[dict[str, Any]]:
    raw = variants[0]
    trl = {v.kind: v for v in variants if v.lib == "torchrl"}
    rows = []
    for v in variants:
        row: dict[str, Any] = {"variant": v.label, "lib": v.lib, "kind": v.kind}
        for state in ("idle", "busy"):
            s = v.samples[state]
            row[state] = (
                {
                    "cpu_us_per_frame": statistics.median(x.cpu_us for x in s),
                    "fps": statistics.median(x.fps for x in s),
                    "samples": [asdict(x) for x in s],
                }
                if s
                else None
            )
        state = "idle" if v.samples["idle"] else "busy"
        # CPU-efficiency (frames per CPU-second) relative to the raw loop = raw CPU-us / this CPU-us
        row["vs_raw_cpu_eff"] = (
            math.nan
            if v is raw
            else median_ratio(v.samples[state], raw.samples[state], "cpu_us", invert=True)
        )
        row["vs_raw_fps"] = (
            math.nan if v is raw else median_ratio(v.samples[state], raw.samples[state], "fps")
        )
        row["vs_raw_state"] = state
        other = trl.get(v.kind) if v.lib == "aiocollect" else None
        row["vs_torchrl_fps"] = (
            median_ratio(v.samples[state], other.samples[state], "fps") if other is not None else math.nan
        )
        row["busy_over_idle_fps"] = median_ratio(v.samples["busy"], v.samples["idle"], "fps")
        row["processes"] = len(v.account.procs)  # the processes its CPU figure includes
        row["lost_processes"] = len(v.account.lost)
        rows.append(row)
    return rows


async def run_cell(
    env_id: str, n: int, policy: str, args: argparse.Namespace, log: Callable[[str], None]
) -> CellResult:
    variants = build(env_id, n, policy, args.collectors, args.torchrl, args.raw)
    steps = (PIXEL_STEPS if is_pixels(env_id) else STEPS)[n]
    states = {"off": ["idle"], "on": ["busy"], "both": ["idle", "busy"]}[args.busy]
    async with AsyncExitStack() as stack:
        for v in variants:
            t0 = time.perf_counter()
            await v.open(stack)
            log(f"    opened {v.label} ({time.perf_counter() - t0:.1f} s)")
        for r in range(args.rounds):
            k = r % len(variants)
            order = variants[k:] + variants[:k]
            if r % 2:
                order.reverse()
            for state in states if r % 2 == 0 else states[::-1]:
                if state == "busy":
                    BUSY.start()
                try:
                    for v in order:
                        v.samples[state].append(await v.measure(args.seconds))
                finally:
                    if state == "busy":
                        BUSY.stop()
    cell = CellResult(env_id, n, policy, steps * n, summarise(variants))
    for row in cell.rows:
        idle = row["idle"] or row["busy"]
        log(
            f"    {row['variant']:<38} {idle['cpu_us_per_frame']:8.1f} CPU-us/frame {idle['fps']:10,.0f} "
            f"frames/s  / raw {row['vs_raw_cpu_eff']:.2f} (frames/s {row['vs_raw_fps']:.2f})  "
            f"/ torchrl {row['vs_torchrl_fps']:.2f}  "
            f"busy/idle {row['busy_over_idle_fps']:.2f}"
        )
    return cell


# -- reporting -------------------------------------------------------------------------------------
def fmt(x: float, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(cells: list[CellResult], info: dict[str, Any]) -> str:
    lines = [
        "| env | envs | policy | variant | CPU-µs/frame | frames/s | ÷ raw (CPU-eff.) | ÷ raw (frames/s) "
        "| ÷ TorchRL (frames/s) | busy: CPU-µs/frame | busy: frames/s | busy ÷ idle (frames/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        for row in c.rows:
            idle, busy = row["idle"] or {}, row["busy"] or {}
            lines.append(
                f"| {c.env_id} | {c.num_envs} | {c.policy} | {row['variant']} "
                f"| {fmt(idle.get('cpu_us_per_frame', math.nan), '.1f')} "
                f"| {fmt(idle.get('fps', math.nan), ',.0f')} "
                f"| {fmt(row['vs_raw_cpu_eff'])} | {fmt(row['vs_raw_fps'])} | {fmt(row['vs_torchrl_fps'])} "
                f"| {fmt(busy.get('cpu_us_per_frame', math.nan), '.1f')} "
                f"| {fmt(busy.get('fps', math.nan), ',.0f')} | {fmt(row['busy_over_idle_fps'])} |"
            )
    m, ver = info["machine"], info["versions"]
    lines += [
        "",
        f"Run: `{info['command']}`: {info['rounds']} rounds of >= {info['seconds']} s per variant and "
        f"state, {info['elapsed_s']:.0f} s in all; load average {info['load_before']:.1f} before, "
        f"{info['load_after']:.1f} after.",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, {m['platform']}, "
        f"Python {m['python']}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
    ]
    return "\n".join(lines)


def text(cells: list[CellResult]) -> str:
    """A plain table for the terminal (``--markdown`` for docs/)."""
    head = ("env", "envs", "policy", "variant", "CPU-us/f", "frames/s", "/raw", "/raw f/s", "/torchrl",
            "busy CPU-us/f", "busy f/s", "busy/idle")  # fmt: skip
    rows = [head]
    for c in cells:
        for row in c.rows:
            idle, busy = row["idle"] or {}, row["busy"] or {}
            rows.append((
                c.env_id, str(c.num_envs), c.policy, row["variant"],
                fmt(idle.get("cpu_us_per_frame", math.nan), ".1f"), fmt(idle.get("fps", math.nan), ",.0f"),
                fmt(row["vs_raw_cpu_eff"]), fmt(row["vs_raw_fps"]), fmt(row["vs_torchrl_fps"]),
                fmt(busy.get("cpu_us_per_frame", math.nan), ".1f"), fmt(busy.get("fps", math.nan), ",.0f"),
                fmt(row["busy_over_idle_fps"]),
            ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows)


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    out = {}
    for dist in (
        "aiocollect", "torchrl", "torch", "tensordict", "gymnasium", "ale-py", "mujoco", "envpool", "numpy",
    ):  # fmt: skip
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "-"
    return out


def csv(choices: tuple[Any, ...], cast: Callable[[str], Any] = str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [cast(x.strip()) for x in text.split(",") if x.strip()]
        bad = [x for x in values if x not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(map(str, choices))}")
        return values

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--envs",
        type=csv(ENVS + POOL_ENVS),
        help=f"comma-separated, from {', '.join(ENVS + POOL_ENVS)} (EnvPool's only when named)",
    )
    parser.add_argument(
        "--num-envs",
        type=csv(NUM_ENVS + POOL_NUM_ENVS, int),
        help="comma-separated, from 1, 8, 32 (gymnasium), 256, 1024 (EnvPool)",
    )
    parser.add_argument(
        "--policies",
        type=csv(POLICIES),
        help=f"comma-separated, from {', '.join(POLICIES)} (cnn: pixel envs only, when named)",
    )
    parser.add_argument(
        "--collectors", type=csv(COLLECTORS), help=f"comma-separated, from {', '.join(COLLECTORS)}"
    )
    parser.add_argument(
        "--busy", choices=("off", "on", "both"), help="without / with the busy trainer thread (default both)"
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds per cell (default 3, --quick 2)")
    parser.add_argument(
        "--seconds", type=float, help="least length of one measurement (default 0.5, --quick 0.25)"
    )
    parser.add_argument(
        "--raw",
        choices=RAW_KINDS,
        default="bare",
        help="the raw loop the ratios divide by: bare (stores nothing, the default) or store (writes every "
        "key a batch holds into preallocated arrays)",
    )
    parser.add_argument(
        "--no-torchrl", dest="torchrl", action="store_false", help="skip TorchRL's collectors"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: CartPole-v1 and ALE/Pong-v5, 8 envs, tdseq and random policies (filters override)",
    )
    parser.add_argument(
        "--limits",
        action="store_true",
        help="issue 42's cells (ALE/Pong-v5 x8 cnn and x1 random, CartPole-v1 x8 tdseq, with their "
        "collectors) against the raw loop that stores the keys; --envs, --num-envs, --policies and "
        "--collectors are ignored",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown for docs/")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    args = parser.parse_args(argv)
    q = args.quick
    args.envs = args.envs or (["CartPole-v1", "ALE/Pong-v5"] if q else list(ENVS))
    args.num_envs = args.num_envs or ([8] if q else [*NUM_ENVS, *POOL_NUM_ENVS])
    args.policies = args.policies or (["tdseq", "random"] if q else list(DEFAULT_POLICIES))
    args.collectors = args.collectors or list(COLLECTORS)
    args.busy = args.busy or "both"
    args.rounds = args.rounds or (2 if q else 3)
    args.seconds = args.seconds or (0.25 if q else 0.5)
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds must be >= 1 and --seconds > 0")
    args.torchrl = args.torchrl and torchrl_available()
    if args.limits:
        args.raw = "store"
    return args


async def run(args: argparse.Namespace, log: Callable[[str], None]) -> list[CellResult]:
    cells = []
    if args.limits:
        for env_id, n, policy, collectors in LIMIT_CELLS:
            log(f"{env_id} x{n} {policy}")
            cell_args = argparse.Namespace(**{**vars(args), "collectors": list(collectors)})
            cells.append(await run_cell(env_id, n, policy, cell_args, log))
        return cells
    for env_id in args.envs:
        for n in args.num_envs:
            if (n in POOL_NUM_ENVS) != is_pool(env_id):  # EnvPool's cells have their own sizes
                continue
            for policy in args.policies:
                if policy == "cnn" and not is_pixels(env_id):  # a conv net reads frames only
                    continue
                log(f"{env_id} x{n} {policy}")
                cells.append(await run_cell(env_id, n, policy, args, log))
    return cells


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    load_before = os.getloadavg()[0]

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr, flush=True)

    trl = "on" if args.torchrl else "off (not importable or --no-torchrl)"
    pairs = sum((n in POOL_NUM_ENVS) == is_pool(e) for e in args.envs for n in args.num_envs)
    count = len(LIMIT_CELLS) if args.limits else pairs * len(args.policies)
    log(f"torch threads {torch.get_num_threads()}; torchrl {trl}; {count} cells")
    cells = anyio.run(run, args, log)
    info = {
        "command": " ".join(["python", "benchmarks/matrix.py", *(sys.argv[1:] if argv is None else argv)]),
        "rounds": args.rounds,
        "seconds": args.seconds,
        "elapsed_s": time.perf_counter() - start,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "machine": machine(),
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
    }
    print(markdown(cells, info) if args.markdown else text(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "cells": [asdict(c) for c in cells]}, f, indent=1)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
