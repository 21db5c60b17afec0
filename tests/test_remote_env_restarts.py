"""Served envs whose server goes away (issue 28's "remote env server killed and restarted").

A :class:`aiocollect.RemoteEnv` whose server dies fails its call with a ``ConnectionError``. Under
``restart=``, ``AsyncEnvCollector`` closes it and builds a new one from its factory, which connects anew:
attempts made while the server is down fail and count against the budget (with the policy's backoff
between them), and once a server listens on the same address again the run goes on. A server that does not
come back within the budget ends the run with the connection error.
"""

from __future__ import annotations

import functools
import socket
import time
from typing import Any

import anyio
import gymnasium as gym
import pytest

from aiocollect import AsyncEnvCollector, RemoteEnv, RestartPolicy, serve_envs_process
from support import Timing, take
from test_restarts import check_async_contract, one_backend

pytestmark = pytest.mark.anyio

TOKEN = "remote-env-restarts-token-0123456789"
ENVS = 2
BATCH = 32


@pytest.fixture
async def refused_once() -> None:
    """One refused connection before the leak baseline: uvloop opens a descriptor of its own (on
    ``/dev/null``, kept until the loop closes) at a loop's first refused connection."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(OSError):
        await anyio.connect_tcp("127.0.0.1", port)


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def remote_envs(url: str) -> list[Any]:
    """One factory per served env: each call is a new client (its connection opens at its first call)."""
    space = cartpole()
    return [
        functools.partial(
            RemoteEnv,
            url,
            index=i,
            token=TOKEN,
            observation_space=space.observation_space,
            action_space=space.action_space,
            connect_timeout=2.0,
        )
        for i in range(ENVS)
    ]


async def test_remote_envs_reconnect_to_a_restarted_server(refused_once: None, leaks: Any) -> None:
    policy = RestartPolicy(max_restarts=100, window=60.0, backoff=0.05, max_backoff=0.2)
    total = BATCH * 12
    async with serve_envs_process([cartpole] * ENVS, token=TOKEN) as first:
        url, port = first.url, first.port
        collector = AsyncEnvCollector(
            remote_envs(url), frames_per_batch=BATCH, total_frames=total, seed=5, restart=policy
        )
        async with collector, collector.events(kinds=["restarted"]) as events:
            before = await take(collector, 3)
            assert collector.statistics().restarts == 0
            first.kill()
            await first.aclose()
            restarted = []
            with anyio.fail_after(5):  # every env notices: its restarts begin while no server listens
                async for event in events:
                    restarted.append(event)
                    if {e.env for e in restarted} == set(range(ENVS)):
                        break
            async with serve_envs_process([cartpole] * ENVS, port=port, token=TOKEN):
                after = await take(collector, seconds=60)
            while (event := events.receive_nowait()) is not None:
                restarted.append(event)
    batches = before + after
    assert sum(b.numel() for b in batches) == total
    restarts = collector.statistics().restarts
    # an event per attempt as it is made, so the events agree with the count even for an env that was still
    # reconnecting when the frame budget ran out (its attempts in the events, not yet a rebuilt env)
    assert restarts >= ENVS and len(restarted) == restarts
    assert {e.env for e in restarted} == set(range(ENVS))
    for env in range(ENVS):  # each env's events number its attempts 1, 2, ... with none missing
        numbers = [e.restarts for e in restarted if e.env == env]
        assert numbers == list(range(1, len(numbers) + 1))
    assert all("Error" in e.cause for e in restarted)
    # fresh trajectory ids after each restart, none reused; the trajectory in flight at the kill ends
    # truncated where its last frame was not delivered yet (so at most one cut per restart)
    assert check_async_contract(batches) <= restarts


@one_backend()  # CI's runs of the suite take one backend each (--loop-tier)
async def test_a_server_that_stays_away_spends_the_budget(
    refused_once: None, leaks: Any, timing: Timing
) -> None:
    policy = RestartPolicy(max_restarts=3, window=60.0, backoff=0.05, max_backoff=0.1)
    async with serve_envs_process([cartpole] * ENVS, token=TOKEN) as server:
        collector = AsyncEnvCollector(remote_envs(server.url), frames_per_batch=BATCH, restart=policy)
        with pytest.raises(ConnectionError):
            async with collector:
                await take(collector, 2)
                server.kill()
                killed = time.monotonic()
                await take(collector, seconds=30)
    # each env's budget: three refused attempts with 0.05-0.1 s of backoff between them, then the error
    # from the first env whose budget is spent, within the fault matrix's 2 s bound plus those backoffs
    timing.bound(time.monotonic() - killed, 2.0 + 0.05 + 0.1 + 0.1, "the spent budget's error")
    assert policy.max_restarts <= collector.statistics().restarts <= ENVS * policy.max_restarts
