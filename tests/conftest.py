"""Shared fixtures: every async test runs under asyncio, asyncio+uvloop and trio (anyio's plugin)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import anyio
import anyio.from_thread
import gymnasium as gym
import pytest
import torch

import aiocollect
from aiocollect import GymEnv

BACKENDS = [
    pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="asyncio+uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param


@pytest.fixture(autouse=True)
def _torch_threads():
    """One intra-op thread: the CI machine has 2 cores and tests run env + policy in threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rollout_threads() -> list[threading.Thread]:
    """Threads other than the main one and the idle worker threads of anyio (asyncio) and trio."""
    return [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread()
        and "AnyIO worker thread" not in t.name
        and not t.name.startswith("Trio thread")
    ]


# -- helpers for the Collector tests ---------------------------------------------------------------
# (test envs, a minimal replay buffer and thread checks; imported by tests/test_collector_*.py)

_PACKAGE_DIR = os.path.dirname(aiocollect.__file__)


def threads_in_package_code() -> list[str]:
    """Names of the threads (other than this one) now running aiocollect code: a rollout still going.

    Idle worker threads (anyio's or trio's) wait in their own modules, and an idle rollout thread waits
    for a job, so they do not count.
    """
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    busy = []
    for ident, frame in sys._current_frames().items():
        f: Any = frame
        if f.f_code.co_filename.endswith("_rollout_thread.py"):
            continue  # a collector's rollout thread between jobs (no rollout code on its stack): idle
        while ident != me and f is not None:
            if f.f_code.co_filename.startswith(_PACKAGE_DIR):
                busy.append(names.get(ident, str(ident)))
                break
            f = f.f_back
    return busy


class EnvFailure(Exception):
    """Raised by the test envs (a type of our own, so a test sees it is the original exception)."""


def explode_in_step() -> None:
    raise EnvFailure("step failed")


def explode_in_reset() -> None:
    raise EnvFailure("reset failed")


class HookedEnv(gym.Wrapper):
    """A gymnasium env whose ``step`` can sleep or raise, and whose ``reset`` can raise; counts calls.

    ``in_step`` is the number of ``step`` calls running now (0 once a rollout has really stopped).
    ``on_step(n)``, when set, is called (in the rollout thread) after the ``n``-th step.
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        step_delay: float = 0.0,
        fail_step_at: int | None = None,
        fail_reset_at: int | None = None,
    ) -> None:
        super().__init__(env)
        self.step_delay = step_delay
        self.fail_step_at = fail_step_at
        self.fail_reset_at = fail_reset_at
        self.steps = 0
        self.resets = 0
        self.in_step = 0
        self.on_step: Any = None

    def step(self, action: Any) -> Any:
        self.in_step += 1
        try:
            self.steps += 1
            if self.step_delay:
                time.sleep(self.step_delay)  # a slow env, running in the rollout thread
            if self.fail_step_at is not None and self.steps >= self.fail_step_at:
                explode_in_step()
            out = self.env.step(action)
            if self.on_step is not None:
                self.on_step(self.steps)
            return out
        finally:
            self.in_step -= 1

    def reset(self, **kwargs: Any) -> Any:
        self.resets += 1
        if self.fail_reset_at is not None and self.resets >= self.fail_reset_at:
            explode_in_reset()
        return self.env.reset(**kwargs)


class EnvFactory:
    """``create_env_fn`` that records its calls; ``hooks`` (a :class:`HookedEnv` per env) when hooked."""

    def __init__(self, env_id: str = "CartPole-v1", *, num_envs: int | None = None, **hooks: Any):
        self.env_id = env_id
        self.num_envs = num_envs
        self.hook_kwargs = hooks
        self.calls = 0
        self.envs: list[GymEnv] = []
        self.hooks: list[HookedEnv] = []

    def __call__(self) -> GymEnv:
        self.calls += 1
        if self.hook_kwargs:
            hooked = HookedEnv(gym.make(self.env_id), **self.hook_kwargs)
            self.hooks.append(hooked)
            env = GymEnv(hooked)
        else:
            env = GymEnv(self.env_id, num_envs=self.num_envs)
        self.envs.append(env)
        return env


class ListBuffer:
    """A minimal replay buffer: ``extend`` appends; ``await wait_for(n)`` waits for ``n`` batches.

    ``extend`` may run in a worker thread (the collector's rollout thread): it then wakes the waiter
    through ``anyio.from_thread``. Create it inside the async test (its thread is the loop's).
    While ``paused`` is True, every ``extend`` is counted in ``violations``.
    """

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.paused = False
        self.violations = 0
        self._loop_thread = threading.get_ident()
        self._token = anyio.lowlevel.current_token()
        self._grew: anyio.Event | None = None

    def extend(self, batch: Any) -> None:
        if self.paused:
            self.violations += 1
        self.batches.append(batch)
        if threading.get_ident() == self._loop_thread:
            self._notify()
        else:
            anyio.from_thread.run_sync(self._notify, token=self._token)

    def _notify(self) -> None:
        if self._grew is not None:
            self._grew.set()

    async def wait_for(self, n: int) -> None:
        while len(self.batches) < n:
            self._grew = anyio.Event()
            await self._grew.wait()
