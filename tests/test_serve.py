"""Envs and policies served over WebSocket: ``serve_envs``/``RemoteEnv``, ``serve_policy``/``RemotePolicy``.

Every async test runs under asyncio, asyncio+uvloop and trio; the ``leaks`` fixture checks that no
socket, thread or process is left.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from typing import Any

import anyio
import anyio.abc
import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from aiocollect import (
    AsyncEnvCollector,
    RemoteConnectionError,
    RemoteEnv,
    RemoteEnvPool,
    RemotePolicy,
    RemoteVectorEnv,
    WorkerError,
    serve_envs,
    serve_envs_process,
    serve_policy,
)
from aiocollect._serve._spaces import describe_space, rebuild_space
from aiocollect._serve._wire import decode, encode, pack_tree, unpack_tree
from aiocollect._serve._ws import connect
from attacks import frame as raw_frame
from support import Timing, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.all_loops]  # servers: every loop in the README's run

TOKEN = "serve-test-token-0123456789"


@pytest.fixture
async def warm_loop() -> None:
    """uvloop (libuv) opens one fd of its own (``/dev/null``) with a loop's first TCP transport, kept
    until the loop closes: made here, before the leak baseline."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        accepted.setblocking(False)
        stream = await anyio.abc.SocketStream.from_socket(accepted)
        await stream.aclose()
        client.close()


@pytest.fixture
def clean(warm_loop: None, leaks: Any) -> Any:
    """The leak check (``leaks``), its baseline taken on a warmed loop."""
    return leaks


class CountingEnv(gym.Wrapper):
    """Counts resets and steps; ``step_delay`` seconds of (threaded) work per step; ``fail`` raises."""

    def __init__(
        self, env_id: str = "CartPole-v1", step_delay: float = 0.0, fail: type | None = None
    ) -> None:
        super().__init__(gym.make(env_id))
        self.resets = self.steps = 0
        self.step_delay, self.fail = step_delay, fail
        self.stepping = threading.Event()

    def reset(self, **kwargs: Any) -> Any:
        self.resets += 1
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> Any:
        self.steps += 1
        self.stepping.set()
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail is not None:
            raise self.fail("the env failed")
        return self.env.step(action)


class Custom(Exception):
    """An exception type the client cannot rebuild (not a builtin)."""


def made(envs: list[CountingEnv], **kwargs: Any) -> Any:
    def make() -> CountingEnv:
        envs.append(CountingEnv(**kwargs))
        return envs[-1]

    return make


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
async def test_round_trip_equals_local_env(clean: Any, env_id: str) -> None:
    local = gym.make(env_id)
    async with serve_envs([lambda: gym.make(env_id)] * 2, token=TOKEN) as server:
        env = await RemoteEnv.open(server.url, index=1, token=TOKEN)
        assert env.observation_space == local.observation_space
        assert env.action_space == local.action_space
        local.action_space.seed(0)
        for episode in range(2):
            obs, info = await env.reset(seed=episode)
            expected, expected_info = local.reset(seed=episode)
            np.testing.assert_array_equal(obs, expected)
            assert info == expected_info
            for _ in range(30):
                action = local.action_space.sample()
                got = await env.step(action)
                want = local.step(action)
                np.testing.assert_array_equal(got[0], want[0])
                assert got[1:4] == tuple(want[1:4])
                assert got[0].dtype == want[0].dtype
                if got[2] or got[3]:
                    break
        await env.close()


async def test_constructor_fetches_spaces(clean: Any) -> None:
    async with serve_envs([lambda: gym.make("Pendulum-v1")], token=TOKEN) as server:
        env = RemoteEnv(server.url, index=0, token=TOKEN)  # this process's server: no blocking fetch
        assert env.action_space == gym.make("Pendulum-v1").action_space
        with anyio.fail_after(10):
            obs, _ = await env.reset(seed=0)
        assert obs.shape == (3,)
        await env.close()
        with pytest.raises(ValueError, match="out of range"):
            RemoteEnv(server.url, index=1, token=TOKEN)


@pytest.mark.parametrize(
    "space",
    [
        spaces.Box(-1.0, 2.0, (3, 2), np.float32),
        spaces.Box(np.array([0, -np.inf]), np.array([1, np.inf]), dtype=np.float64),
        spaces.Box(0, 255, (4, 4, 3), np.uint8),
        spaces.Discrete(5, start=-2),
        spaces.MultiDiscrete([3, 4, 5]),
        spaces.MultiBinary([2, 3]),
        spaces.Dict({"pos": spaces.Box(-1, 1, (2,)), "mode": spaces.Discrete(3)}),
        spaces.Tuple([spaces.Discrete(2), spaces.Box(0, 1, (1,))]),
    ],
    ids=repr,
)
def test_spaces_are_rebuilt_from_their_description(space: spaces.Space[Any]) -> None:
    arrays: list[np.ndarray] = []
    tree = pack_tree(describe_space(space), arrays)
    header, got = decode(encode({"op": "spaces", "space": tree}, arrays))
    rebuilt = rebuild_space(unpack_tree(header["space"], got))
    assert rebuilt == space
    assert type(rebuilt) is type(space)


async def test_wrong_token_is_refused_before_the_env(clean: Any) -> None:
    envs: list[CountingEnv] = []
    async with serve_envs([made(envs)], token=TOKEN) as server:
        with pytest.raises(PermissionError, match="token"):
            await RemoteEnv.open(server.url, index=0, token="wrong-token-0123456789")
        with pytest.raises(PermissionError):
            await connect(server.url, "/envs/0", TOKEN[:-1])
        # no token at all: a plain upgrade request gets HTTP 403
        stream = await anyio.connect_tcp("127.0.0.1", server.port)
        async with stream:
            await stream.send(
                b"GET /envs/0 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            assert (await stream.receive()).startswith(b"HTTP/1.1 403")
        # an unknown index with a bad token: refused for the token, the path is not even looked at
        with pytest.raises(PermissionError):
            await connect(server.url, "/envs/7", "wrong")
        assert (envs[0].resets, envs[0].steps) == (0, 0)
        async with await RemoteEnv.open(server.url, index=0, token=TOKEN) as env:
            await env.reset()
        assert envs[0].resets == 1


async def test_pickles_and_bad_arrays_are_refused(clean: Any) -> None:
    envs: list[CountingEnv] = []
    ran = []

    class Payload:
        def __reduce__(self) -> Any:
            return ran.append, ("unpickled!",)

    refused: list[str] = []
    async with serve_envs([made(envs)], token=TOKEN) as server:
        ws = await connect(server.url, "/envs/0", TOKEN)
        try:
            assert decode(await ws.receive())[0]["op"] == "spaces"
            for frame in (
                pickle.dumps({"op": "step", "value": Payload()}),
                b"AIOC" + pickle.dumps(Payload()),
                # a well-formed message listing an object array (its 8 bytes: a pointer)
                raw_frame({"op": "step", "value": {"@": 0}, "arrays": [["|O", [1]]]}, bytes(8)),
                encode({"op": "step", "value": {"@": 0}}, [np.zeros(3)]),  # wrong shape for Discrete
            ):
                await ws.send(frame)
                header, _ = decode(await ws.receive())
                assert header["op"] == "error", header
                refused.append(header["message"])
        finally:
            await ws.aclose()
        assert ran == []
        assert envs[0].steps == 0
        assert "dtype '|O' is not accepted" in refused[2], refused  # the dtype check, not a parse error


async def test_env_errors_cross_with_their_type(clean: Any) -> None:
    async with serve_envs(
        [lambda: CountingEnv(fail=ValueError), lambda: CountingEnv(fail=Custom)], token=TOKEN
    ) as server:
        async with await RemoteEnv.open(server.url, index=0, token=TOKEN) as env:
            await env.reset()
            with pytest.raises(ValueError, match="the env failed"):
                await env.step(0)
        async with await RemoteEnv.open(server.url, index=1, token=TOKEN) as env:
            await env.reset()
            with pytest.raises(WorkerError, match="Custom: the env failed") as info:
                await env.step(1)
            assert info.value.type_name is not None and info.value.type_name.endswith("Custom")
            with pytest.raises(ValueError, match="not in Discrete"):
                await env.step(7)  # refused by the server before the env sees it


async def test_cancelled_step_leaves_nothing_and_reconnects(clean: Any) -> None:
    envs: list[CountingEnv] = []
    async with serve_envs([made(envs, step_delay=0.3)], token=TOKEN) as server:
        env = await RemoteEnv.open(server.url, index=0, token=TOKEN)
        await env.reset(seed=0)
        scope = anyio.CancelScope()

        async def step() -> None:
            with scope:
                await env.step(0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(step)
            with anyio.fail_after(10):
                await anyio.to_thread.run_sync(envs[0].stepping.wait)  # the server's env is in the step
            scope.cancel()
        assert scope.cancelled_caught
        with anyio.fail_after(10):
            obs, _ = await env.reset(seed=1)  # a new connection (the old one was out of turn)
            await env.step(1)
        assert obs.shape == (4,)
        await env.close()


async def test_server_killed_error_arrives_within_two_seconds(clean: Any, timing: Timing) -> None:
    async with serve_envs_process([lambda: CountingEnv(step_delay=5.0)], token=TOKEN) as server:
        env = await RemoteEnv.open(server.url, index=0, token=TOKEN)
        try:
            await env.reset()
            errors: list[tuple[BaseException, float]] = []

            async def step() -> None:
                try:
                    await env.step(0)
                except RemoteConnectionError as exc:
                    errors.append((exc, time.monotonic()))

            async with anyio.create_task_group() as tg:
                tg.start_soon(step)
                await anyio.wait_all_tasks_blocked()  # the step was sent: its reply is awaited
                killed_at = time.monotonic()
                server.kill()
            assert len(errors) == 1
            assert_connection_lost(str(errors[0][0]))
            timing.bound(errors[0][1] - killed_at, 2.0, "the error")
            with pytest.raises(RemoteConnectionError):
                await env.step(0)  # reconnecting fails too: the server is gone
        finally:
            await env.close()


async def test_a_connection_reset_at_once_is_a_connection_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that dies as it accepts (CI saw it: the server killed, the client reconnecting) resets the
    connection before anyio wraps the socket, whose ``getpeername`` check then raises ``ValueError``:
    that is a ``RemoteConnectionError`` naming the url, as a refused connection is."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    async def reset_at_once(sock: socket.socket) -> Any:
        raise ValueError("the socket must be connected")  # what anyio raises for ENOTCONN

    monkeypatch.setattr(anyio.abc.SocketStream, "from_socket", reset_at_once)
    try:
        with pytest.raises(RemoteConnectionError, match=f"cannot connect to ws://127.0.0.1:{port}.*reset"):
            await connect(f"ws://127.0.0.1:{port}", "/", TOKEN)
    finally:
        listener.close()


# -- policies -------------------------------------------------------------------------------------------
class CountingPolicy(TensorDictModule):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])
        self.calls = 0

    def forward(self, td: Any) -> Any:  # type: ignore[override]
        self.calls += 1
        return super().forward(td)


async def test_policy_server_batches_concurrent_requests(clean: Any) -> None:
    policy = CountingPolicy()
    inputs = [torch.randn(4, 4) for _ in range(8)]
    outputs: dict[int, torch.Tensor] = {}
    server = serve_policy(policy, token=TOKEN, max_batch=32, max_wait=5.0)
    async with server, RemotePolicy(server.url, token=TOKEN) as remote:

        async def ask(i: int) -> None:
            td = await remote(TensorDict(observation=inputs[i], batch_size=[4]))
            outputs[i] = td["action"]

        with anyio.fail_after(10):  # the 8 requests fill max_batch: one pass, long before max_wait
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(ask, i)
    assert policy.calls == 1 and server.batch_sizes == [32]
    for i, x in enumerate(inputs):
        torch.testing.assert_close(outputs[i], policy.module(x).detach())


async def test_policy_server_max_wait_bounds_latency(clean: Any) -> None:
    server = serve_policy(CountingPolicy(), token=TOKEN, max_batch=1000, max_wait=0.01)
    async with server, RemotePolicy(server.url, token=TOKEN) as remote:
        with anyio.fail_after(5):
            td = await remote(TensorDict(observation=torch.zeros(3, 4), batch_size=[3]))
    assert td["action"].shape == (3, 2) and server.forward_calls == 1


async def test_weight_update_changes_outputs(clean: Any) -> None:
    policy = CountingPolicy()
    new = torch.nn.Linear(4, 2)
    x = torch.randn(5, 4)
    async with serve_policy(policy, token=TOKEN, max_wait=0.0) as server:
        async with RemotePolicy(server.url, token=TOKEN) as remote:
            before = (await remote(TensorDict(observation=x, batch_size=[5])))["action"]
            assert await remote.update_weights({"module.weight": new.weight, "module.bias": new.bias}) == 1
            after = (await remote(TensorDict(observation=x, batch_size=[5])))["action"]
            assert remote.version == 1 == server.version
            with pytest.raises(ValueError, match="shape"):
                await remote.update_weights({"module.weight": torch.zeros(3, 4), "module.bias": new.bias})
            int_bias = {"module.weight": new.weight, "module.bias": torch.ones(2, dtype=torch.int64)}
            with pytest.raises(ValueError, match=r"'module.bias' has dtype torch.int64.*torch.float32"):
                await remote.update_weights(int_bias)
        with pytest.raises(PermissionError):
            await RemotePolicy(server.url, token="wrong-token-0123456789").update_weights(new)
    torch.testing.assert_close(after, new(x).detach())
    assert not torch.allclose(before, after)
    assert server.version == 1


# -- with AsyncEnvCollector: remote envs, central inference ---------------------------------------------
async def test_collector_over_remote_envs_and_a_remote_policy(clean: Any) -> None:
    policy = TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["logits"])

    def argmax(td: Any) -> Any:
        td["action"] = policy(td)["logits"].argmax(-1)
        return td

    server = serve_policy(argmax, token=TOKEN, max_wait=0.001)
    async with serve_envs([lambda: gym.make("CartPole-v1")] * 4, token=TOKEN) as envs, server:
        remote = RemotePolicy(server.url, token=TOKEN)
        env_fns = [lambda i=i: RemoteEnv(envs.url, index=i, token=TOKEN) for i in range(4)]
        frames = []
        async with remote, AsyncEnvCollector(env_fns, remote, frames_per_batch=64, total_frames=256) as c:
            with anyio.fail_after(30):
                async for batch in c:
                    frames.append(batch)
    batch = torch.cat(frames)
    assert batch.batch_size == (256,) and server.forward_calls > 0
    for env_id in range(4):
        mine = batch[batch["collector", "env_id"] == env_id]
        done = mine["next", "done"].squeeze(-1)
        # next observation == the following frame's observation unless the episode ended
        same = (mine["next", "observation"][:-1] == mine["observation"][1:]).all(-1)
        assert bool((same | done[:-1]).all())
        traj = mine["collector", "traj_ids"]
        assert bool(((traj[1:] != traj[:-1]) == done[:-1]).all())


async def test_collector_fails_fast_when_a_server_dies(clean: Any, timing: Timing) -> None:
    async with serve_envs_process([lambda: CountingEnv(step_delay=0.001)] * 2, token=TOKEN) as server:
        env_fns = [lambda i=i: RemoteEnv(server.url, index=i, token=TOKEN) for i in range(2)]
        collector = AsyncEnvCollector(env_fns, frames_per_batch=32)
        with pytest.raises(RemoteConnectionError) as info:
            async with collector:
                async for _ in collector:
                    killed_at = time.monotonic()
                    server.kill()
        # a dead server is seen from the closed connection, not from a heartbeat given up 10 s later
        # (the error came within 0.03 s on an idle machine)
        assert_connection_lost(str(info.value))
        timing.bound(time.monotonic() - killed_at, 5.0, "the error")


# -- RemoteEnvPool: many envs on one connection ----------------------------------------------------------
async def test_pool_round_trip_equals_local_envs(clean: Any) -> None:
    server = serve_envs([lambda: gym.make("Pendulum-v1")] * 4, token=TOKEN)
    async with server, RemoteEnvPool(server.url, token=TOKEN, start=1) as pool:
        assert [env.index for env in pool] == [1, 2, 3] and len(pool) == 3
        locals_ = [gym.make("Pendulum-v1") for _ in pool]
        for seed, (local, env) in enumerate(zip(locals_, pool, strict=True)):
            np.testing.assert_array_equal((await env.reset(seed=seed))[0], local.reset(seed=seed)[0])
        results: dict[int, Any] = {}

        async def step(i: int, env: Any, action: Any) -> None:
            results[i] = await env.step(action)

        for t in range(5):
            action = np.full(1, 0.1 * t, np.float32)
            async with anyio.create_task_group() as tg:  # concurrent calls: one message
                for i, env in enumerate(pool):
                    tg.start_soon(step, i, env, action)
            for i, local in enumerate(locals_):
                want = local.step(action)
                np.testing.assert_array_equal(results[i][0], want[0])
                assert results[i][1:4] == tuple(want[1:4])


async def test_pool_env_error_fails_only_its_call(clean: Any) -> None:
    fns = [lambda: CountingEnv(), lambda: CountingEnv(fail=ValueError)]
    async with serve_envs(fns, token=TOKEN) as server, RemoteEnvPool(server.url, token=TOKEN) as pool:
        for env in pool:
            await env.reset()
        with pytest.raises(ValueError, match="the env failed"):
            await pool[1].step(0)
        obs, *_ = await pool[0].step(0)
        assert obs.shape == (4,)
        with pytest.raises(TypeError, match="cannot be sent"):  # refused here, the connection goes on
            await pool[0].reset(options={"x": np.zeros(1, np.longdouble)})
        obs, *_ = await pool[0].step(0)
        # its envs are taken while it is open: another client waits for them (then gets HTTP 409)
        with pytest.raises(TimeoutError):
            await RemoteEnv.open(server.url, index=0, token=TOKEN, connect_timeout=0.2)


async def test_pool_server_killed_fails_pending_calls(clean: Any, timing: Timing) -> None:
    fns = [lambda: CountingEnv(step_delay=5.0)] * 2
    async with serve_envs_process(fns, token=TOKEN) as server, RemoteEnvPool(server.url, token=TOKEN) as pool:
        for env in pool:
            await env.reset()
        errors: list[float] = []

        async def step(env: Any) -> None:
            with pytest.raises(RemoteConnectionError) as info:
                await env.step(0)
            assert_connection_lost(str(info.value))
            errors.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            for env in pool:
                tg.start_soon(step, env)
            await anyio.wait_all_tasks_blocked()  # both steps sent: their replies are awaited
            killed_at = time.monotonic()
            server.kill()
        assert len(errors) == 2
        timing.bound(max(errors) - killed_at, 2.0, "the errors")
        with pytest.raises(RemoteConnectionError):
            await pool[0].reset()


@pytest.mark.parametrize("client", ["env", "pool", "vector"])
async def test_collector_cancelled_mid_step_leaves_nothing(clean: Any, client: str) -> None:
    async with serve_envs([lambda: CountingEnv(step_delay=0.02)] * 4, token=TOKEN) as server:
        async with contextlib.AsyncExitStack() as stack:
            if client == "pool":
                pool = await stack.enter_async_context(RemoteEnvPool(server.url, token=TOKEN))
                envs: list[Any] = list(pool)
            elif client == "vector":  # 2 vector clients of 2 envs each, made in a worker thread
                envs = [
                    lambda i=i: RemoteVectorEnv(server.url, token=TOKEN, start=i, stop=i + 2) for i in (0, 2)
                ]
            else:
                envs = [lambda i=i: RemoteEnv(server.url, index=i, token=TOKEN) for i in range(4)]
            with anyio.fail_after(20):
                async with AsyncEnvCollector(envs, frames_per_batch=8) as collector:
                    async for _ in collector:
                        break  # envs are mid-step now: their calls are cancelled
            assert isinstance(collector.statistics().frames, int)
        if client == "env":  # the envs are free again: new clients get them at once
            with anyio.fail_after(5):
                env = await RemoteEnv.open(server.url, index=0, token=TOKEN)
                await env.reset()
                await env.close()
        if client == "vector":
            with anyio.fail_after(5):
                async with await RemoteVectorEnv.open(server.url, token=TOKEN) as vector:
                    assert (await vector.reset(seed=0))[0].shape == (4, 4)


# -- liveness: the heartbeat ------------------------------------------------------------------------------
FAST = {"heartbeat_interval": 0.05, "heartbeat_timeout": 0.25}  # a dead peer is noticed in about 0.3 s


def _threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state ``T`` in ``/proc``)."""
    try:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:  # a thread ended meanwhile: look again
        return False
    return all(state == "T" for state in states)


@contextlib.asynccontextmanager
async def stopped(server: Any) -> Any:
    """The server process SIGSTOPped (alive, its sockets open, silent) until the block ends; entered once
    every thread of it has stopped: ``kill`` returns before that, and a thread that runs meanwhile (a
    vector connection's, woken by the request) could still answer."""
    server.send_signal(signal.SIGSTOP)
    try:
        with anyio.fail_after(10):
            while not _threads_stopped(server.pid):  # noqa: ASYNC110 - /proc gives no notice of it
                await anyio.sleep(0.005)
        yield
    finally:
        server.send_signal(signal.SIGCONT)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"heartbeat_interval": 0}, "heartbeat_interval must be seconds > 0"),
        ({"heartbeat_timeout": -1.0}, "heartbeat_timeout must be seconds > 0"),
        ({"heartbeat_interval": 5, "heartbeat_timeout": 5}, "must be longer than heartbeat_interval"),
    ],
)
def test_heartbeat_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    url = "ws://127.0.0.1:1"
    for make in (
        lambda: RemoteEnvPool(url, token=TOKEN, **kwargs),
        lambda: RemoteEnv(
            url,
            index=0,
            token=TOKEN,
            observation_space=spaces.Discrete(2),
            action_space=spaces.Discrete(2),
            **kwargs,
        ),
        lambda: RemotePolicy(url, token=TOKEN, **kwargs),
        lambda: serve_envs([lambda: gym.make("CartPole-v1")], **kwargs),
        lambda: serve_policy(CountingPolicy(), **kwargs),
        lambda: serve_envs_process([lambda: gym.make("CartPole-v1")], **kwargs),
    ):
        with pytest.raises(ValueError, match=match):
            make()
    RemoteEnvPool(url, token=TOKEN, heartbeat_interval=None)  # off


@pytest.mark.parametrize("client", ["env", "pool"])
async def test_a_stopped_server_fails_the_call_within_its_timeout(clean: Any, client: str) -> None:
    server = serve_envs_process([lambda: CountingEnv()] * 2, token=TOKEN)
    async with server, contextlib.AsyncExitStack() as stack:
        if client == "pool":
            env: Any = (await stack.enter_async_context(RemoteEnvPool(server.url, token=TOKEN, **FAST)))[1]
        else:
            env = await stack.enter_async_context(
                await RemoteEnv.open(server.url, index=1, token=TOKEN, **FAST)
            )
        await env.reset(seed=0)
        async with stopped(server):
            # within 5 s: not a hang, nor a reconnection (it would wait connect_timeout, 10 s, on the
            # stopped server); no tighter wall-clock bound, which a loaded machine's scheduling can break
            with anyio.fail_after(5), pytest.raises(RemoteConnectionError) as info:
                await env.step(0)
        assert server.url in str(info.value)
        assert_heartbeat_gave_up(str(info.value))


def assert_connection_lost(message: str) -> None:
    """``message`` says the connection closed or broke: a dead server seen from its socket at once, not from
    a heartbeat that gave up on its silence (``heartbeat_timeout`` later)."""
    assert "did not answer" not in message and ("closed" in message or "lost" in message), message


async def wait_dropped_by_server(ws: Any) -> None:
    """Wait (reading nothing from it) until the server has closed ``ws``'s connection: its socket here is
    in ``CLOSE_WAIT``, the server's FIN received."""
    local = ws._stream.extra(anyio.abc.SocketAttribute.local_address)[:2]

    def closed() -> bool:
        return any(
            tuple(c.laddr[:2]) == local and c.status == psutil.CONN_CLOSE_WAIT
            for c in psutil.Process().net_connections("tcp")
        )

    await wait_until(closed, 10)


def assert_heartbeat_gave_up(message: str) -> None:
    """``message`` is the heartbeat's: the server was silent for ``heartbeat_timeout`` (0.25 s) or more."""
    found = re.search(r"did not answer for (\d+\.\d) s \(heartbeat_timeout=0.25 s\)", message)
    assert found is not None, message
    assert float(found[1]) >= 0.2, message  # (0.25 s and more, printed with one decimal)


async def test_the_collector_ends_when_a_server_stops(clean: Any) -> None:
    server = serve_envs_process([lambda: CountingEnv()] * 4, token=TOKEN)
    async with server, RemoteEnvPool(server.url, token=TOKEN, **FAST) as pool:
        collector = AsyncEnvCollector(pool.envs, frames_per_batch=32)
        async with contextlib.AsyncExitStack() as stack:
            with pytest.raises(RemoteConnectionError) as info:
                async with collector:
                    with anyio.fail_after(10):  # not a hang (no tighter bound: a loaded machine)
                        async for _ in collector:  # the batch after the stop never comes: the error does
                            await stack.enter_async_context(stopped(server))
            assert_heartbeat_gave_up(str(info.value))


async def test_long_steps_and_idle_clients_are_not_silence(clean: Any) -> None:
    """Pings are answered while a step runs (0.6 s, over twice the timeout) and while a client idles."""
    fns = [lambda: CountingEnv(), lambda: CountingEnv(step_delay=0.6)]
    async with serve_envs(fns, token=TOKEN, **FAST) as server:
        async with RemoteEnvPool(server.url, token=TOKEN, start=1, **FAST) as pool:
            await pool[0].reset(seed=0)
            with anyio.fail_after(5):
                obs, *_ = await pool[0].step(0)
            # idle over twice the heartbeat timeout: the pool's receiver answers the server's pings (the
            # wait is the behaviour under test)
            await anyio.sleep(0.6)
            with anyio.fail_after(5):
                obs, *_ = await pool[0].step(1)
            assert pool._ws is not None and not pool._ws.closed
        async with await RemoteEnv.open(server.url, index=0, token=TOKEN, **FAST) as env:
            await env.reset(seed=0)
            with anyio.fail_after(5):
                await env.step(0)
            ws = env._ws
            await wait_dropped_by_server(ws)  # nobody reads this idle connection: the server drops it
            with anyio.fail_after(5):
                obs, *_ = await env.step(1)  # on a new connection, sent once
            assert env._ws is not ws and ws is not None and ws.close_code == 4408
    assert obs.shape == (4,)


async def test_the_server_drops_a_silent_client_and_frees_its_envs(clean: Any) -> None:
    envs: list[CountingEnv] = []
    async with serve_envs([made(envs)] * 2, token=TOKEN, **FAST) as server:
        silent = await connect(server.url, "/batch/0/2", TOKEN)  # no heartbeat: it never reads again
        try:
            with anyio.fail_after(5):  # the envs are free again once the server gave up on it
                async with RemoteEnvPool(server.url, token=TOKEN, **FAST) as pool:
                    await pool[0].reset(seed=0)
            with pytest.raises(RemoteConnectionError, match="4408"):
                while True:
                    await silent.receive()  # the spaces it did not read, then the server's close
        finally:
            await silent.abort()


async def test_remote_policy_slow_forward_and_idle_connection(clean: Any) -> None:
    def slow(td: Any) -> Any:
        time.sleep(0.6)  # a forward pass over twice the heartbeat timeout
        td["action"] = td["observation"].sum(-1)
        return td

    server = serve_policy(slow, token=TOKEN, max_wait=0.0, **FAST)
    async with server, RemotePolicy(server.url, token=TOKEN, **FAST) as remote:
        with anyio.fail_after(5):
            td = await remote(TensorDict(observation=torch.ones(2, 3), batch_size=[2]))
        assert td["action"].tolist() == [3.0, 3.0]
        (ws,) = remote._idle
        await wait_dropped_by_server(ws)  # idle, it is dropped by the server; the next call reconnects
        with anyio.fail_after(5):
            td = await remote(TensorDict(observation=torch.ones(1, 3), batch_size=[1]))
    assert server.forward_calls == 2


# -- the pool's wire: steps in columns, and what does not fit in them -------------------------------------
class DictEnv(gym.Env):
    """Dict observations and Dict actions (no column fits them), an ``info`` that is not empty."""

    observation_space = spaces.Dict({"x": spaces.Box(-10, 10, (2,), np.float32)})
    action_space = spaces.Dict({"move": spaces.Discrete(3)})

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        self.t = 0
        return {"x": np.zeros(2, np.float32)}, {}

    def step(self, action: Any) -> Any:
        self.t += 1
        return {"x": np.full(2, action["move"], np.float32)}, 0.5, False, self.t >= 3, {"t": self.t}


async def test_pool_steps_that_do_not_stack_travel_one_by_one(clean: Any) -> None:
    async with (
        serve_envs([DictEnv] * 3, token=TOKEN) as server,
        RemoteEnvPool(server.url, token=TOKEN) as pool,
    ):
        for env in pool:
            await env.reset()
        results: dict[int, Any] = {}

        async def step(i: int) -> None:
            results[i] = await pool[i].step({"move": i})

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(step, i)
    for i in range(3):
        obs, reward, terminated, truncated, info = results[i]
        np.testing.assert_array_equal(obs["x"], [i, i])
        assert (reward, terminated, truncated, info) == (0.5, False, False, {"t": 1})


async def test_pool_column_of_steps_with_a_bad_action_and_infos(clean: Any) -> None:
    """One bad action in a round of steps fails that call only; infos that are not empty come back."""
    fns = [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make("CartPole-v1"))] * 4
    async with serve_envs(fns, token=TOKEN) as server, RemoteEnvPool(server.url, token=TOKEN) as pool:
        for env in pool:
            await env.reset(seed=0)
        results: dict[int, Any] = {}

        async def step(i: int, action: int) -> None:
            try:
                results[i] = await pool[i].step(action)
            except ValueError as exc:
                results[i] = exc

        for _ in range(600):  # until some episode ends: its info carries the episode's statistics
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(step, i, 5 if i == 2 else 0)
            assert isinstance(results[2], ValueError) and "not in Discrete" in str(results[2])
            if any(r[2] or r[3] for i, r in results.items() if i != 2):
                break
            assert all(results[i][4] == {} for i in (0, 1, 3))
        ended = [r for i, r in results.items() if i != 2 and (r[2] or r[3])]
        assert ended and all(r[4]["episode"]["l"] > 0 for r in ended)


# -- TLS --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A self-signed certificate for 127.0.0.1 made here (openssl): (server context, client context)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


async def test_tls_envs_and_policy(clean: Any, certificate: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_tls, client_tls = certificate
    envs = serve_envs([lambda: gym.make("CartPole-v1")] * 3, token=TOKEN, ssl_context=server_tls)
    policy = serve_policy(CountingPolicy(), token=TOKEN, max_wait=0.0, ssl_context=server_tls)
    async with envs, policy:
        assert envs.url.startswith("wss://") and policy.url.startswith("wss://")
        async with (
            RemoteEnvPool(envs.url, token=TOKEN, stop=2, ssl_context=client_tls) as pool,
            await RemoteEnv.open(envs.url, index=2, token=TOKEN, ssl_context=client_tls) as env,
            RemotePolicy(policy.url, token=TOKEN, ssl_context=client_tls) as remote,
        ):
            obs, _ = await env.reset(seed=0)
            assert (await env.step(1))[0].shape == (4,)
            for e in pool:
                await e.reset(seed=0)
            assert (await pool[1].step(0))[0].shape == (4,)
            td = await remote(TensorDict(observation=torch.from_numpy(obs)[None], batch_size=[1]))
            assert td["action"].shape == (1, 2)
        # a client that does not trust the certificate, or speaks plain ws://, is refused
        with pytest.raises(RemoteConnectionError, match="TLS handshake"):
            await RemoteEnv.open(envs.url, index=2, token=TOKEN)
        with pytest.raises(RemoteConnectionError):
            await RemoteEnv.open(envs.url.replace("wss://", "ws://"), index=2, token=TOKEN)
        with pytest.raises(ValueError, match="not a 'wss://' url"):
            RemotePolicy(policy.url.replace("wss://", "ws://"), token=TOKEN, ssl_context=client_tls)
