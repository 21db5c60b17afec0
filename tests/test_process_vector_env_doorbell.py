"""``ProcessVectorEnv``'s reply reader on asyncio (``_procenv/_doorbell.py``): the worker's socket registered
with the loop once, not at every step; unregistered when nobody waits for a reply (no callback at every
loop iteration for a byte nobody reads), when the env closes, and re-registered on a new loop."""

from __future__ import annotations

import asyncio
import functools
import select

import anyio
import anyio.lowlevel
import anyio.to_thread
import gymnasium as gym
import numpy as np
import pytest

from aiocollect import ProcessVectorEnv
from support import HookedEnv, wait_gone

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the reader is asyncio's (trio and other loops use anyio.wait_readable)


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def slow() -> gym.Env:
    return HookedEnv(gym.make("CartPole-v1"), step_delay=0.3)  # type: ignore[arg-type]


async def make(*args, **kwargs) -> ProcessVectorEnv:
    return await anyio.to_thread.run_sync(functools.partial(ProcessVectorEnv, *args, **kwargs))


def registered(fd: int) -> bool:
    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    return fd in selector.get_map()


async def test_registered_once_and_unregistered_at_close(leaks):
    env = await make([cartpole] * 4, num_workers=2)
    fds = [w.sock.fileno() for w in env._workers]
    try:
        await env.reset(seed=0)
        for _ in range(20):
            await env.step(np.zeros(4, np.int64))
            # registered between steps (a worker that answered at once was read without a wait: not yet)
            assert all(w.reader._loop in (None, asyncio.get_running_loop()) for w in env._workers)
        assert any(registered(fd) for fd in fds)
    finally:
        await env.close()
    assert not any(registered(fd) for fd in fds)


async def test_a_reply_nobody_waits_for_unregisters_the_reader(leaks):
    env = await make([cartpole, slow], num_workers=2)
    worker = env._workers[1]
    try:
        await env.reset(seed=0)
        with anyio.move_on_after(0.05) as scope:
            await env.step(np.zeros(2, np.int64))
        assert scope.cancelled_caught and registered(worker.sock.fileno())
        # the reply arrives while nobody waits: the reader's one call unregisters it (level-triggered
        # readiness would otherwise call it at every loop iteration until the next step reads the byte)
        with anyio.fail_after(10):
            await anyio.to_thread.run_sync(select.select, [worker.sock], [], [], 10)
            while registered(worker.sock.fileno()):
                await anyio.lowlevel.checkpoint()
        assert worker.owed == 1
        obs, reward, *_ = await env.step(np.ones(2, np.int64))  # takes the owed reply, then steps
        assert obs.shape == (2, 4) and reward.tolist() == [1.0, 1.0] and worker.owed == 0
    finally:
        await env.close()


def test_an_env_stepped_on_two_loops_in_turn():
    env = ProcessVectorEnv([cartpole] * 2, num_workers=1)
    pids = [w.process.pid for w in env._workers]

    async def steps(close: bool) -> list[float]:
        try:
            await env.reset(seed=0)
            out = []
            for _ in range(5):
                _, reward, *_ = await env.step(np.zeros(2, np.int64))
                out += reward.tolist()
            return out
        finally:
            if close:
                await env.close()

    try:
        assert anyio.run(steps, False) == [1.0] * 10  # this loop closes with the reader registered
        assert anyio.run(steps, True) == [1.0] * 10  # a new loop: registered again
    finally:
        anyio.run(env.close)
    assert wait_gone(pids) == []
