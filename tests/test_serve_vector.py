"""Remote vector envs: ``RemoteVectorEnv`` against a ``serve_envs`` server of single envs or of one
gymnasium vector env (``vector_env_fn``).

Every async test runs under asyncio, asyncio+uvloop and trio; the ``clean`` fixture checks that no socket,
thread or process is left.
"""

from __future__ import annotations

import contextlib
import itertools
import ssl
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from aiocollect import (
    AsyncEnvCollector,
    GymEnv,
    RemoteConnectionError,
    RemoteEnv,
    RemoteEnvPool,
    RemoteVectorEnv,
    serve_envs,
    serve_envs_process,
)
from aiocollect._serve._wire import decode, encode, pack_tree, unpack_tree
from aiocollect._serve._ws import connect
from support import Timing, wait_until
from test_serve import (  # noqa: F401  (fixtures)
    assert_connection_lost,
    assert_heartbeat_gave_up,
    certificate,
    clean,
    stopped,
    wait_dropped_by_server,
    warm_loop,
)

# servers: every loop in the README's run
pytestmark = [pytest.mark.anyio, pytest.mark.all_loops, pytest.mark.usefixtures("clean")]

TOKEN = "serve-vector-token-0123456789"


def cartpole() -> gym.Env[Any, Any]:
    return gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))


def local_vector(
    n: int, mode: AutoresetMode = AutoresetMode.SAME_STEP
) -> gym.vector.VectorEnv[Any, Any, Any]:
    return gym.vector.SyncVectorEnv([cartpole] * n, autoreset_mode=mode)


class DictObs(gym.Env[Any, Any]):
    """Dict observations, Box actions; the episode ends after ``3 + k`` steps (``k`` from the seed)."""

    observation_space = spaces.Dict(
        {"pos": spaces.Box(-10, 10, (2,), np.float32), "steps": spaces.Discrete(100)}
    )
    action_space = spaces.Box(-1, 1, (2,), np.float32)

    def __init__(self, step_delay: float = 0.0) -> None:
        self.step_delay, self.steps = step_delay, 0
        self.length, self.pos = 3, np.zeros(2, np.float32)
        self.stepping = threading.Event()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.length, self.steps = 3 + int(self.np_random.integers(0, 3)), 0
        self.pos = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return {"pos": self.pos.copy(), "steps": 0}, {"length": self.length}

    def step(self, action: Any) -> Any:
        self.stepping.set()
        if self.step_delay:
            time.sleep(self.step_delay)
        self.pos = self.pos + action
        self.steps += 1
        obs = {"pos": self.pos.copy(), "steps": self.steps}
        return obs, float(self.pos.sum()), self.steps >= self.length, False, {}


def assert_same(got: Any, expected: Any) -> None:
    """Equal observations, rewards, flags or infos (dicts and object columns compared item by item)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), (got, expected)
        for key in expected:
            if key != "t":  # RecordEpisodeStatistics' wall-clock time
                assert_same(got[key], expected[key])
    elif isinstance(expected, np.ndarray) and expected.dtype == object:
        assert got.dtype == object and got.shape == expected.shape
        for g, e in zip(got, expected, strict=True):
            assert (g is None) == (e is None)
            if e is not None:
                assert_same(g, e)
    else:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("host", ["single envs", "vector env", "next-step vector env"])
async def test_round_trip_equals_a_local_vector_env(host: str) -> None:
    n = 4
    mode = AutoresetMode.NEXT_STEP if host == "next-step vector env" else AutoresetMode.SAME_STEP
    server = (
        serve_envs([cartpole] * n, token=TOKEN)
        if host == "single envs"
        else serve_envs(vector_env_fn=lambda: local_vector(n, mode), token=TOKEN)
    )
    local = local_vector(n)
    rng = np.random.default_rng(0)
    async with server, await RemoteVectorEnv.open(server.url, token=TOKEN) as env:
        assert env.num_envs == n
        assert env.single_observation_space == local.single_observation_space
        assert env.single_action_space == local.single_action_space
        ends = 0
        for seed in (0, 7):
            obs, info = await env.reset(seed=seed)
            expected, expected_info = local.reset(seed=seed)
            assert_same(obs, expected)
            assert_same(info, expected_info)
            for _ in range(80):
                actions = rng.integers(0, 2, n)
                got = await env.step(torch.from_numpy(actions) if ends % 2 else actions)
                want = local.step(actions)
                for g, w in zip(got[:4], want[:4], strict=True):
                    assert_same(g, w)
                if host == "next-step vector env" and "final_info" in want[4]:
                    # the partial reset's infos are not merged: final_info holds every sub-env's step info
                    assert_same(got[4]["final_obs"], want[4]["final_obs"])
                    assert_same(got[4]["_final_obs"], want[4]["_final_obs"])
                else:
                    assert_same(got[4], want[4])
                ends += int(got[2].sum() + got[3].sum())
        assert ends > 10  # the final observations were checked many times


async def test_dict_observations_and_box_actions() -> None:
    n = 3
    local = gym.vector.SyncVectorEnv([DictObs] * n, autoreset_mode=AutoresetMode.SAME_STEP)
    async with (
        serve_envs([DictObs] * (n + 1), token=TOKEN) as server,
        await RemoteVectorEnv.open(server.url, token=TOKEN, start=1, stop=n + 1) as env,
    ):
        assert (env.num_envs, env.start) == (n, 1)
        (obs, info), (expected, expected_info) = await env.reset(seed=3), local.reset(seed=3)
        assert_same(obs, expected)
        assert_same(info, expected_info)
        for t in range(12):
            actions = np.full((n, 2), 0.1 * t, np.float32)
            got, want = await env.step(actions), local.step(actions)
            for g, w in zip(got, want, strict=True):
                assert_same(g, w)
        with pytest.raises(ValueError, match="shape"):
            await env.step(np.zeros((n + 1, 2), np.float32))  # refused here, before sending


async def test_a_plain_lambda_makes_one_and_bad_actions_are_refused() -> None:
    async with serve_envs([cartpole] * 3, token=TOKEN) as server:
        make = lambda: RemoteVectorEnv(server.url, token=TOKEN)  # noqa: E731  (as a collector's env_fns)
        env = await anyio.to_thread.run_sync(make)
        here = RemoteVectorEnv(server.url, token=TOKEN, stop=2)  # on the server's own loop: no fetch
        async with env, here:
            assert (env.num_envs, here.num_envs) == (3, 2)
            await env.reset(seed=0)
            with pytest.raises(ValueError, match="not in Discrete"):
                await env.step(np.array([0, 1, 2]))  # checked on the server, before any env steps
            with pytest.raises(ValueError, match="integers"):
                await env.step(np.zeros(3, np.float32))  # refused here
            obs, *_ = await env.step(np.array([0, 1, 1]))
            assert obs.shape == (3, 4)
            # its envs are taken while it is connected: another client waits for them, then gets 409
            with pytest.raises(TimeoutError):
                await RemoteEnv.open(server.url, index=0, token=TOKEN, connect_timeout=0.2)


async def test_wrong_token_is_refused_before_the_env() -> None:
    made: list[DictObs] = []

    def make() -> DictObs:
        made.append(DictObs())
        return made[-1]

    async with serve_envs([make] * 2, token=TOKEN) as server:
        with pytest.raises(PermissionError, match="token"):
            await RemoteVectorEnv.open(server.url, token="wrong-token-0123456789", stop=2)
        with pytest.raises(PermissionError):
            await connect(server.url, "/vector/0/2", TOKEN[:-1])
        with pytest.raises(PermissionError):
            RemoteVectorEnv(server.url.replace("127.0.0.1", "localhost"), token="wrong-token-0123456789")
        assert all(env.steps == 0 and not env.stepping.is_set() for env in made)


async def test_object_info_columns_travel_as_their_items() -> None:
    column = np.array([None, "a", {"x": np.arange(3)}, 2.5], dtype=object)
    arrays: list[Any] = []
    header, got = decode(encode({"op": "step", "info": pack_tree({"note": column}, arrays)}, arrays))
    back = unpack_tree(header["info"], got)["note"]
    assert back.dtype == object and back.shape == (4,)
    assert back[0] is None and back[1] == "a" and back[3] == 2.5
    np.testing.assert_array_equal(back[2]["x"], np.arange(3))


async def test_what_a_vector_host_refuses() -> None:
    with pytest.raises(TypeError, match="not both"):
        serve_envs([cartpole], vector_env_fn=lambda: local_vector(2))
    with pytest.raises(TypeError, match="vector_env_fn must be a callable"):
        serve_envs(vector_env_fn=local_vector(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return a gymnasium vector env"):
        async with serve_envs(vector_env_fn=cartpole):
            pass
    async with serve_envs([cartpole, lambda: gym.make("Pendulum-v1")], token=TOKEN) as server:
        with pytest.raises(ValueError, match="do not share their spaces"):
            await RemoteVectorEnv.open(server.url, token=TOKEN)
    numpy_cartpole = lambda: gym.make_vec("CartPole-v1", 4, vectorization_mode="vector_entry_point")  # noqa: E731
    with pytest.raises(ValueError, match="cannot be reset in part"):
        async with serve_envs(vector_env_fn=numpy_cartpole):
            pass
    async with serve_envs(vector_env_fn=lambda: GymEnv("CartPole-v1", num_envs=4), token=TOKEN) as server:
        with pytest.raises(TypeError, match=r"connect with aiocollect\.RemoteVectorEnv"):
            await RemoteEnv.open(server.url, index=1, token=TOKEN)
        with pytest.raises(TypeError, match=r"connect with aiocollect\.RemoteVectorEnv"):
            async with RemoteEnvPool(server.url, token=TOKEN):
                pass
        with pytest.raises(ValueError, match="stepped whole"):
            await RemoteVectorEnv.open(server.url, token=TOKEN, start=1)
        async with await RemoteVectorEnv.open(server.url, token=TOKEN) as env:  # GymEnv's vector env
            obs, _ = await env.reset(seed=0)
            assert obs.shape == (4, 4) and env.num_envs == 4


async def test_cancelled_step_leaves_nothing_and_reconnects() -> None:
    async with serve_envs([lambda: DictObs(step_delay=0.3)] * 2, token=TOKEN) as server:
        env = await RemoteVectorEnv.open(server.url, token=TOKEN)
        await env.reset(seed=0)
        with anyio.move_on_after(0.05) as scope:
            await env.step(np.zeros((2, 2), np.float32))
        assert scope.cancelled_caught
        with anyio.fail_after(10):  # a new connection (the old one was out of turn)
            obs, *_ = await env.step(np.zeros((2, 2), np.float32))
        assert obs["pos"].shape == (2, 2)
        await env.close()
        with pytest.raises(RuntimeError, match="is closed"):
            await env.reset()


async def test_server_killed_mid_run_fails_within_two_seconds(timing: Timing) -> None:
    async with serve_envs_process(vector_env_fn=lambda: local_vector(8), token=TOKEN) as server:
        env = await RemoteVectorEnv.open(server.url, token=TOKEN)
        try:
            await env.reset(seed=0)
            failed: list[float] = []
            running = anyio.Event()

            async def run() -> None:
                with pytest.raises(RemoteConnectionError) as info:
                    for step in range(10**9):
                        await env.step(np.zeros(8, np.int64))
                        if step == 20:
                            running.set()
                assert_connection_lost(str(info.value))  # from the socket, not a heartbeat given up
                failed.append(time.monotonic())

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run)
                    await running.wait()
                    killed_at = time.monotonic()
                    server.kill()
            assert failed
            timing.bound(failed[0] - killed_at, 2.0, "the error")
            with pytest.raises(RemoteConnectionError):
                await env.reset()  # reconnecting fails too: the server is gone
        finally:
            await env.close()


async def test_a_stopped_server_fails_the_call_within_its_timeout() -> None:
    fast = {"heartbeat_interval": 0.05, "heartbeat_timeout": 0.25}
    async with (
        serve_envs_process([cartpole] * 2, token=TOKEN) as server,
        await RemoteVectorEnv.open(server.url, token=TOKEN, **fast) as env,
    ):
        await env.reset(seed=0)
        async with stopped(server):  # (every thread of it stopped: none answers the step)
            # within 5 s: not a hang, nor a reconnection (it would wait connect_timeout, 10 s)
            with anyio.fail_after(5), pytest.raises(RemoteConnectionError) as info:
                await env.step(np.zeros(2, np.int64))
        assert_heartbeat_gave_up(str(info.value))


FAST = {"heartbeat_interval": 0.05, "heartbeat_timeout": 0.25}


def vector_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiocollect-vector-envs")]


async def test_long_steps_and_idle_clients_are_not_silence() -> None:
    """A vector connection is served by a thread of its own: a step of 0.6 s (over twice the heartbeat
    timeout) is not taken for silence, and an idle client is dropped with IDLE_CLOSE and reconnects."""
    async with serve_envs([lambda: DictObs(step_delay=0.3)] * 2, token=TOKEN, **FAST) as server:
        async with await RemoteVectorEnv.open(server.url, token=TOKEN, **FAST) as env:
            assert len(vector_threads()) == 2  # the connection's thread and its keep-alive
            await env.reset(seed=0)
            with anyio.fail_after(5):
                obs, *_ = await env.step(np.zeros((2, 2), np.float32))  # 2 x 0.3 s in one step
            ws = env._ws
            assert ws is not None and not ws.closed
            await wait_dropped_by_server(ws)  # nobody reads this idle connection: the server drops it
            with anyio.fail_after(5):
                obs, *_ = await env.step(np.zeros((2, 2), np.float32))  # on a new connection, sent once
            assert env._ws is not ws and ws.close_code == 4408
            assert obs["steps"].tolist() == [2, 2]
        await wait_until(lambda: not vector_threads(), 5)  # the server's threads end with the connection


async def test_the_server_drops_a_silent_vector_client_and_frees_its_envs() -> None:
    async with serve_envs([cartpole] * 2, token=TOKEN, **FAST) as server:
        silent = await connect(server.url, "/vector/0/2", TOKEN)  # no heartbeat: it never reads again
        try:
            with anyio.fail_after(5):  # the envs are free again once the server gave up on it
                async with await RemoteVectorEnv.open(server.url, token=TOKEN, **FAST) as env:
                    await env.reset(seed=0)
            with pytest.raises(RemoteConnectionError, match="4408"):
                while True:
                    await silent.receive()  # the spaces it did not read, then the server's close
        finally:
            await silent.abort()


async def test_leaving_the_server_ends_its_vector_threads_mid_step(timing: Timing) -> None:
    envs: list[DictObs] = []

    def made() -> DictObs:
        envs.append(DictObs(step_delay=0.3))
        return envs[-1]

    async def step(env: RemoteVectorEnv) -> None:
        with pytest.raises(RemoteConnectionError):
            await env.step(np.zeros((2, 2), np.float32))
        await env.close()

    async with anyio.create_task_group() as tg:
        async with serve_envs([made] * 2, token=TOKEN) as server:
            env = await RemoteVectorEnv.open(server.url, token=TOKEN)
            await env.reset(seed=0)
            tg.start_soon(step, env)
            with anyio.fail_after(5):
                await anyio.to_thread.run_sync(envs[0].stepping.wait)
            started = time.monotonic()
        # left mid-step: the client's connection ends at once; the step finishes, then the thread
        timing.bound(time.monotonic() - started, 2.0, "leaving the server")
        assert not vector_threads()


async def test_tls(certificate: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:  # noqa: F811
    server_tls, client_tls = certificate
    async with serve_envs(
        vector_env_fn=lambda: local_vector(2), token=TOKEN, ssl_context=server_tls
    ) as server:
        assert server.url.startswith("wss://")
        async with contextlib.AsyncExitStack() as stack:
            env = await stack.enter_async_context(
                await RemoteVectorEnv.open(server.url, token=TOKEN, ssl_context=client_tls)
            )
            await env.reset(seed=0)
            assert (await env.step(np.ones(2, np.int64)))[0].shape == (2, 4)
        with pytest.raises(RemoteConnectionError, match="TLS handshake"):
            await RemoteVectorEnv.open(server.url, token=TOKEN)


async def test_async_env_collector_over_two_servers() -> None:
    """One server of 3 single envs, one hosting a vector env of 5: 8 env ids, every frame of each kept in
    order, the final observation at each episode end (a CartPole out of bounds) and the reset one after."""
    single = serve_envs([cartpole] * 3, token=TOKEN)
    vector = serve_envs(vector_env_fn=lambda: local_vector(5), token=TOKEN)
    async with single, vector, await RemoteVectorEnv.open(single.url, token=TOKEN) as first:
        made = lambda: RemoteVectorEnv(vector.url, token=TOKEN)  # noqa: E731  (made in a worker thread)
        collector = AsyncEnvCollector([first, made], frames_per_batch=96, total_frames=960, seed=1)
        with anyio.fail_after(30):
            async with collector:
                batches = [batch async for batch in collector]
    assert [b.numel() for b in batches] == [96] * 10
    data = torch.cat(batches)
    env_id = data["collector", "env_id"]
    assert set(env_id.tolist()) == set(range(8))
    obs, nxt = data["observation"], data["next", "observation"]
    terminated, done = data["next", "terminated"][:, 0], data["next", "done"][:, 0]
    out = (nxt[:, 0].abs() > 2.4) | (nxt[:, 2].abs() > 12 * 2 * np.pi / 360)
    assert torch.equal(out, terminated) and terminated.any()  # final observations at the ends, only there
    ids = data["collector", "traj_ids"]
    for e in range(8):
        rows = (env_id == e).nonzero()[:, 0].tolist()
        for a, b in itertools.pairwise(rows):
            if done[a]:  # the trajectory id changes, and a fresh episode starts
                assert ids[b] != ids[a] and obs[b].abs().max() <= 0.05
            else:
                assert torch.equal(nxt[a], obs[b]) and ids[b] == ids[a]


async def test_the_collector_ends_within_two_seconds_when_a_server_dies(timing: Timing) -> None:
    async with serve_envs_process(vector_env_fn=lambda: local_vector(8), token=TOKEN) as server:
        collector = AsyncEnvCollector([lambda: RemoteVectorEnv(server.url, token=TOKEN)], frames_per_batch=64)
        with pytest.raises(RemoteConnectionError) as info:
            async with collector:
                async for _ in collector:
                    killed_at = time.monotonic()
                    server.kill()
        assert_connection_lost(str(info.value))  # from the socket, not a heartbeat given up
        timing.bound(time.monotonic() - killed_at, 2.0, "the error")
