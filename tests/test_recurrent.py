"""Recurrent policies (issue 18): a policy that reads ``"hidden"`` and writes ``("next", "hidden")`` gets
its state carried from step to step, reset where an episode ends, with ``"is_init"`` as TorchRL's
``InitTracker`` writes it; in process and in worker processes alike.

The env is CartPole with its velocities masked (a partially observed env: the policy needs a memory).
"""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import ProbabilisticTensorDictModule, TensorDictModule, TensorDictSequential
from torch import nn
from torch.distributions import Categorical

from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.anyio

HIDDEN = 8


# -- module level: the worker processes unpickle them ---------------------------------------------
def masked_cartpole() -> gym.Env[Any, Any]:
    """CartPole observing positions only (cart position, pole angle): velocities must be remembered."""
    env = gym.make("CartPole-v1")
    space = gym.spaces.Box(env.observation_space.low[[0, 2]], env.observation_space.high[[0, 2]])
    return gym.wrappers.TransformObservation(env, lambda obs: obs[[0, 2]], space)


def masked_vector(num_envs: int = 3) -> GymEnv:
    return GymEnv(gym.vector.SyncVectorEnv([masked_cartpole] * num_envs))


def masked_single() -> GymEnv:
    return GymEnv(masked_cartpole())


class GRUNet(nn.Module):
    """One GRU cell: (observation, hidden) -> (logits, next hidden)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(2, HIDDEN)
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, observation: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = observation.shape[:-1]
        nxt = self.cell(observation.reshape(-1, 2), hidden.reshape(-1, HIDDEN)).reshape(*shape, HIDDEN)
        return self.head(nxt), nxt


def gru_policy() -> TensorDictSequential:
    """A tensordict-only recurrent policy; ``recurrent_state`` declares the state and its initial value."""
    torch.manual_seed(0)
    policy = TensorDictSequential(
        TensorDictModule(
            GRUNet(), in_keys=["observation", "hidden"], out_keys=["logits", ("next", "hidden")]
        ),
        ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=Categorical, return_log_prob=True
        ),
    )
    policy.recurrent_state = {"hidden": torch.zeros(HIDDEN)}
    return policy


async def batches(collector: Any) -> list[TensorDict]:
    with anyio.fail_after(60):
        async with collector as c:
            return [b async for b in c]


def check_carried(batches_: list[TensorDict], *, both_cases: bool = True) -> tuple[bool, bool]:
    """Within and across batches: the next frame's state is this frame's ("next", state), or zeros with
    ``is_init`` after an episode end; the state fed is the one the policy used."""
    data = torch.cat(batches_, dim=-1)  # [*B, T * batches]: consecutive batches continue each row
    hidden, nxt = data["hidden"], data["next", "hidden"]
    done = data["next", "done"].squeeze(-1)
    is_init = data["is_init"].squeeze(-1)
    assert data["is_init"].dtype == torch.bool and data["is_init"].shape == (*data.batch_size, 1)
    assert not data["next", "is_init"].any()
    assert is_init[..., 0].all()  # the first frame of the first batch
    assert not (hidden[..., 0, :] != 0).any()
    assert torch.equal(is_init[..., 1:], done[..., :-1])
    cont = ~done[..., :-1]
    assert torch.equal(hidden[..., 1:, :][cont], nxt[..., :-1, :][cont])
    assert not hidden[..., 1:, :][done[..., :-1]].any()  # reset to zeros at an episode end
    if both_cases:
        assert done.any() and cont.any()
    # ("next", "hidden") is the policy's output for this frame's observation and state
    net = GRUNet()
    net.load_state_dict(gru_policy()[0].module.state_dict())
    with torch.no_grad():
        _, expected = net(data["observation"], hidden)
    assert torch.allclose(nxt, expected, atol=1e-5)
    assert nxt.abs().sum() > 0
    return bool(done.any()), bool(cont.any())


@pytest.mark.parametrize("make_env", [masked_single, masked_vector], ids=["single", "vector"])
async def test_state_is_carried_and_reset_at_episode_ends(make_env: Any) -> None:
    out = await batches(Collector(make_env, gru_policy(), frames_per_batch=60, total_frames=240, seed=1))
    assert {"hidden", "is_init", ("next", "hidden"), ("next", "is_init")} <= set(
        out[0].keys(include_nested=True)
    )
    check_carried(out)


async def test_random_frames_keep_the_state() -> None:
    """Random frames: no policy call, so the state stays (as TorchRL's primer copies it); is_init still
    marks the starts."""
    out = await batches(
        Collector(masked_single, gru_policy(), frames_per_batch=30, total_frames=60, init_random_frames=30)
    )
    first = out[0]
    assert not first["hidden"].any() and not first["next", "hidden"].any()
    done = first["next", "done"].squeeze(-1)
    assert torch.equal(first["is_init"].squeeze(-1)[1:], done[:-1])
    assert out[1]["next", "hidden"].abs().sum() > 0


async def test_max_frames_per_traj_resets_the_state() -> None:
    out = await batches(
        Collector(masked_vector, gru_policy(), frames_per_batch=30, total_frames=30, max_frames_per_traj=4)
    )
    is_init = out[0]["is_init"].squeeze(-1)
    assert torch.equal(is_init, (torch.arange(10) % 4 == 0).expand(3, 10))
    assert not out[0]["hidden"][is_init].any()
    check_carried(out)


@pytest.mark.parametrize("backend", ["serial", "process"])
async def test_multi_sync_gives_the_collectors_batches(backend: str) -> None:
    """A seeded run: MultiSyncCollector's one worker collects what Collector collects."""
    ours = await batches(Collector(masked_vector, gru_policy(), frames_per_batch=30, total_frames=90, seed=5))
    multi = await batches(
        MultiSyncCollector(
            [masked_vector],
            gru_policy(),
            frames_per_batch=30,
            total_frames=90,
            seed=5,
            worker_backend=backend,
        )
    )
    assert len(ours) == len(multi) == 3
    for a, b in zip(ours, multi, strict=True):
        b = b[0]
        for key in ("observation", "hidden", ("next", "hidden"), "is_init", "action", ("next", "done")):
            assert torch.equal(a[key], b[key]), key
    check_carried([b[0] for b in multi])


async def test_multi_async_carries_the_state_per_worker() -> None:
    out = await batches(
        # 240 frames: with 120 (10 steps per env a batch), the sampled episodes outlasted every batch of both
        # workers in about 1 run in 100 (a CartPole episode lasts some 20 steps: P(> 20) ~ 0.45, 6 envs)
        MultiAsyncCollector([masked_vector] * 2, gru_policy(), frames_per_batch=30, total_frames=240)
    )
    by_worker: dict[int, list[TensorDict]] = {}
    for batch in out:
        by_worker.setdefault(int(batch["collector", "worker_id"].flatten()[0]), []).append(batch)
    # a worker may deliver a single short batch (the other one the rest): the cases are checked overall
    seen = [check_carried(rows, both_cases=False) for rows in by_worker.values()]
    assert any(d for d, _ in seen) and any(c for _, c in seen)


def test_fast_path_and_tensordict_path_agree() -> None:
    """The compiled key graph returns the ("next", state) output, bit-identical to the TensorDict path."""
    from aiocollect._policies._runners import make_runner

    obs = {
        "observation": torch.randn(3, 2),
        "hidden": torch.randn(3, HIDDEN),
        "is_init": torch.zeros(3, 1, dtype=torch.bool),
    }
    runner = make_runner(
        gru_policy(),
        batch_shape=(3,),
        obs_keys=list(obs),
        device=None,
        next_keys=[("next", "hidden")],
    )
    first = runner(obs)
    assert getattr(runner, "uses_fast_path", None) is True
    assert ("next", "hidden") in first
    torch.manual_seed(0)
    fast = runner(obs)
    torch.manual_seed(0)
    slow = runner.slow(obs)
    assert list(fast) == list(slow)
    assert all(torch.equal(fast[k], slow[k]) for k in slow)


class NoInitial(nn.Module):
    def forward(self, observation: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(observation.shape[:-1], dtype=torch.int64), h


async def test_a_state_without_an_initial_value_is_refused() -> None:
    policy = TensorDictModule(NoInitial(), in_keys=["observation", "h"], out_keys=["action", ("next", "h")])
    with pytest.raises(TypeError, match=r"policy.recurrent_state = \{'h'"):
        Collector(masked_single, policy, frames_per_batch=8)


async def test_a_state_output_of_the_wrong_shape_is_refused() -> None:
    policy = TensorDictModule(NoInitial(), in_keys=["observation", "h"], out_keys=["action", ("next", "h")])
    policy.recurrent_state = {"h": torch.zeros(3)}

    def wrong(observation: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(observation.shape[:-1], dtype=torch.int64), torch.zeros(4)

    policy.module.forward = wrong
    with pytest.raises(ValueError, match=r"\('next', 'h'\) has shape \(4,\).*recurrent state 'h'"):
        Collector(masked_single, policy, frames_per_batch=8)


def test_random_policy_is_not_recurrent() -> None:
    """No policy: no state entries, no is_init (nothing changes for non-recurrent policies)."""

    async def main() -> TensorDict:
        return (await batches(Collector(masked_single, frames_per_batch=8, total_frames=8)))[0]

    batch = anyio.run(main)
    assert not {"is_init", "hidden"} & set(batch.keys())
    assert np.isfinite(batch["observation"].numpy()).all()
