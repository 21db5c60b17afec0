"""Real envs through every collector: ALE ``Pong-v5`` (210x160x3 uint8 frames) and MuJoCo
``HalfCheetah-v5``, with the data invariants checked frame by frame against the env's own episode log.

Run with ``pytest -m realenvs`` (``nox -s realenvs``; needs the ``bench`` extra: ale-py, mujoco); the
default run leaves them out. Each env writes the episodes it plays (return, length, terminated) and its
step count to files in ``tmp_path`` from wherever it runs (a worker process), through a gymnasium
wrapper: the collectors never see that log, so the batches are checked against the env's own account.

Each collector runs under one anyio backend (Collector: asyncio, MultiSync: asyncio+uvloop, MultiAsync:
trio) rather than all three, to keep this tier short on a 2-core machine; the default suite covers the
backends.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict

from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector

pytest.importorskip("ale_py", reason="the realenvs tier needs the bench extra (pip install -e '.[bench]')")
pytest.importorskip("mujoco", reason="the realenvs tier needs the bench extra (pip install -e '.[bench]')")

pytestmark = [pytest.mark.realenvs, pytest.mark.anyio, pytest.mark.timeout(180)]

WORKERS = 2
ENVS_PER_WORKER = 2
STEPS = 24  # steps per env in one batch
BATCHES = 4
#: short episodes (gymnasium's TimeLimit), so that several complete inside the test
EPISODE_STEPS = {"ALE/Pong-v5": 15, "HalfCheetah-v5": 10}
PIXELS = {"ALE/Pong-v5"}


class EpisodeLog(gym.Wrapper):
    """Appends each finished episode (return, length, terminated) to ``path`` as a JSON line, and the
    number of steps taken to ``path + '.steps'`` when the env closes."""

    def __init__(self, env: gym.Env, path: str) -> None:
        super().__init__(env)
        self.path = path
        self.ret = 0.0
        self.length = 0
        self.steps = 0

    def reset(self, **kwargs: Any) -> Any:
        self.ret, self.length = 0.0, 0
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.ret += float(reward)
        self.length += 1
        self.steps += 1
        if terminated or truncated:
            record = {"return": self.ret, "length": self.length, "terminated": bool(terminated)}
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        with open(self.path + ".steps", "w") as f:
            f.write(str(self.steps))
        super().close()


def log_path(log_dir: str, worker: int, sub: int) -> str:
    return str(Path(log_dir) / f"episodes-w{worker}-e{sub}.jsonl")


def _mujoco_warning(message: str) -> None:
    # mujoco 4 deprecates an attribute of gymnasium's HalfCheetah model; its default handler would write
    # MUJOCO_LOG.TXT into the working directory
    if "settotalmass" not in message:
        print(f"MuJoCo warning: {message}", file=sys.stderr)


def logged_env(env_id: str, log_dir: str, worker: int, sub: int) -> gym.Env:
    if env_id.startswith("ALE/"):
        import ale_py

        gym.register_envs(ale_py)
    else:
        import mujoco

        mujoco.set_mju_user_warning(_mujoco_warning)
    env = gym.make(env_id, max_episode_steps=EPISODE_STEPS[env_id])
    return EpisodeLog(env, log_path(log_dir, worker, sub))


def make_env(env_id: str, log_dir: str, worker: int, num_envs: int | None) -> GymEnv:
    """One worker's env: a single env (``num_envs=None``) or a same-step-autoreset SyncVectorEnv."""
    if num_envs is None:
        return GymEnv(logged_env(env_id, log_dir, worker, 0))
    subs = [functools.partial(logged_env, env_id, log_dir, worker, i) for i in range(num_envs)]
    return GymEnv(gym.vector.SyncVectorEnv(subs, autoreset_mode=AutoresetMode.SAME_STEP))


def read_log(log_dir: Path, worker: int, sub: int) -> tuple[list[dict[str, Any]], int]:
    path = Path(log_path(str(log_dir), worker, sub))
    episodes = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return episodes, int(Path(str(path) + ".steps").read_text())


def rows(kind: str, batch: TensorDict) -> dict[tuple[int, int], TensorDict]:
    """The batch split per env: ``(worker, env index) -> [T]`` frames in time order."""
    if kind == "collector":  # one env: [T]
        return {(0, 0): batch}
    if kind == "multisync":  # stacked over workers: [W, B, T]
        return {(w, b): batch[w, b] for w in range(batch.shape[0]) for b in range(batch.shape[1])}
    worker = int(batch["collector", "worker_id"].flatten()[0])  # one worker's batch: [B, T]
    return {(worker, b): batch[b] for b in range(batch.shape[0])}


CASES = [
    pytest.param("collector", ("asyncio", {"use_uvloop": False}), id="Collector-asyncio"),
    pytest.param("multisync", ("asyncio", {"use_uvloop": True}), id="MultiSync-uvloop"),
    pytest.param("multiasync", ("trio", {}), id="MultiAsync-trio"),
]


@pytest.mark.parametrize("env_id", ["ALE/Pong-v5", "HalfCheetah-v5"])
@pytest.mark.parametrize(("kind", "anyio_backend"), CASES)
async def test_real_env_data_invariants(env_id: str, kind: str, tmp_path: Path) -> None:
    log_dir = str(tmp_path)
    if kind == "collector":
        fpb = STEPS
        collector: Any = Collector(
            functools.partial(make_env, env_id, log_dir, 0, None),
            None,
            frames_per_batch=fpb,
            total_frames=BATCHES * fpb,
            seed=0,
        )
    else:
        fns = [functools.partial(make_env, env_id, log_dir, w, ENVS_PER_WORKER) for w in range(WORKERS)]
        if kind == "multisync":
            fpb = WORKERS * ENVS_PER_WORKER * STEPS
            collector = MultiSyncCollector(
                fns, None, frames_per_batch=fpb, total_frames=BATCHES * fpb, seed=0, worker_backend="process"
            )
        else:
            fpb = ENVS_PER_WORKER * STEPS
            collector = MultiAsyncCollector(
                fns,
                None,
                frames_per_batch=fpb,
                total_frames=2 * BATCHES * fpb,
                seed=0,
                worker_backend="process",
            )
    streams: dict[tuple[int, int], list[TensorDict]] = {}
    delivered = 0
    with anyio.fail_after(150):
        async with collector:
            async for batch in collector:
                assert batch.numel() == fpb
                delivered += batch.numel()
                for key, frames in rows(kind, batch).items():
                    streams.setdefault(key, []).append(frames)
    assert delivered == collector.total_frames

    owner: dict[int, tuple[int, int]] = {}  # trajectory id -> the env that played it
    for key, parts in sorted(streams.items()):
        s = torch.cat(parts, 0)
        obs, next_obs = s["observation"], s["next", "observation"]
        if env_id in PIXELS:  # pixel observations stay uint8, full frames
            assert obs.dtype == torch.uint8 and next_obs.dtype == torch.uint8
            assert obs.shape[1:] == (210, 160, 3)
        done = s["next", "done"].reshape(-1)
        tids = s["collector", "traj_ids"].reshape(-1)
        going = ~done[:-1]
        # the next observation of a non-final step is the following observation (across batches too)
        assert torch.equal(next_obs[:-1][going], obs[1:][going]), f"{key}: next obs != following obs"
        # a trajectory id lasts exactly one episode of one env
        assert torch.equal(tids[1:][going], tids[:-1][going])
        assert (tids[1:][done[:-1]] != tids[:-1][done[:-1]]).all()
        for tid in tids.unique().tolist():
            assert owner.setdefault(tid, key) == key, f"trajectory {tid} in envs {owner[tid]} and {key}"

        # episodes rebuilt from trajectory ids == the env's own log, in order
        episodes = []
        for tid in tids.unique_consecutive().tolist():
            at = tids == tid
            if not done[at][-1]:
                break  # the last, unfinished episode
            episodes.append(
                {
                    "return": float(s["next", "reward"][at].double().sum()),
                    "length": int(at.sum()),
                    "terminated": bool(s["next", "terminated"].reshape(-1)[at][-1]),
                }
            )
        logged, env_steps = read_log(tmp_path, *key)
        assert len(episodes) >= 2, f"{key}: too few episodes finished to check ({len(episodes)})"
        assert len(logged) >= len(episodes)
        for i, (ours, theirs) in enumerate(zip(episodes, logged, strict=False)):
            assert ours["length"] == theirs["length"], f"{key} episode {i}: {ours} != {theirs}"
            assert ours["terminated"] == theirs["terminated"], f"{key} episode {i}: {ours} != {theirs}"
            assert ours["return"] == pytest.approx(theirs["return"], rel=1e-5, abs=1e-4), (key, i)
        # no frame lost or duplicated: the frames delivered are the steps the env took (a MultiAsync
        # worker may have stepped ahead into a batch that was never asked for)
        if kind == "multiasync":
            assert env_steps >= s.shape[0]
        else:
            assert env_steps == s.shape[0], f"{key}: env stepped {env_steps} times, {s.shape[0]} frames"

    # every env delivered frames; trajectory ids are disjoint across workers (and envs: ``owner`` above)
    assert len(streams) == (1 if kind == "collector" else WORKERS * ENVS_PER_WORKER)
    workers = {worker for worker, _sub in owner.values()}
    assert workers == set(range(1 if kind == "collector" else WORKERS))


@pytest.mark.timeout(300)
def test_benchmark_matrix_runs_on_the_real_envs(tmp_path: Path) -> None:
    """benchmarks/matrix.py end to end on one tiny slice of each env (no timing is checked)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "matrix.py"
    out = tmp_path / "matrix.json"
    cmd = [
        sys.executable, str(script), "--envs", "HalfCheetah-v5,ALE/Pong-v5", "--num-envs", "1",
        "--policies", "prob", "--collectors", "multiasync", "--busy", "on", "--rounds", "1",
        "--seconds", "0.02", "--no-torchrl", "--json", str(out), "--markdown",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["torch_threads"] == 1
    assert [c["env_id"] for c in result["cells"]] == ["HalfCheetah-v5", "ALE/Pong-v5"]
    for cell in result["cells"]:
        variants = [row["variant"] for row in cell["rows"]]
        assert variants == ["raw gymnasium loop", "MultiAsyncCollector x2"]
        for row in cell["rows"]:
            assert row["idle"] is None  # --busy on: measured beside the busy trainer only
            assert row["busy"]["fps"] > 0 and row["busy"]["cpu_us_per_frame"] > 0, (cell["env_id"], row)
            assert row["lost_processes"] == 0
        # the CPU of the multi-process variant includes its two workers; the raw loop starts none
        assert cell["rows"][1]["processes"] >= WORKERS
        assert cell["rows"][0]["processes"] == 0
    assert "| ALE/Pong-v5 | 1 | prob | MultiAsyncCollector x2 |" in done.stdout
    assert not list(tmp_path.glob("MUJOCO_LOG.TXT"))
