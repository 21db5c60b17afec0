"""TorchRL recurrent policies (issue 18): an ``LSTMModule`` policy on a partially observed env collects what
TorchRL's own collector collects, whether the env carries the state (``InitTracker`` + the module's
``TensorDictPrimer``) or the collector does (a plain env).

Run in the torchrl virtualenv: ``nox -s torchrl`` (or ``.venv-torchrl/bin/python -m pytest -m torchrl``).
"""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential

pytest.importorskip("torchrl")

from torchrl.collectors import Collector as TorchRLCollector
from torchrl.envs import Compose, GymWrapper, InitTracker, SerialEnv, StepCounter, TransformedEnv
from torchrl.modules import GRUModule, LSTMModule

from aiocollect import Collector, MultiSyncCollector

pytestmark = [pytest.mark.torchrl, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- module level: the worker processes unpickle them ---------------------------------------------
def masked_cartpole() -> gym.Env[Any, Any]:
    env = gym.make("CartPole-v1")
    space = gym.spaces.Box(env.observation_space.low[[0, 2]], env.observation_space.high[[0, 2]])
    return gym.wrappers.TransformObservation(env, lambda obs: obs[[0, 2]], space)


def lstm(kind: str = "lstm") -> Any:
    torch.manual_seed(0)
    cls = LSTMModule if kind == "lstm" else GRUModule
    return cls(input_size=2, hidden_size=8, in_key="observation", out_key="embed")


def recurrent_policy(kind: str = "lstm") -> TensorDictSequential:
    """A deterministic policy (argmax of a linear head on the LSTM/GRU embedding)."""
    module = lstm(kind)
    head = TensorDictModule(torch.nn.Linear(8, 2), in_keys=["embed"], out_keys=["logits"])
    act = TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"])
    return TensorDictSequential(module, head, act)


def plain_env() -> TransformedEnv:
    """No InitTracker, no primer: the collector carries the state (TorchRL's collector cannot)."""
    env = TransformedEnv(GymWrapper(masked_cartpole(), categorical_action_encoding=True), StepCounter(6))
    env.set_seed(0)
    return env


def primed_env(kind: str = "lstm") -> TransformedEnv:
    """TorchRL's recipe: InitTracker and the recurrent module's primer, so the env carries the state."""
    env = plain_env()
    env.append_transform(Compose(InitTracker(), lstm(kind).make_tensordict_primer()))
    return env


def primed_gru() -> TransformedEnv:
    return primed_env("gru")


def leaves(td: TensorDict) -> dict[Any, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in td.items(include_nested=True, leaves_only=True)}


def torchrl_batches(make_env: Any, policy: Any, frames: int, n: int) -> list[TensorDict]:
    theirs = TorchRLCollector(
        make_env,
        policy,
        frames_per_batch=frames,
        total_frames=frames * n,
        auto_register_policy_transforms=False,
    )
    try:
        return [b.clone() for b in theirs]
    finally:
        theirs.shutdown()


async def our_batches(collector: Any) -> list[TensorDict]:
    with anyio.fail_after(60):
        async with collector as c:
            return [b async for b in c]


def assert_same(ours: list[TensorDict], theirs: list[TensorDict]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert leaves(a) == leaves(b)
        for key in b.keys(include_nested=True, leaves_only=True):
            if key == ("collector", "traj_ids"):
                continue
            assert torch.allclose(a[key].float(), b[key].float(), atol=1e-6), key


@pytest.mark.parametrize(
    ("make_env", "kind"), [(primed_env, "lstm"), (primed_gru, "gru")], ids=["lstm", "gru"]
)
async def test_env_carried_state_matches_torchrl(make_env: Any, kind: str) -> None:
    """InitTracker + primer in the env: same keys, shapes, dtypes and values as TorchRL's collector."""
    theirs = torchrl_batches(make_env, recurrent_policy(kind), 20, 3)
    ours = await our_batches(
        Collector(make_env, recurrent_policy(kind), frames_per_batch=20, total_frames=60)
    )
    assert_same(ours, theirs)
    data = torch.cat(ours)
    state = "recurrent_state_h" if kind == "lstm" else "recurrent_state"
    assert data["is_init"].any() and data["next", state].abs().sum() > 0


async def test_collector_carried_state_matches_torchrl_with_a_primed_env() -> None:
    """A plain env (no InitTracker, no primer): the collector carries the LSTM's state and writes is_init,
    and the batches are TorchRL's on the primed env."""
    theirs = torchrl_batches(primed_env, recurrent_policy(), 20, 3)
    ours = await our_batches(Collector(plain_env, recurrent_policy(), frames_per_batch=20, total_frames=60))
    assert_same(ours, theirs)


@pytest.mark.parametrize("make_env", [plain_env, primed_env], ids=["collector-carried", "env-carried"])
async def test_worker_processes_carry_the_state(make_env: Any) -> None:
    theirs = torchrl_batches(lambda: SerialEnv(2, primed_env), recurrent_policy(), 20, 2)
    ours = await our_batches(
        MultiSyncCollector(
            [lambda: SerialEnv(2, make_env)], recurrent_policy(), frames_per_batch=20, total_frames=40
        )
    )
    assert_same([b[0] for b in ours], theirs)


async def test_compat_auto_register_policy_transforms_gives_torchrls_batches() -> None:
    """TorchRL appends InitTracker and the primer for ``auto_register_policy_transforms=True``; compat
    accepts the keyword and the collector carries the state itself: the same batches."""
    from aiocollect import compat

    theirs = TorchRLCollector(
        plain_env,
        recurrent_policy(),
        frames_per_batch=20,
        total_frames=40,
        auto_register_policy_transforms=True,
    )
    try:
        reference = [b.clone() for b in theirs]
    finally:
        theirs.shutdown()
    collector = compat.Collector(
        plain_env,
        recurrent_policy(),
        frames_per_batch=20,
        total_frames=40,
        auto_register_policy_transforms=True,
    )
    with anyio.fail_after(60):
        ours = [await collector.next(), await collector.next()]
        await collector.shutdown()
    assert_same(ours, reference)
