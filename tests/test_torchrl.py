"""torchrl interop: torchrl envs as ``create_env_fn``, torchrl policies, replay buffers, MultiStep, compat.

Run in the torchrl virtualenv: ``nox -s torchrl`` (or ``.venv-torchrl/bin/python -m pytest -m torchrl``).
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

pytest.importorskip("torchrl")

from torchrl.collectors import Collector as TorchRLCollector
from torchrl.data import (
    Composite,
    LazyTensorStorage,
    MultiStep,
    NonTensor,
    ReplayBuffer,
    SliceSampler,
    TensorDictReplayBuffer,
    Unbounded,
)
from torchrl.envs import (
    EnvBase,
    ExplorationType,
    GymEnv,
    SerialEnv,
    StepCounter,
    TransformedEnv,
)
from torchrl.modules import MLP, NormalParamExtractor, ProbabilisticActor, QValueActor, TanhNormal

import aiocollect
from aiocollect import (
    Collector,
    MultiAsyncCollector,
    MultiSyncCollector,
    compat,
)
from aiocollect._envs._adapter import ArrayEnv
from aiocollect._policies._runners import TorchRLRandomPolicy, random_policy_for

pytestmark = [pytest.mark.torchrl, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    """asyncio only: torchrl does not care about the loop, and the full backend matrix runs elsewhere."""
    return "asyncio"


# -- envs and policies (module level: the process workers unpickle them) --------------------------
def pendulum() -> GymEnv:
    return GymEnv("Pendulum-v1")


def pendulum_steps() -> TransformedEnv:
    return TransformedEnv(GymEnv("Pendulum-v1"), StepCounter(7))


def cartpole_steps() -> TransformedEnv:
    return TransformedEnv(GymEnv("CartPole-v1"), StepCounter(5))


def cartpole_serial() -> SerialEnv:
    return SerialEnv(2, lambda: GymEnv("CartPole-v1"))


def pendulum_serial() -> SerialEnv:
    return SerialEnv(3, pendulum_steps)


def pendulum_actor(seed: int = 0) -> ProbabilisticActor:
    torch.manual_seed(seed)
    net = nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[16]), NormalParamExtractor())
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(
        module,
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": -2.0, "high": 2.0},
        return_log_prob=True,
    )


def cartpole_qvalue() -> QValueActor:
    """A torchrl Q-value policy: one-hot actions, as torchrl's GymEnv('CartPole-v1') wants."""
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    try:
        spec = env.action_spec
    finally:
        env.close()
    return QValueActor(MLP(in_features=4, out_features=2, num_cells=[8]), in_keys=["observation"], spec=spec)


def leaves(td: TensorDict) -> dict[object, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in td.items(include_nested=True, leaves_only=True)}


async def first_batch(collector) -> TensorDict:
    with anyio.fail_after(60):
        async for batch in collector:
            return batch
    raise AssertionError("no batch")


# -- the env adapter ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "batch", "obs", "action"),
    [
        (pendulum, (), {"observation": ((3,), torch.float32)}, ((1,), torch.float32)),
        (
            cartpole_steps,
            (),
            {"observation": ((4,), torch.float32), "step_count": ((1,), torch.int64)},
            ((2,), torch.int64),  # OneHot
        ),
        (
            lambda: GymEnv("CartPole-v1", categorical_action_encoding=True),
            (),
            {"observation": ((4,), torch.float32)},
            ((), torch.int64),  # Categorical
        ),
        (cartpole_serial, (2,), {"observation": ((4,), torch.float32)}, ((2,), torch.int64)),
    ],
)
def test_specs_map_to_keys_shapes_dtypes(make, batch, obs, action) -> None:
    env = make()
    try:
        arrays = ArrayEnv(env)
        assert arrays.batch_shape == batch
        assert {k: (s.shape, s.dtype) for k, s in arrays.obs_specs.items()} == obs
        assert (arrays.action_spec.shape, arrays.action_spec.dtype) == action
        assert arrays.has_truncated
        assert isinstance(random_policy_for(arrays), TorchRLRandomPolicy)
        root = arrays.reset()
        assert set(root) == set(obs)
        step = arrays.step(random_policy_for(arrays).sample(batch))
        assert set(step.next_obs) == set(obs)
    finally:
        env.close()


class SpecEnv(EnvBase):
    """A minimal torchrl env whose specs the test chooses (the refused ones among them)."""

    def __init__(self, observation=None, action=None, reward=None) -> None:
        super().__init__(batch_size=())
        self.observation_spec = Composite(observation or {"observation": Unbounded(shape=(3,))})
        self.action_spec = action if action is not None else Composite(action=Unbounded(shape=(1,)))
        self.reward_spec = reward if reward is not None else Unbounded(shape=(1,))

    def _reset(self, td):
        return self.observation_spec.zero().update(self.full_done_spec.zero())

    def _step(self, td):
        out = self.observation_spec.zero().update(self.full_done_spec.zero())
        return out.update(self.full_reward_spec.zero())

    def _set_seed(self, seed):
        pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"observation": {"text": NonTensor(shape=())}}, r"unsupported torchrl spec .*'text'.*NonTensor"),
        (
            {"observation": {"observation": Unbounded(shape=(3,), dtype=torch.bfloat16)}},
            "dtype torch.bfloat16, which numpy lacks",
        ),
        ({"observation": {"collector": Composite(x=Unbounded(shape=(1,)))}}, "collide with the batch keys"),
        (
            {"action": Composite(agents=Composite(act=Unbounded(shape=(1,))))},
            r"action keys \[\('agents', 'act'\)\]",
        ),
        ({"action": Composite(act=Unbounded(shape=(1,)))}, r"action keys \['act'\]"),
        ({"reward": Unbounded(shape=(2,))}, "one reward per env"),
    ],
    ids=["non-tensor", "bfloat16", "reserved-key", "group-action-key", "action-key", "vector-reward"],
)
def test_unsupported_specs_raise_clear_errors(kwargs, message) -> None:
    env = SpecEnv(**kwargs)
    try:
        with pytest.raises(TypeError, match=message):
            ArrayEnv(env)
    finally:
        env.close()


def test_a_minimal_env_base_subclass_is_collected() -> None:
    async def main() -> TensorDict:
        async with Collector(SpecEnv, frames_per_batch=8, total_frames=8) as c:
            return await first_batch(c)

    batch = anyio.run(main)
    assert batch["next", "reward"].shape == (8, 1)
    assert not batch["next", "done"].any()


# -- collectors with torchrl envs -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("make_env", "make_policy", "frames"),
    [
        (pendulum_steps, pendulum_actor, 40),
        (cartpole_steps, cartpole_qvalue, 40),
        (cartpole_serial, None, 40),
    ],
    ids=["pendulum-actor", "cartpole-qvalue", "serial-random"],
)
async def test_batch_layout_matches_torchrl_collector(make_env, make_policy, frames) -> None:
    """Same keys, shapes and dtypes as torchrl's own Collector on the same env and policy."""
    policy = make_policy() if make_policy is not None else None
    async with Collector(make_env, policy, frames_per_batch=frames, total_frames=frames, seed=0) as ours:
        batch = await first_batch(ours)
    theirs = TorchRLCollector(
        make_env,
        policy,
        frames_per_batch=frames,
        total_frames=frames,
        auto_register_policy_transforms=False,
    )
    try:
        reference = next(iter(theirs))
    finally:
        theirs.shutdown()
    assert leaves(batch) == leaves(reference)
    assert batch.batch_size == reference.batch_size
    assert batch.names[-1] == "time"


async def test_episode_ends_resets_and_truncation_follow_the_env() -> None:
    """StepCounter(7) truncates: final obs in ('next', ...), reset obs in the next frame, new traj id."""
    async with Collector(pendulum_serial, pendulum_actor(), frames_per_batch=60, total_frames=60) as c:
        batch = await first_batch(c)
    assert batch.batch_size == (3, 20)
    step_count = batch["next", "step_count"].squeeze(-1)
    truncated = batch["next", "truncated"].squeeze(-1)
    assert torch.equal(truncated, step_count == 7)
    assert torch.equal(batch["next", "done"].squeeze(-1), truncated)
    ids = batch["collector", "traj_ids"]
    obs, nxt = batch["observation"], batch["next", "observation"]
    for t in range(19):
        going_on = ~truncated[:, t]
        assert torch.equal(obs[going_on, t + 1], nxt[going_on, t])
        assert torch.equal(ids[:, t + 1] == ids[:, t], going_on)
        assert torch.equal(
            batch["step_count"][truncated[:, t], t + 1].squeeze(-1) == 0, truncated[truncated[:, t], t]
        )
    assert len(set(ids.flatten().tolist())) == 3 * math.ceil(20 / 7)


async def test_max_frames_per_traj_resets_only_the_sub_envs_that_reached_it() -> None:
    """Our own truncation goes through a partial reset (``_reset`` mask) of a SerialEnv."""
    async with Collector(
        lambda: SerialEnv(2, pendulum_steps), frames_per_batch=40, total_frames=40, max_frames_per_traj=3
    ) as c:
        batch = await first_batch(c)
    count = batch["next", "step_count"].squeeze(-1)
    assert count.max() == 3
    assert torch.equal(batch["next", "truncated"].squeeze(-1), count == 3)
    assert torch.equal(
        batch["step_count"][:, 3:].squeeze(-1), batch["next", "step_count"][:, 2:-1].squeeze(-1) % 3
    )


async def test_random_frames_come_from_rand_action() -> None:
    env = pendulum()
    calls = []
    rand_action = env.rand_action

    def counting(td=None):
        calls.append(1)
        return rand_action(td)

    env.rand_action = counting
    policy = TensorDictModule(lambda obs: torch.zeros(*obs.shape[:-1], 1), ["observation"], ["action"])
    async with Collector(env, policy, frames_per_batch=32, total_frames=64, init_random_frames=32) as c:
        batches = [b async for b in c]
    assert len(calls) == 32
    random, policy_batch = batches[0]["action"], batches[1]["action"]
    assert random.abs().max() <= 2.0 and random.std() > 0.1
    assert torch.equal(policy_batch, torch.zeros_like(policy_batch))


async def test_seeded_runs_are_reproducible() -> None:
    async def run() -> TensorDict:
        async with Collector(pendulum, pendulum_actor(), frames_per_batch=50, total_frames=50, seed=3) as c:
            return await first_batch(c)

    a, b = await run(), await run()
    assert (a == b).all()


async def test_deterministic_exploration_type() -> None:
    """The collector runs the policy under its exploration type: DETERMINISTIC gives the mode."""
    from torchrl.envs.utils import set_exploration_type

    policy = pendulum_actor()
    async with Collector(
        pendulum,
        policy,
        frames_per_batch=20,
        total_frames=20,
        exploration_type=ExplorationType.DETERMINISTIC,
    ) as c:
        batch = await first_batch(c)
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        expected = policy(batch.select("observation").clone())["action"]
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        sampled = policy(batch.select("observation").clone())["action"]
    # the collector ran one observation per call, this check all 20 at once: float32 matmuls of different
    # shapes may round differently (3.1023e-4 vs 3.1027e-4 was seen), hence an absolute tolerance
    assert torch.allclose(batch["action"], expected, atol=1e-6)
    assert not torch.allclose(batch["action"], sampled, atol=1e-6)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_multi_process_collectors_with_torchrl_envs_and_policies(sync: bool) -> None:
    policy = pendulum_actor()
    if sync:
        collector = MultiSyncCollector(
            [pendulum_serial] * 2, policy, frames_per_batch=30, total_frames=90, track_policy_version=True
        )
    else:
        collector = MultiAsyncCollector(
            [pendulum_serial, pendulum_steps],
            policy,
            frames_per_batch=15,
            total_frames=90,
            track_policy_version=True,
        )
    versions = []
    async with collector as c:
        with anyio.fail_after(60):
            async for batch in c:
                assert {"action", "loc", "scale", "action_log_prob", "step_count"} <= set(batch.keys())
                assert batch.batch_size == ((2, 3, 5) if sync else (15,) if batch.ndim == 1 else (3, 5))
                versions.append(int(batch["collector", "policy_version"].max()))
                await c.update_weights(policy, wait=True)
    assert versions[0] == 0 and versions[-1] >= 1


# -- replay buffers and postprocessing ------------------------------------------------------------
async def test_replay_buffer_slice_sampler_never_crosses_trajectories() -> None:
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(2_000),
        sampler=SliceSampler(slice_len=6, traj_key=("collector", "traj_ids"), strict_length=True),
        batch_size=60,
    )
    frames = 0
    async with Collector(pendulum_serial, pendulum_actor(), frames_per_batch=150, total_frames=600) as c:
        with anyio.fail_after(60):
            async for batch in c:
                rb.extend(batch.reshape(-1))  # env-major: each env's steps contiguous
                frames += batch.numel()
    assert len(rb) == frames == 600
    expected = {
        "observation": ((60, 3), torch.float32),
        "action": ((60, 1), torch.float32),
        ("next", "reward"): ((60, 1), torch.float32),
        ("next", "done"): ((60, 1), torch.bool),
        ("collector", "traj_ids"): ((60,), torch.int64),
        "step_count": ((60, 1), torch.int64),
    }
    for _ in range(20):
        sample = rb.sample()
        layout = leaves(sample)
        for key, spec in expected.items():
            assert layout[key] == spec, key
        ids = sample["collector", "traj_ids"].reshape(10, 6)
        obs = sample["observation"].reshape(10, 6, 3)
        nxt = sample["next", "observation"].reshape(10, 6, 3)
        steps = sample["step_count"].reshape(10, 6)
        for row in range(10):
            assert (ids[row] == ids[row, 0]).all(), "a slice crossed a trajectory"
            assert torch.equal(obs[row, 1:], nxt[row, :-1])
            assert torch.equal(steps[row, 1:] - steps[row, :-1], torch.ones(5, dtype=torch.int64))


async def test_collector_extends_a_torchrl_replay_buffer() -> None:
    rb = ReplayBuffer(storage=LazyTensorStorage(256), batch_size=16)
    async with Collector(pendulum, frames_per_batch=64, total_frames=128, replay_buffer=rb) as c:
        out = [frames async for frames in c.fill()]
    assert out == [64, 64]
    assert len(rb) == 128
    assert rb.sample()["next", "observation"].shape == (16, 3)


async def test_multistep_as_postproc() -> None:
    gamma, n = 0.9, 3
    async with Collector(
        pendulum_steps, pendulum_actor(), frames_per_batch=30, total_frames=30, postproc=MultiStep(gamma, n)
    ) as c:
        batch = await first_batch(c)
    raw = batch["next", "original_reward"].squeeze(-1)
    done = batch["next", "done"].squeeze(-1)
    reward = batch["next", "reward"].squeeze(-1)
    for t in range(30):
        expected, discount = 0.0, 1.0
        for k in range(n):
            if t + k >= 30:
                break
            expected += discount * float(raw[t + k])
            discount *= gamma
            if done[t + k]:
                break
        assert reward[t].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert batch["steps_to_next_obs"].max() <= n


# -- policies work unchanged ----------------------------------------------------------------------
async def test_torchrl_policies_on_our_gym_env() -> None:
    """A TensorDictSequential and a ProbabilisticActor run as they are on aiocollect.GymEnv too."""
    seq = TensorDictSequential(
        TensorDictModule(nn.Linear(3, 8), ["observation"], ["hidden"]),
        TensorDictModule(nn.Sequential(nn.Tanh(), nn.Linear(8, 1)), ["hidden"], ["action"]),
    )
    async with Collector(lambda: aiocollect.GymEnv("Pendulum-v1", num_envs=2), seq, frames_per_batch=20) as c:
        batch = await first_batch(c)
    assert batch["hidden"].shape == (2, 10, 8)
    async with Collector(
        lambda: aiocollect.GymEnv("Pendulum-v1"), pendulum_actor(), frames_per_batch=20
    ) as c:
        batch = await first_batch(c)
    assert batch["action_log_prob"].shape == (20,)


# -- aiocollect.compat: a torchrl-style script ----------------------------------------------------
async def test_torchrl_style_script_through_compat() -> None:
    """A torchrl training-loop skeleton: only the imports changed and ``async`` was added."""
    from aiocollect.compat import SyncDataCollector, aenumerate

    # --- what a torchrl script looks like, async ---
    env_maker = pendulum_steps
    policy = pendulum_actor()
    collector = SyncDataCollector(
        env_maker,
        policy,
        frames_per_batch=50,
        total_frames=200,
        device="cpu",
        storing_device="cpu",
        max_frames_per_traj=-1,
        init_random_frames=-1,
        split_trajs=False,
        reset_at_each_iter=False,
        exploration_type=ExplorationType.RANDOM,
        return_same_td=False,
        reset_when_done=True,
    )
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1_000), batch_size=32)
    optim = torch.optim.Adam(policy.parameters(), lr=1e-3)
    collected = 0
    with anyio.fail_after(60):
        async for i, data in aenumerate(collector):  # noqa: B007 - i is checked after the loop
            collected += data.numel()
            rb.extend(data)
            loss = -policy(rb.sample().select("observation"))["action_log_prob"].mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            await collector.update_policy_weights_()
    await collector.shutdown()
    # --- end of script ---
    assert i == 3 and collected == 200
    assert collector.policy_version == 4
    own = collector.policy.module[0].module[0][0].weight
    assert torch.equal(own, policy.module[0].module[0][0].weight)
    assert own.data_ptr() != policy.module[0].module[0][0].weight.data_ptr()  # copied, not aliased
    assert collector.inner.closed


async def test_compat_multi_collectors_with_torchrl_envs() -> None:
    collector = compat.MultiSyncDataCollector(
        pendulum_steps,
        num_workers=2,
        policy_factory=pendulum_actor,
        frames_per_batch=40,
        total_frames=80,
        create_env_kwargs=None,
        cat_results="stack",
        device=["cpu", "cpu"],
    )
    shapes = []
    with anyio.fail_after(60):
        async for data in collector:
            shapes.append(tuple(data.batch_size))
            assert "action_log_prob" in data
    assert shapes == [(2, 20), (2, 20)]
    assert collector.inner.closed  # the end of the iteration shut it down
    collector = compat.MultiaSyncDataCollector(
        [pendulum_steps, pendulum], pendulum_actor(), frames_per_batch=20, total_frames=40
    )
    with anyio.fail_after(60):
        async with collector:
            async for data in collector:
                assert data.batch_size == (20,)
                assert await collector.update_policy_weights_() >= 1
    collector = compat.aSyncDataCollector(pendulum, None, frames_per_batch=20, total_frames=20)
    with anyio.fail_after(60):
        assert (await collector.next()).batch_size == (20,)
        assert await collector.next() is None


def test_compat_split_trajectories_matches_torchrl_on_real_ids() -> None:
    from torchrl.collectors.utils import split_trajectories as torchrl_split

    ids = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 2, 3]])
    td = TensorDict(
        {"x": torch.arange(10.0).reshape(2, 5), ("collector", "traj_ids"): ids, ("next", "done"): ids < 0},
        batch_size=[2, 5],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torchrl_split(td.clone())
    ours = compat.split_trajectories(td.clone())
    mask = ours["collector", "mask"]
    assert torch.equal(mask, theirs["collector", "mask"])
    assert torch.equal(ours["x"][mask], theirs["x"][mask])
    assert (ours["collector", "traj_ids"][~mask] == -1).all()


def test_random_policy_samples_the_env_action_spec() -> None:
    env = cartpole_serial()
    try:
        arrays = ArrayEnv(env)
        arrays.reset()
        action = random_policy_for(arrays).sample((2,))
        assert action.shape == (2, 2) and (action.sum(-1) == 1).all()  # one-hot
        assert np.isfinite(action.numpy()).all()
    finally:
        env.close()


# -- the docs' torchrl examples ---------------------------------------------------------------------
DOCS = Path(__file__).resolve().parent.parent / "docs"
#: a ```python block marked for this suite (the default suite's doc runner skips it), and the ```text
#: block that shows its output, if one follows
_TORCHRL_BLOCK = re.compile(
    r"^<!-- torchrl -->\s*\n<!-- skip -->\s*\n```python[^\n]*\n(.*?)^```\s*\n(?:\s*```text\n(.*?)^```)?",
    re.S | re.M,
)


def torchrl_doc_blocks() -> list[tuple[str, str, str | None]]:
    out = []
    for page in ("torchrl-interop.md", "migrating-from-torchrl.md"):
        text = (DOCS / page).read_text()
        for match in _TORCHRL_BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            out.append((f"{page}:{line}", match.group(1), match.group(2)))
    return out


@pytest.mark.parametrize(
    ("where", "source", "expected"), [pytest.param(*block, id=block[0]) for block in torchrl_doc_blocks()]
)
def test_torchrl_doc_example(where: str, source: str, expected: str | None, capsys, monkeypatch) -> None:
    """Each example runs as a script would (``__name__ == "__main__"``), in this process (torchrl is
    imported already), and prints what the page shows."""
    monkeypatch.syspath_prepend(str(DOCS))
    exec(compile(source, where, "exec"), {"__name__": "__main__"})
    if expected is not None:
        assert capsys.readouterr().out.strip() == expected.strip()


def cartpole_steps_seeded() -> TransformedEnv:
    env = cartpole_steps()
    env.set_seed(0)
    return env


async def test_step_count_of_a_step_counter_matches_torchrl() -> None:
    """A TorchRL env with StepCounter: "step_count" and ("next", "step_count") flow through as TorchRL's
    collector writes them (values too, with a deterministic policy on a seeded env)."""
    policy = cartpole_qvalue()
    async with Collector(cartpole_steps_seeded, policy, frames_per_batch=24, total_frames=24) as c:
        ours = await first_batch(c)
    theirs = TorchRLCollector(
        cartpole_steps_seeded,
        policy,
        frames_per_batch=24,
        total_frames=24,
        auto_register_policy_transforms=False,
    )
    try:
        reference = next(iter(theirs))
    finally:
        theirs.shutdown()
    for key in ("step_count", ("next", "step_count"), ("next", "truncated"), ("next", "done"), "observation"):
        assert torch.equal(ours[key], reference[key]), key
    assert ours["next", "step_count"].max() == 5 and ours["next", "truncated"].any()
