"""Warnings raised inside worker processes: hidden by default, shown by ``set_worker_warnings(True)`` or
``AIOCOLLECT_WORKER_WARNINGS=1`` (read when a collector is constructed; the call takes precedence).

A shown warning prints on the worker's stderr, which is the trainer's: the process test runs a small
trainer in a subprocess and reads its stderr (pytest's fd capture cannot see a worker forked from a
forkserver started before the test). Thread workers (``worker_backend="serial"``) and the in-process
``Collector`` warn through the trainer's own filters.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import warnings

import anyio
import gymnasium as gym
import numpy as np
import pytest

import aiocollect
from aiocollect import Collector, GymEnv, MultiSyncCollector

TRAINER = textwrap.dedent(
    """
    import functools, os, sys, warnings
    import anyio, gymnasium as gym, numpy as np
    import aiocollect
    from aiocollect import GymEnv, MultiSyncCollector

    class Noisy(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def __init__(self, token):
            self.token = token

        def reset(self, *, seed=None, options=None):
            warnings.warn(f"noisy env says {self.token}", UserWarning)
            return np.zeros(2, np.float32), {}

        def step(self, action):
            return np.zeros(2, np.float32), 0.0, False, False, {}

    def make(token):
        return GymEnv(Noisy(token))

    def collector(token):
        return MultiSyncCollector([functools.partial(make, token)], frames_per_batch=4, total_frames=4)

    async def run(c):
        async with c:
            async for _ in c:
                pass
        print(f"ran {c._workers._show_warnings}", flush=True)

    async def main():
        await run(collector("default-hidden"))
        os.environ["AIOCOLLECT_WORKER_WARNINGS"] = "1"
        await run(collector("variable-shown"))
        aiocollect.set_worker_warnings(False)
        await run(collector("call-hidden"))  # the call takes precedence over the variable
        aiocollect.set_worker_warnings(None)
        c = collector("constructed-shown")  # read at construction, with the variable set
        del os.environ["AIOCOLLECT_WORKER_WARNINGS"]
        await run(c)
        aiocollect.set_worker_warnings(True)
        await run(collector("call-shown"))
        aiocollect.set_worker_warnings(None)
        await run(collector("reset-hidden"))

    if __name__ == "__main__":
        anyio.run(main)
    """
)


def test_process_workers_hide_warnings_unless_asked(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {k: v for k, v in os.environ.items() if k != "AIOCOLLECT_WORKER_WARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    shown = [line.split()[1] == "True" for line in done.stdout.splitlines()]
    assert shown == [False, True, False, True, True, False], done.stdout
    for token in ("variable-shown", "constructed-shown", "call-shown"):
        assert f"UserWarning: noisy env says {token}" in done.stderr, (token, done.stderr)
    for token in ("default-hidden", "call-hidden", "reset-hidden"):
        assert token not in done.stderr, (token, done.stderr)


class Noisy(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        warnings.warn("noisy env in a thread", UserWarning, stacklevel=2)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}


def noisy() -> GymEnv:
    return GymEnv(Noisy())


async def collect(collector) -> None:
    async with collector:
        async for _ in collector:
            pass


def run_noisy(kind: str) -> None:
    if kind == "serial":  # the env is built and reset in the worker thread, at `async with`
        collector: object = MultiSyncCollector(
            [noisy], frames_per_batch=4, total_frames=4, worker_backend="serial"
        )
    else:  # built and reset in the constructor
        collector = Collector(noisy, frames_per_batch=4, total_frames=4)
    anyio.run(collect, collector)


@pytest.mark.parametrize("show", [False, True])
@pytest.mark.parametrize("kind", ["serial", "in-process"])
def test_thread_workers_warn_through_the_trainers_filters(kind, show):
    aiocollect.set_worker_warnings(show)
    try:
        with pytest.warns(UserWarning, match="noisy env in a thread"):
            run_noisy(kind)
    finally:
        aiocollect.set_worker_warnings(None)


def test_set_worker_warnings_takes_a_bool_or_none():
    with pytest.raises(TypeError, match="set_worker_warnings"):
        aiocollect.set_worker_warnings("yes")  # type: ignore[arg-type]
    aiocollect.set_worker_warnings(None)


def test_the_variable_is_read_at_construction(monkeypatch):
    make = functools.partial(GymEnv, "CartPole-v1")
    monkeypatch.setenv("AIOCOLLECT_WORKER_WARNINGS", "1")
    shown = MultiSyncCollector([make], frames_per_batch=4)
    monkeypatch.setenv("AIOCOLLECT_WORKER_WARNINGS", "0")
    hidden = MultiSyncCollector([make], frames_per_batch=4)
    assert shown._workers._show_warnings and not hidden._workers._show_warnings
