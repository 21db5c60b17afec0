"""The fuzz tier: hypothesis-made handshakes, headers, frames and wire messages against every server
(``serve_envs`` with single envs and with a vector env, ``serve_policy``, the dashboard), unauthenticated
and authenticated, each followed by a legitimate client that must still be served.

Each server runs for the whole test in a thread of its own (a blocking portal, asyncio), on loopback; an
attack is one connection that sends its bytes, shuts its sending side and reads until the server closes
(so that no example waits on a timeout). The default suite runs a few examples per strategy (seconds);
``pytest -m slow`` runs many more (and under trio too).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.from_thread
import gymnasium as gym
import httpx
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tensordict.nn import TensorDictModule

from aiocollect import RemoteConnectionError, serve_envs, serve_policy
from aiocollect._serve._wire import DTYPES, MAGIC
from aiocollect._serve._ws import connect
from attacks import TOKEN, envs_still_served, frame, policy_still_served, status, upgrade, vector_still_served

SHORT, LONG = 30, 400
RUNS = [
    pytest.param(SHORT, "asyncio", id="short"),
    pytest.param(LONG, "trio", id="long", marks=pytest.mark.slow),
]


def run_examples(
    examples: int, test: Callable[..., None], *strategies: Any, pinned: Sequence[tuple[Any, ...]] = ()
) -> None:
    """Run ``test`` on ``examples`` random hypothesis examples of ``strategies`` (no database, no
    deadline), after the ``pinned`` ones (the requests that once ended a server)."""
    configured = settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    test = given(*strategies)(test)
    for args in pinned:
        test = example(*args)(test)
    configured(test)()


def attack(port: int, data: bytes, then: bytes = b"") -> bytes:
    """Send ``data`` on a fresh connection (then, once the answer's head has come, ``then``), shut the
    sending side and read until the server closes."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(data)
            while then and b"\r\n\r\n" not in answer:
                answer += sock.recv(65536) or b"\r\n\r\n"
            sock.sendall(then)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:  # reset: the server closed with some of it unread
            pass
    return answer


@contextmanager
def running(server_cm: Any, backend: str) -> Iterator[tuple[anyio.from_thread.BlockingPortal, Any]]:
    with (
        anyio.from_thread.start_blocking_portal(backend) as portal,
        portal.wrap_async_context_manager(server_cm) as server,
    ):
        yield portal, server


def env_server(kind: str) -> Any:
    if kind == "vector":
        same_step = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
        return serve_envs(
            vector_env_fn=lambda: gym.make_vec("CartPole-v1", 2, "sync", vector_kwargs=same_step), token=TOKEN
        )
    return serve_envs([lambda: gym.make("CartPole-v1")] * 2, token=TOKEN)


def policy_server() -> Any:
    return serve_policy(TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["action"]), token=TOKEN)


SERVERS = {
    "envs": (lambda: env_server("envs"), envs_still_served, ["/envs/0", "/batch/0/2", "/vector/0/2"]),
    "vector": (lambda: env_server("vector"), vector_still_served, ["/vector/0/2", "/envs/0"]),
    "policy": (policy_server, policy_still_served, ["/policy"]),
}

# -- strategies ---------------------------------------------------------------------------------------------
known_names = st.sampled_from(
    [b"Connection", b"Upgrade", b"Sec-WebSocket-Extensions", b"Sec-WebSocket-Protocol", b"Host"]
    + [b"Sec-WebSocket-Key", b"Sec-WebSocket-Version", b"Authorization", b"Content-Length"]
)
any_name = st.binary(min_size=1, max_size=20).filter(lambda b: not {58, 13, 10} & set(b))
header_name = st.one_of(known_names, known_names, any_name)  # mostly the headers wsproto reads
header_value = st.one_of(
    st.binary(max_size=60), st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass"))
).filter(lambda b: b"\r" not in b and b"\n" not in b)
headers = st.lists(st.tuples(header_name, header_value), max_size=8)


def heads(paths: list[str]) -> st.SearchStrategy[bytes]:
    """Upgrade requests (with and without the token) with fuzzed extra headers, and raw garbage."""
    path = st.one_of(st.sampled_from([*paths, "/", "/envs/99", "/batch/1/0"]), st.text(max_size=30))
    token = st.sampled_from([TOKEN, None, "wrong-token-0123456789"])
    made = st.builds(lambda p, t, h: upgrade("/" + p.lstrip("/"), t, h), path, token, headers)
    return st.one_of(made, st.binary(max_size=300), made.map(lambda b: b[: len(b) // 2]))


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)
array_entry = st.one_of(
    st.tuples(st.sampled_from(sorted(DTYPES) + ["|O", "<c8", "x"]), st.lists(st.integers(-2, 5), max_size=3)),
    json_value,
)


def messages(ops: list[str]) -> st.SearchStrategy[bytes]:
    """Wire messages from a token holder: a fuzzed JSON header (an op of the server's, its keys), arrays
    listed or not, payload bytes; and raw binary."""
    header = st.fixed_dictionaries(
        {"op": st.sampled_from([*ops, "nope"])},
        optional={
            "value": json_value,
            "options": json_value,
            "seed": json_value,
            "items": st.lists(st.dictionaries(st.sampled_from(["i", "op", "value"]), json_value), max_size=3),
            "steps": json_value,
            "keys": json_value,
            "arrays": st.lists(array_entry.map(lambda e: list(e) if isinstance(e, tuple) else e), max_size=3),
        },
    )
    well_formed = st.builds(frame, header, st.binary(max_size=64))
    return st.one_of(
        well_formed,
        st.binary(max_size=200),
        st.binary(max_size=200).map(lambda b: MAGIC + b),
        st.builds(lambda h, n: frame(json.dumps(h).encode()[:n]), header, st.integers(0, 30)),
    )


OPS = {"envs": ["reset", "step", "batch"], "vector": ["reset", "step"], "policy": ["act", "weights"]}


# -- the tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("examples", "backend"), RUNS)
@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_fuzzed_handshakes_never_end_a_server(kind: str, examples: int, backend: str) -> None:
    make, still_served, paths = SERVERS[kind]
    with running(make(), backend) as (portal, server):

        def one(head: bytes) -> None:
            answer = attack(server.port, head)
            assert status(answer) in (None, 101, 400, 403, 404, 409, 431), answer[:120]
            portal.call(still_served, server)

        crashed = [  # (wsproto raised UnicodeDecodeError on them: issue 26)
            upgrade(paths[0], token, [(name, b"\xff\xfe")])
            for name in (b"Connection", b"Sec-WebSocket-Extensions", b"Sec-WebSocket-Protocol")
            for token in (None, TOKEN)
        ]
        run_examples(examples, one, heads(paths), pinned=[(head,) for head in crashed])


@pytest.mark.parametrize(("examples", "backend"), RUNS)
@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_fuzzed_frames_after_the_handshake_never_end_a_server(kind: str, examples: int, backend: str) -> None:
    """Raw bytes where WebSocket frames should be (masked or not, any opcode, any length)."""
    make, still_served, paths = SERVERS[kind]
    with running(make(), backend) as (portal, server):

        def one(path: str, data: bytes) -> None:
            answer = attack(server.port, upgrade(path), then=data)
            assert status(answer) in (101, 409), answer[:120]
            portal.call(still_served, server)

        run_examples(examples, one, st.sampled_from(paths), st.binary(max_size=300))


@pytest.mark.parametrize(("examples", "backend"), RUNS)
@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_fuzzed_messages_from_a_token_holder_never_end_a_server(
    kind: str, examples: int, backend: str
) -> None:
    make, still_served, paths = SERVERS[kind]
    with running(make(), backend) as (portal, server):

        async def send(path: str, message: bytes) -> None:
            with anyio.fail_after(20):
                ws = await connect(server.url, path, TOKEN)
                try:
                    await ws.receive()  # the greeting (policy: none, the answer to the message)
                    await ws.send(message)
                    await ws.receive()  # an answer (often an error), or the connection closed
                except RemoteConnectionError:
                    pass
                finally:
                    await ws.aclose()

        def one(path: str, message: bytes) -> None:
            if path == "/policy":
                portal.call(send_policy, server.url, message)
            else:
                portal.call(send, path, message)
            portal.call(still_served, server)

        deep = frame(b'{"op":"' + OPS[kind][0].encode() + b'","value":' + b"[" * 900 + b"]" * 900 + b"}")
        pinned = [(path, deep) for path in paths]  # (RecursionError: issue 26)
        run_examples(examples, one, st.sampled_from(paths), messages(OPS[kind]), pinned=pinned)


async def send_policy(url: str, message: bytes) -> None:
    with anyio.fail_after(20):
        ws = await connect(url, "/policy", TOKEN)
        try:
            await ws.send(message)
            await ws.receive()
        except RemoteConnectionError:
            pass
        finally:
            await ws.aclose()


# -- the dashboard -----------------------------------------------------------------------------------------
method = st.sampled_from([b"GET", b"POST", b"HEAD", b"OPTIONS", b"PUT", b"\xff", b"GET\x00"])
target = st.one_of(
    st.sampled_from([b"/", b"/statistics", b"/events?kinds=\xff", b"/pause", b"/history.csv", b"*"]),
    st.binary(max_size=40).filter(lambda b: b" " not in b and b"\r" not in b and b"\n" not in b),
)
requests = st.one_of(
    st.builds(
        lambda m, t, h: (
            m
            + b" "
            + t
            + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + b"".join(n + b": " + v + b"\r\n" for n, v in h)
            + b"\r\n"
        ),
        method,
        target,
        headers,
    ),
    st.binary(max_size=300),
)


@pytest.mark.parametrize("examples", [SHORT, pytest.param(LONG, marks=pytest.mark.slow)])
def test_fuzzed_requests_never_end_the_dashboard(examples: int) -> None:
    from aiocollect import Collector
    from aiocollect.dashboard import create_app, serve
    from support import cartpole2

    with anyio.from_thread.start_blocking_portal("asyncio") as portal:  # uvicorn: asyncio only
        collector = portal.wrap_async_context_manager(Collector(cartpole2, frames_per_batch=16))
        with (
            collector as entered,
            portal.wrap_async_context_manager(serve(create_app(entered), port=0)) as server,
            httpx.Client(timeout=10) as client,
        ):

            def one(request: bytes) -> None:
                answer = attack(server.port, request)
                if answer:
                    assert answer.startswith(b"HTTP/1.1 "), answer[:120]
                    assert status(answer) != 500, answer[:400]
                assert client.get(server.url + "statistics").status_code == 200

            run_examples(examples, one, requests)
