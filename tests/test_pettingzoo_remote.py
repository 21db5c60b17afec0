"""``PettingZooEnv`` and a policy per group through the remote collectors (issue 41): each node hosts a
collector over the env, and the dict policy's weights travel as one policy's (``nox -s distributed``)."""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle
import pytest
import torch
from torch import nn

pytest.importorskip("mpe2")

from mpe2 import simple_spread_v3

from aiocollect import DistributedCollector, PettingZooEnv, RPCCollector

os.environ.setdefault("TP_SOCKET_IFNAME", "lo")

pytestmark = [pytest.mark.distributed, pytest.mark.anyio, pytest.mark.timeout(180)]

# the nodes unpickle what they run: ship this module's functions by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return ("asyncio", {})


def make() -> PettingZooEnv:
    return PettingZooEnv(lambda: simple_spread_v3.parallel_env(max_cycles=5), num_envs=2)


class Greedy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(18, 5)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


@pytest.mark.parametrize("collector_class", [DistributedCollector, RPCCollector])
async def test_remote_collectors_take_pettingzoo_envs_and_a_policy_per_group(collector_class: Any) -> None:
    torch.manual_seed(0)
    policy = {"agent": Greedy()}
    first = dict(policy["agent"].state_dict())
    versions = []
    async with collector_class(make, policy, frames_per_batch=20, total_frames=80, num_collectors=2) as c:
        async for batch in c:
            assert batch["agent", "observation"].shape == (2, 10, 3, 18)
            if not versions:  # collected with the weights the collector was made with
                greedy = Greedy()
                greedy.load_state_dict(first)
                assert torch.equal(batch["agent", "action"], greedy(batch["agent", "observation"]))
            with torch.no_grad():
                policy["agent"].net.weight.normal_()
            versions.append(await c.update_weights(policy))
    assert versions == [1, 2, 3, 4]
