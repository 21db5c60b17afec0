"""``GymEnv(..., info_keys=...)``: info entries in the batch, under ``("next", key)`` and at the root."""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from tensordict import TensorDict

from aiocollect import Collector, GymEnv


class InfoEnv(gym.Env):
    """Observation ``[t]``; info: an action mask depending on ``t``, the step count, and
    ``is_success`` (steps only) at the episode's last step. Episodes last ``length`` steps."""

    observation_space = spaces.Box(0, 100, (1,), np.float32)
    action_space = spaces.Discrete(3)

    def __init__(self, length: int = 3) -> None:
        self.length = length
        self.t = 0

    def _info(self) -> dict[str, Any]:
        return {"action_mask": np.array([1, self.t % 2, 1], dtype=np.int8), "count": self.t}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0], np.float32), self._info()

    def step(self, action: Any):
        self.t += 1
        end = self.t >= self.length
        info = {**self._info(), "is_success": end}
        return np.array([self.t], np.float32), 1.0, end, False, info


def vec(mode: AutoresetMode, lengths: tuple[int, ...] = (3, 4)) -> SyncVectorEnv:
    return SyncVectorEnv([lambda n=n: InfoEnv(n) for n in lengths], autoreset_mode=mode)


def collect(env_fn: Any, policy: Any = None, **kwargs: Any) -> TensorDict:
    async def main() -> TensorDict:
        with anyio.fail_after(60):
            async with Collector(env_fn, policy, total_frames=-1, **kwargs) as collector:
                async for batch in collector:
                    return batch
        raise AssertionError("no batch")

    return anyio.run(main)


KEYS = {"action_mask": None, "count": None, "is_success": spaces.MultiBinary(1)}
ENVS = {
    "single": lambda: GymEnv(InfoEnv(3), info_keys=KEYS),
    "same_step": lambda: GymEnv(vec(AutoresetMode.SAME_STEP), info_keys=KEYS),
    "next_step": lambda: GymEnv(vec(AutoresetMode.NEXT_STEP), info_keys=KEYS),
}


@pytest.mark.parametrize("kind", list(ENVS))
def test_info_entries_in_the_batch(kind):
    seen = []

    def policy(td):  # the policy reads the action mask at the root
        seen.append(td["action_mask"].clone())
        return td.set("action", td["action_mask"][..., 1].long() * 2)

    batch = collect(ENVS[kind], policy, frames_per_batch=8 if kind == "single" else 16)
    if kind == "single":
        batch = batch.unsqueeze(0)
    t = batch["observation"][..., 0]
    t_next = batch["next", "observation"][..., 0]
    # the root entries are those of the observation acted on, the next ones those of the step
    assert batch["count"].tolist() == t.long().tolist()
    assert batch["next", "count"].tolist() == t_next.long().tolist()
    assert batch["action_mask"][..., 1].tolist() == (t.long() % 2).tolist()
    assert batch["next", "action_mask"][..., 1].tolist() == (t_next.long() % 2).tolist()
    assert batch["action_mask"].dtype == torch.int8
    assert batch["count"].dtype == torch.int64
    # is_success: only steps give it (the reset info has none: zero at the root of a new episode)
    assert batch["next", "is_success"][..., 0].bool().tolist() == batch["next", "done"][..., 0].tolist()
    assert batch["next", "done"].any()
    acted_on = torch.stack(seen[1:], dim=-2).reshape(batch["action_mask"].shape)  # seen[0]: the dry call
    assert torch.equal(acted_on, batch["action_mask"])
    assert (batch["action"] == batch["action_mask"][..., 1] * 2).all()


def test_next_step_equals_same_step_with_info_keys():
    same = collect(ENVS["same_step"], frames_per_batch=20, seed=0)
    nxt = collect(ENVS["next_step"], frames_per_batch=20, seed=0)
    assert (same == nxt).all()


def test_unknown_key_names_it_and_lists_the_keys():
    with pytest.raises(KeyError) as info:
        GymEnv(InfoEnv(), info_keys=["is_sucess"])
    message = str(info.value)
    assert "'is_sucess'" in message
    assert "['action_mask', 'count']" in message
    assert "is_sucess': gymnasium.spaces" in message  # how to give an entry only steps have


@pytest.mark.parametrize(
    ("keys", "error", "match"),
    [
        (["reward"], ValueError, "collide"),
        (["observation"], ValueError, "observation key"),
        ("count", TypeError, "list of names"),
        ({"count": "int"}, TypeError, "gymnasium space"),
        (["_count"], ValueError, "'_count'"),
    ],
)
def test_bad_info_keys(keys, error, match):
    with pytest.raises(error, match=match):
        GymEnv(InfoEnv(), info_keys=keys)


def test_record_episode_statistics():
    """``RecordEpisodeStatistics``'s ``episode`` record, nested keys, in every sub-env of a vector env."""
    episode = spaces.Dict(
        {
            "r": spaces.Box(-np.inf, np.inf, (), np.float64),
            "l": spaces.Box(0, np.iinfo(np.int64).max, (), np.int64),
        }
    )

    def make(mode: AutoresetMode):
        fns = [lambda n=n: gym.wrappers.RecordEpisodeStatistics(InfoEnv(n)) for n in (3, 5)]
        return lambda: GymEnv(SyncVectorEnv(fns, autoreset_mode=mode), info_keys={"episode": episode})

    def make_vector_wrapped():  # the vector wrapper: the entry is in the step's info, not final_info
        fns = [lambda n=n: InfoEnv(n) for n in (3, 5)]
        inner = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
        return GymEnv(gym.wrappers.vector.RecordEpisodeStatistics(inner), info_keys={"episode": episode})

    makers = [make(AutoresetMode.SAME_STEP), make(AutoresetMode.NEXT_STEP)]
    # gymnasium's vector RecordEpisodeStatistics miscounts episode lengths after a same-step autoreset
    # before gymnasium 1.4 (its [3, 2, 2, 5, 4] here, on 1.1-1.3): an upstream bug, see docs/envs.md
    if GYMNASIUM >= (1, 4):
        makers.append(make_vector_wrapped)
    for make_env in makers:
        batch = collect(make_env, frames_per_batch=20, seed=0)
        done = batch["next", "done"][..., 0]
        lengths = batch["next", "episode", "l"]
        assert lengths[done].tolist() == [3, 3, 3, 5, 5]
        assert (batch["next", "episode", "r"][done] == lengths[done]).all()
        assert (lengths[~done] == 0).all()
        assert (batch["episode", "l"] == 0).all()  # no episode record comes with an observation
        assert batch["next", "episode", "r"].dtype == torch.float64


GYMNASIUM = tuple(int(part) for part in gym.__version__.split(".")[:2])


def test_vector_record_episode_statistics_with_next_step_is_refused():
    inner = SyncVectorEnv([InfoEnv, InfoEnv])  # next-step: reset in part, which the wrapper mishandles
    with pytest.raises(ValueError, match="wrap each sub-env"):
        GymEnv(gym.wrappers.vector.RecordEpisodeStatistics(inner))


class ObservationOnly(torch.nn.Module):
    """A plain module policy: called on the observation alone, whatever info entries the batch holds."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.zeros(observation.shape[:-1], dtype=torch.int64)


@pytest.mark.parametrize("kind", list(ENVS))
def test_a_plain_module_policy_gets_the_observations_not_the_info_entries(kind):
    batch = collect(ENVS[kind], ObservationOnly(), frames_per_batch=12)
    assert (batch["action"] == 0).all()
    assert ("next", "action_mask") in batch.keys(include_nested=True)


def test_a_multi_process_worker_calls_a_plain_module_on_the_observations():
    from aiocollect import MultiSyncCollector

    async def main() -> TensorDict:
        with anyio.fail_after(60):
            async with MultiSyncCollector(
                [ENVS["next_step"]],
                ObservationOnly(),
                frames_per_batch=12,
                total_frames=12,
                worker_backend="serial",
            ) as collector:
                (batch,) = [b async for b in collector]
                return batch

    batch = anyio.run(main)
    assert (batch["action"] == 0).all()
