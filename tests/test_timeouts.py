"""worker_timeout: a hung env ends in WorkerTimeoutError instead of a hang, for every collector."""

from __future__ import annotations

import threading

import anyio
import gymnasium as gym
import numpy as np
import pytest

from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector, WorkerTimeoutError

pytestmark = pytest.mark.anyio

#: ends an in-process hang when its test is done (a stuck thread cannot be killed; left alone it would
#: outlive the test and show up in the next test's leak check)
RELEASE = threading.Event()


class HangingEnv(gym.Env):
    """Steps normally until ``hang_at``, then sleeps far longer than any test."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, hang_at: int, hang_s: float = 0.0) -> None:
        self.hang_at = hang_at
        self.hang_s = hang_s
        self.t = 0
        self.hanging = False  # in the hang now

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t == self.hang_at:
            self.hanging = True
            RELEASE.wait(self.hang_s)
            self.hanging = False
        return np.zeros(2, np.float32), 0.0, False, False, {}


def hanging():  # in a worker process: killed when the collector closes
    return GymEnv(HangingEnv(hang_at=15, hang_s=120))


#: the envs ``hanging_in_process`` built
IN_PROCESS: list[HangingEnv] = []


def hanging_in_process():  # the stuck thread cannot be killed: the test releases it (RELEASE)
    IN_PROCESS.append(HangingEnv(hang_at=15, hang_s=120))
    return GymEnv(IN_PROCESS[-1])


def healthy():
    return GymEnv(HangingEnv(hang_at=-1))


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
async def test_hung_worker_process_raises_named_error(cls):
    # the hang lasts 120 s: only the timeout can end this test within fail_after
    with anyio.fail_after(90), pytest.raises(WorkerTimeoutError, match=r"worker_timeout=0\.5"):
        async with cls([healthy, hanging], frames_per_batch=20, worker_timeout=0.5) as c:
            async for _ in c:
                pass


async def test_hung_in_process_collector_raises_named_error():
    RELEASE.clear()
    IN_PROCESS.clear()
    c = Collector(hanging_in_process, frames_per_batch=20, worker_timeout=0.5)
    try:
        with anyio.fail_after(30), pytest.raises(WorkerTimeoutError):
            async with c:
                async for _ in c:
                    pass
        (env,) = IN_PROCESS
        assert env.hanging  # raised by the timeout, while the env still hangs (not once its step returned)
        assert c.closed
    finally:
        RELEASE.set()  # the abandoned rollout thread returns from the env's step and ends
    with anyio.fail_after(10):
        for thread in threading.enumerate():
            if thread.name.startswith("aiocollect-rollout"):
                await anyio.to_thread.run_sync(thread.join)


def test_bad_worker_timeout():
    with pytest.raises(ValueError, match="worker_timeout"):
        Collector(healthy, frames_per_batch=8, worker_timeout=0)
    with pytest.raises(ValueError, match="worker_timeout"):
        MultiSyncCollector([healthy], frames_per_batch=8, worker_timeout=-1)
