"""One request cannot kill a server: a regression test for each way a single client (with or without the
token) ended ``serve_envs`` or ``serve_policy``, or held up its event loop (issue 26).

After each attack the server must still serve a legitimate client, the user's code around ``async with``
must not have been cancelled, and a connection that had to be closed is logged once with its address.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import anyio
import gymnasium as gym
import pytest
import torch
from tensordict.nn import TensorDictModule

from aiocollect import serve_envs, serve_policy
from aiocollect._serve import _env_jobs, _policy_server
from aiocollect._serve._wire import LOOP_HEADER, MAX_DEPTH, MAX_REQUEST_HEADER, decode, encode
from aiocollect._serve._ws import MAX_HANDSHAKE, MAX_HEADERS, connect
from attacks import (
    TOKEN,
    ask_raw,
    deep,
    deep_text,
    env_connection,
    envs_still_served,
    exchange,
    frame,
    policy_still_served,
    status,
    upgrade,
)

pytestmark = [pytest.mark.anyio, pytest.mark.all_loops]  # servers: every loop in the README's run


def cartpoles(n: int = 2) -> list[Any]:
    return [lambda: gym.make("CartPole-v1")] * n


def linear_policy() -> TensorDictModule:
    return TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["action"])


def served(kind: str) -> Any:
    if kind == "envs":
        return serve_envs(cartpoles(), token=TOKEN)
    return serve_policy(linear_policy(), token=TOKEN)


async def still_served(kind: str, server: Any) -> None:
    if kind == "policy":
        await policy_still_served(server)
    else:
        await envs_still_served(server)


def peer_records(caplog: pytest.LogCaptureFixture, peer: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aiocollect.serve" and peer in r.getMessage()]


NON_ASCII = [
    (b"Connection", b"Upgrade, \xff\xfe"),
    (b"Sec-WebSocket-Extensions", b"permessage-deflate; \xe9"),
    (b"Sec-WebSocket-Protocol", b"chat\x80"),
]


@pytest.mark.parametrize("kind", ["envs", "policy"])
@pytest.mark.parametrize("header", NON_ASCII, ids=[h[0].decode() for h in NON_ASCII])
@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
async def test_a_non_ascii_upgrade_header_closes_that_connection_only(
    kind: str, header: tuple[bytes, bytes], token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """wsproto raised UnicodeDecodeError on these headers; the handshake let it end the whole server."""
    name, value = header
    head = upgrade("/policy" if kind == "policy" else "/envs/0", token, [(name, value)])
    if name == b"Connection":  # replace the plain one
        head = head.replace(b"Connection: Upgrade\r\n", b"", 1)
    caplog.set_level(logging.WARNING, "aiocollect.serve")
    user_code_ran = False
    async with served(kind) as server:
        answer, peer = await exchange(server.port, head)
        assert status(answer) == 400, answer
        await still_served(kind, server)
        user_code_ran = True
    assert user_code_ran
    records = peer_records(caplog, peer)
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert "UnicodeDecodeError" in records[0].getMessage()


@pytest.mark.parametrize("kind", ["envs", "policy"])
async def test_an_upgrade_head_over_the_bound_is_refused_unparsed(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "aiocollect.serve")
    async with served(kind) as server:
        over = upgrade("/envs/0", None, [(b"X-Pad", b"a" * (MAX_HANDSHAKE + 4096))])
        answer, first = await exchange(server.port, over)
        assert status(answer) in (400, 431), answer[:200]  # h11's bound or our own, whichever first
        # 4 MB: the server stops reading at the bound (the answer may be lost to the reset of the
        # unread rest); the server lives on
        answer, peer = await exchange(server.port, upgrade("/envs/0", None, [(b"X-Pad", b"a" * 2**22)]))
        assert status(answer) in (400, 431, None), answer[:200]
        many = upgrade("/envs/0", None, [(f"X-H{i}".encode(), b"1") for i in range(MAX_HEADERS + 1)])
        assert len(many) < MAX_HANDSHAKE
        answer, _ = await exchange(server.port, many)
        assert status(answer) == 431, answer
        await still_served(kind, server)
    assert len(peer_records(caplog, first)) == 1
    assert len(peer_records(caplog, peer)) == 1


@pytest.mark.parametrize("kind", ["envs", "policy"])
async def test_garbage_before_the_handshake_is_a_400(kind: str) -> None:
    async with served(kind) as server:
        for garbage in (
            b"\x00\xff" * 100 + b"\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: \xff\r\n\r\n",
            b"\r\n\r\n",
        ):
            answer, _ = await exchange(server.port, garbage)
            assert status(answer) in (400, None), answer
        answer, _ = await exchange(server.port, upgrade(token="not-the-token-at-all"))
        assert status(answer) == 403
        await still_served(kind, server)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/envs/0", lambda value: {"op": "step", "value": value}),
        ("/batch/0/2", lambda value: {"op": "batch", "items": [{"i": 0, "op": "reset", "value": value}]}),
        ("/vector/0/2", lambda value: {"op": "reset", "options": value}),
    ],
    ids=["envs", "batch", "vector"],
)
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 200_000])
async def test_deep_json_from_a_token_holder_is_a_protocol_error(path: str, message: Any, depth: int) -> None:
    """JSON nested ~900 deep raised RecursionError on /envs and /batch, which ended ``serve_envs``."""
    async with serve_envs(cartpoles(), token=TOKEN) as server:
        ws = await env_connection(server.url, path)
        try:
            head = message(None)
            raw = frame(encode(head)[8:].replace(b"null", deep_text(depth), 1))
            with anyio.fail_after(10):
                answer = await ask_raw(ws, raw)
            assert answer["op"] == "error", answer
            assert "nests deeper" in answer["message"] or "not JSON" in answer["message"], answer
        finally:
            await ws.aclose()
        await envs_still_served(server)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 200_000])
async def test_deep_json_sent_to_the_policy_server_is_a_protocol_error(depth: int) -> None:
    async with serve_policy(linear_policy(), token=TOKEN) as server:
        ws = await connect(server.url, "/policy", TOKEN)
        try:
            raw = frame(b'{"op":"act","keys":' + deep_text(depth) + b"}")
            with anyio.fail_after(10):
                answer = await ask_raw(ws, raw)
            assert answer["op"] == "error" and "ProtocolError" in answer["type"], answer
        finally:
            await ws.aclose()
        await policy_still_served(server)


def test_the_depth_bound_admits_what_clients_send() -> None:
    value = deep(MAX_DEPTH - 2)
    assert decode(encode({"op": "x", "value": value}))[0]["value"] == value


@pytest.mark.parametrize("path", ["/envs/0", "/batch/0/2", "/vector/0/2", "/policy"])
async def test_a_4_mb_header_is_refused_at_its_bound(path: str) -> None:
    """A 4 MB header from a token holder held the event loop for ~2 s: it is refused by its size now."""
    policy = path == "/policy"
    async with (
        serve_policy(linear_policy(), token=TOKEN)
        if policy
        else serve_envs(cartpoles(), token=TOKEN) as server
    ):
        ws = await (connect(server.url, path, TOKEN) if policy else env_connection(server.url, path))
        try:
            raw = frame({"op": "act" if policy else "reset", "pad": "a" * (4 * 1024 * 1024)})
            with anyio.fail_after(20):
                answer = await ask_raw(ws, raw)
            assert answer["op"] == "error", answer
            assert f"at most {MAX_REQUEST_HEADER}" in answer["message"], answer["message"]
        finally:
            await ws.aclose()
        await (policy_still_served(server) if policy else envs_still_served(server))


async def test_env_requests_are_decoded_in_the_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    real = _env_jobs.decode

    def decode_spy(message: bytes, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return real(message, **kwargs)

    monkeypatch.setattr(_env_jobs, "decode", decode_spy)
    async with serve_envs(cartpoles(), token=TOKEN) as server:
        await envs_still_served(server)
    assert threads and threading.main_thread() not in threads


async def test_a_big_policy_request_is_decoded_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    real = _policy_server._decode_request

    def decode_spy(message: bytes) -> Any:
        threads.append(threading.current_thread())
        return real(message)

    monkeypatch.setattr(_policy_server, "_decode_request", decode_spy)
    async with serve_policy(linear_policy(), token=TOKEN) as server:
        ws = await connect(server.url, "/policy", TOKEN)
        try:
            answer = await ask_raw(ws, frame({"op": "act", "pad": "a" * (2 * LOOP_HEADER)}))
            assert answer["op"] == "error"
        finally:
            await ws.aclose()
        await policy_still_served(server)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()


@pytest.mark.parametrize("kind", ["envs", "policy"])
async def test_a_handler_error_closes_that_connection_and_is_logged_once(
    kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a connection's handler raises ends that connection only (a bug of ours included)."""
    caplog.set_level(logging.WARNING, "aiocollect.serve")
    server_cls = _policy_server.PolicyServer if kind == "policy" else None
    failing = {"on": True}

    async def broken_answer(self: Any, message: bytes) -> bytes:
        raise RuntimeError("a bug in the handler")

    if server_cls is not None:
        real = server_cls._answer

        async def answer(self: Any, message: bytes) -> bytes:
            return await (broken_answer if failing["on"] else real)(self, message)

        monkeypatch.setattr(server_cls, "_answer", answer)
    else:
        from aiocollect._serve._env_server import EnvServer

        real_greeting = EnvServer._greeting

        def greeting(self: Any, *args: Any) -> Any:
            if failing["on"]:
                raise RuntimeError("a bug in the handler")
            return real_greeting(self, *args)

        monkeypatch.setattr(EnvServer, "_greeting", greeting)
    async with served(kind) as server:
        ws = await connect(server.url, "/policy" if kind == "policy" else "/envs/0", TOKEN)
        try:
            with anyio.fail_after(10), pytest.raises(ConnectionError):
                await ask_raw(ws, frame({"op": "act"}))
        finally:
            await ws.aclose()
        failing["on"] = False
        await still_served(kind, server)
    records = [r for r in caplog.records if r.name == "aiocollect.serve"]
    assert len(records) == 1 and "a bug in the handler" in records[0].getMessage()
    assert "127.0.0.1:" in records[0].getMessage()


async def test_bad_frames_close_that_connection_only() -> None:
    """A text message (closed with 1003), a reserved opcode, an unmasked frame: that connection ends."""
    text_close = b"\x88\x16\x03\xebbinary messages only"
    async with serve_envs(cartpoles(), token=TOKEN) as server:
        for data, ending in (
            (b"\x81\x85\x00\x00\x00\x00hello", text_close),  # a text message (masked)
            (b"\x83\x80\x00\x00\x00\x00", b""),  # a reserved opcode
            (b"\x82\x05hello", b""),  # unmasked from a client
        ):
            with anyio.fail_after(5):  # the server closes it (no heartbeat timeout involved)
                answer, _ = await exchange(server.port, upgrade(), then=data, within=30)
            assert answer.startswith(b"HTTP/1.1 101"), answer[:100]
            assert answer.endswith(ending), answer[-40:]
        await envs_still_served(server)
