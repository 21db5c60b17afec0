"""TorchRL multi-agent envs (issue 18): a small ``EnvBase`` with an agent group (VMAS' layout: per-agent
observations, actions, rewards and done flags under ``"agents"``, the env's own done flags at the top)
collects what TorchRL's own collector collects, in process and in a worker process.

Run in the torchrl virtualenv: ``nox -s torchrl`` (or ``.venv-torchrl/bin/python -m pytest -m torchrl``).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

pytest.importorskip("torchrl")

from torchrl.collectors import Collector as TorchRLCollector
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase, SerialEnv

from aiocollect import Collector, MultiSyncCollector

pytestmark = [pytest.mark.torchrl, pytest.mark.anyio]

AGENTS = 3


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Walkers(EnvBase):
    """``AGENTS`` walkers on a line stepping -1, 0 or +1 towards 0; reward ``-|position|`` per agent; the
    episode terminates when all are at 0 and truncates after ``max_steps``."""

    def __init__(self, max_steps: int = 7, top_flags: bool = True) -> None:
        super().__init__(batch_size=())
        self.max_steps = max_steps
        self.top_flags = top_flags
        n = AGENTS
        flag = Categorical(2, shape=(1,), dtype=torch.bool)
        agent_flag = Categorical(2, shape=(n, 1), dtype=torch.bool)
        self.full_observation_spec = Composite(
            agents=Composite(observation=Unbounded(shape=(n, 1)), shape=(n,)),
            steps=Unbounded(shape=(1,), dtype=torch.int64),
        )
        self.full_action_spec = Composite(agents=Composite(action=Categorical(3, shape=(n,)), shape=(n,)))
        self.full_reward_spec = Composite(agents=Composite(reward=Unbounded(shape=(n, 1)), shape=(n,)))
        group = {"done": agent_flag.clone(), "terminated": agent_flag.clone()}
        if top_flags:
            self.full_done_spec = Composite(
                done=flag.clone(),
                terminated=flag.clone(),
                truncated=flag.clone(),
                agents=Composite(group, shape=(n,)),
            )
        else:  # PettingZoo's layout: the flags of the group only
            group["truncated"] = agent_flag.clone()
            self.full_done_spec = Composite(agents=Composite(group, shape=(n,)))
        self.generator = torch.Generator().manual_seed(0)

    def _set_seed(self, seed: int | None) -> None:
        self.generator.manual_seed(seed or 0)

    def _out(self, pos: torch.Tensor, steps: torch.Tensor, **agents: torch.Tensor) -> TensorDict:
        terminated = (pos == 0).all().reshape(1)
        truncated = (steps >= self.max_steps) & ~terminated
        done = terminated | truncated
        group = TensorDict(
            {
                "observation": pos,
                "done": done.expand(AGENTS, 1).clone(),
                "terminated": terminated.expand(AGENTS, 1).clone(),
                **agents,
            },
            batch_size=(AGENTS,),
        )
        if not self.top_flags:
            group["truncated"] = truncated.expand(AGENTS, 1).clone()
            return TensorDict({"agents": group, "steps": steps}, batch_size=())
        return TensorDict(
            {"agents": group, "steps": steps, "done": done, "terminated": terminated, "truncated": truncated},
            batch_size=(),
        )

    def _reset(self, td: TensorDict | None) -> TensorDict:
        pos = torch.randint(1, 4, (AGENTS, 1), generator=self.generator).float()
        return self._out(pos, torch.zeros(1, dtype=torch.int64))

    def _step(self, td: TensorDict) -> TensorDict:
        pos = td["agents", "observation"]
        move = td["agents", "action"].unsqueeze(-1).float() - 1
        pos = torch.where(pos == 0, pos, (pos + move).clamp(-3, 3))
        return self._out(pos, td["steps"] + 1, reward=-pos.abs())


def walkers() -> Walkers:
    env = Walkers()
    env.set_seed(3)
    return env


def group_flag_walkers() -> Walkers:
    env = Walkers(top_flags=False)
    env.set_seed(3)
    return env


def serial_walkers() -> SerialEnv:
    return SerialEnv(2, walkers)


class Homing(torch.nn.Module):
    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (1 - torch.sign(observation[..., 0])).to(torch.int64)


def homing() -> TensorDictModule:
    return TensorDictModule(Homing(), in_keys=[("agents", "observation")], out_keys=[("agents", "action")])


def leaves(td: TensorDict) -> dict[Any, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in td.items(include_nested=True, leaves_only=True)}


def torchrl_batches(make_env: Any, frames: int, n: int, **kwargs: Any) -> list[TensorDict]:
    theirs = TorchRLCollector(
        make_env,
        homing(),
        frames_per_batch=frames,
        total_frames=frames * n,
        auto_register_policy_transforms=False,
        **kwargs,
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
            if key != ("collector", "traj_ids"):
                assert torch.equal(a[key], b[key]), key


async def test_batches_match_torchrl() -> None:
    theirs = torchrl_batches(walkers, 24, 2)
    ours = await our_batches(Collector(walkers, homing(), frames_per_batch=24, total_frames=48))
    assert_same(ours, theirs)
    data = torch.cat(ours)
    assert data["next", "done"].any() and ("next", "reward") not in data.keys(include_nested=True)
    # trajectory ids follow the env's own done flags
    done = data["next", "done"].squeeze(-1)
    ids = data["collector", "traj_ids"]
    assert torch.equal(ids[1:] != ids[:-1], done[:-1])


async def test_worker_processes_and_batched_envs_match_torchrl() -> None:
    theirs = torchrl_batches(serial_walkers, 24, 2)
    ours = await our_batches(
        MultiSyncCollector([serial_walkers], homing(), frames_per_batch=24, total_frames=48)
    )
    assert_same([b[0] for b in ours], theirs)


async def test_random_frames_draw_every_group_action() -> None:
    ours = await our_batches(Collector(walkers, frames_per_batch=30, total_frames=30))
    action = ours[0]["agents", "action"]
    assert action.shape == (30, AGENTS) and set(action.unique().tolist()) == {0, 1, 2}


async def test_an_env_with_group_flags_only() -> None:
    """PettingZoo's layout (no top-level done flags): TorchRL's keys and values, plus the env-level flags
    (any agent's), which TorchRL's batch does not have."""
    theirs = torchrl_batches(group_flag_walkers, 24, 2)
    ours = await our_batches(Collector(group_flag_walkers, homing(), frames_per_batch=24, total_frames=48))
    for a, b in zip(ours, theirs, strict=True):
        extra = set(leaves(a)) - set(leaves(b))
        assert extra == {flag for flag in ("done", "terminated", "truncated")} | {
            ("next", flag) for flag in ("done", "terminated", "truncated")
        }
        for key in b.keys(include_nested=True, leaves_only=True):
            if key != ("collector", "traj_ids"):
                assert torch.equal(a[key], b[key]), key
        assert torch.equal(a["next", "done"], b["next", "agents", "done"].any(-2))
    assert torch.cat(ours)["next", "done"].any()


def long_group_walkers() -> Walkers:
    """Group flags only, episodes long enough that a batch end cuts them."""
    env = Walkers(max_steps=50, top_flags=False)
    env.set_seed(3)
    return env


@pytest.mark.filterwarnings("ignore:split_trajs=True produces:UserWarning")  # torchrl's advisory
@pytest.mark.parametrize("split_trajs", [False, True], ids=["batches", "split_trajs"])
@pytest.mark.parametrize("multi", [False, True], ids=["Collector", "MultiSyncCollector"])
async def test_set_truncated_sets_the_groups_flags_as_torchrl(split_trajs: bool, multi: bool) -> None:
    """TorchRL's set_truncated sets every truncated key of env.done_keys (here the group's only) and the
    done beside it on the last frame; ours gives the same batches, split or not."""
    kw: dict[str, Any] = {"set_truncated": True, "split_trajs": split_trajs}
    theirs = torchrl_batches(long_group_walkers, 12, 2, **kw)
    if multi:
        collector: Any = MultiSyncCollector(
            [long_group_walkers], homing(), frames_per_batch=12, total_frames=24, **kw
        )
    else:
        collector = Collector(long_group_walkers, homing(), frames_per_batch=12, total_frames=24, **kw)
    ours = await our_batches(collector)
    if multi and not split_trajs:
        ours = [b[0] for b in ours]
    cut = 0
    for a, b in zip(ours, theirs, strict=True):
        for key in b.keys(include_nested=True, leaves_only=True):
            if key[-1] in ("traj_ids", "mask") or key[0] == "collector":
                continue
            assert torch.equal(a[key], b[key]), key
        cut += int(b["next", "agents", "truncated"].any(-2).sum())
    assert cut >= 2  # the flags were set (torchrl's batches have them)
