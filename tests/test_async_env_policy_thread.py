"""``AsyncEnvCollector``'s policy thread (``_asyncenv/_policy_thread.py``): a policy's error reaches ``async
for`` with its type and traceback, a close while a policy call runs waits for the call, weight updates
interleave with calls, and nothing is left running."""

from __future__ import annotations

import threading
import traceback

import anyio
import anyio.to_thread
import gymnasium as gym
import pytest
import torch
from torch import nn

from aiocollect import AsyncEnvCollector
from support import take

pytestmark = pytest.mark.anyio


class Boom(Exception):
    pass


def cartpoles(n: int) -> list:
    return [lambda: gym.make("CartPole-v1")] * n


def policy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiocollect-policy")]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.linear(observation).argmax(-1)


async def test_policy_error_reaches_async_for_with_its_traceback() -> None:
    calls = []

    def explode_on_third(td):
        calls.append(len(td))
        if len(calls) == 3:
            raise Boom("the policy broke")
        td["action"] = torch.zeros(td.shape, dtype=torch.int64)
        return td

    before = policy_threads()
    with pytest.raises(Boom, match="the policy broke") as info:
        async with AsyncEnvCollector(cartpoles(2), explode_on_third, frames_per_batch=4, min_batch=2) as c:
            await take(c)
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "explode_on_third" in frames  # raised in the policy thread, traceback kept
    assert len(calls) == 3
    assert policy_threads() == before


async def test_close_during_a_policy_call_waits_for_it() -> None:
    entered, release = threading.Event(), threading.Event()
    log: list[str] = []

    def slow(td):
        if entered.is_set():
            raise AssertionError("a call after the close")
        entered.set()
        release.wait(10)
        log.append("call returned")
        td["action"] = torch.zeros(td.shape, dtype=torch.int64)
        return td

    before = policy_threads()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    async with AsyncEnvCollector(cartpoles(2), slow, frames_per_batch=4) as c:
                        await take(c)
                log.append("collector closed")

            scopes: list[anyio.CancelScope] = []
            tg.start_soon(consume)
            await anyio.to_thread.run_sync(entered.wait, 10)
            scopes[0].cancel()
            await anyio.wait_all_tasks_blocked()  # the close has gone as far as it can
            log.append("released")
            release.set()
    assert log == ["released", "call returned", "collector closed"]
    assert policy_threads() == before


async def test_weight_updates_reach_the_policy_thread() -> None:
    policy = Tiny()
    with torch.no_grad():
        policy.linear.weight.zero_()
        policy.linear.bias.copy_(torch.tensor([1.0, 0.0]))  # always action 0
    before = policy_threads()
    async with AsyncEnvCollector(cartpoles(4), policy, frames_per_batch=32, min_batch=2) as c:
        batches = []
        with anyio.fail_after(30):
            async for batch in c:
                batches.append(batch)
                if len(batches) == 1:
                    assert (batch["action"] == 0).all()
                    with torch.no_grad():
                        policy.linear.bias.copy_(torch.tensor([0.0, 1.0]))  # always action 1
                    await c.update_weights(policy)
                elif (batch["action"] == 1).all():
                    break
        assert len(policy_threads()) == len(before) + 1
    assert policy_threads() == before
