"""What an attacker on the same machine sends to the serve servers (loopback only), and the legitimate
client that must still be served afterwards: shared by ``test_serve_security.py`` and
``test_serve_fuzz.py``."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import torch
from tensordict import TensorDict

from aiocollect import RemoteEnv, RemotePolicy, RemoteVectorEnv
from aiocollect._serve._wire import MAGIC, decode
from aiocollect._serve._ws import WebSocket, connect

TOKEN = "serve-attack-token-0123456789"
KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def upgrade(
    path: str = "/envs/0", token: str | None = TOKEN, headers: Sequence[tuple[bytes, bytes]] = ()
) -> bytes:
    """A WebSocket upgrade request head for ``path`` (with ``token`` when given) plus ``headers``."""
    lines = [
        f"GET {path} HTTP/1.1".encode(),
        b"Host: 127.0.0.1",
        b"Upgrade: websocket",
        b"Connection: Upgrade",
        f"Sec-WebSocket-Key: {KEY}".encode(),
        b"Sec-WebSocket-Version: 13",
    ]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}".encode())
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def exchange(port: int, data: bytes, then: bytes = b"", within: float = 10.0) -> tuple[bytes, str]:
    """Send ``data`` to ``127.0.0.1:port`` (and, once the answer's head has come, ``then``: frames after
    the handshake, which wsproto would drop if they came with it), end the sending side and read until
    the server closes (or ``within`` s): the answer and this client's own address (``host:port``, what
    the server logs as its peer)."""
    answer = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        host, own = stream.extra(anyio.abc.SocketAttribute.local_address)[:2]
        with anyio.move_on_after(within):
            try:
                await stream.send(data)
                if then:
                    while b"\r\n\r\n" not in answer:
                        answer += await stream.receive()
                    await stream.send(then)
                try:
                    await stream.send_eof()
                except (
                    RuntimeError
                ):  # uvloop under anyio < 4.12: the server closed first ("handler is closed")
                    pass
                while True:
                    answer += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                pass
    return answer, f"{host}:{own}"


def status(answer: bytes) -> int | None:
    """The HTTP status of ``answer`` (``None``: no HTTP answer, the connection was just closed)."""
    if not answer.startswith(b"HTTP/1.1 "):
        return None
    return int(answer[9:12])


def frame(header: dict[str, Any] | bytes, payload: bytes = b"") -> bytes:
    """A wire message whose header is ``header`` (JSON-encoded unless bytes, taken as it is) with the
    right length prefix, followed by ``payload``."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + payload


def deep(depth: int) -> Any:
    """A JSON value nested ``depth`` lists deep (made without recursion)."""
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def deep_text(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


async def ask_raw(ws: WebSocket, message: bytes) -> dict[str, Any]:
    await ws.send(message)
    return decode(await ws.receive())[0]


async def env_connection(url: str, path: str = "/envs/0", token: str = TOKEN) -> WebSocket:
    """An authenticated connection to an env server, its greeting read."""
    ws = await connect(url, path, token)
    assert decode(await ws.receive())[0]["op"] in ("spaces", "error")
    return ws


async def envs_still_served(server: Any, token: str = TOKEN) -> None:
    """A legitimate ``RemoteEnv`` still resets and steps env 0 of ``server``."""
    with anyio.fail_after(20):
        async with await RemoteEnv.open(server.url, index=0, token=token) as env:
            obs, _ = await env.reset(seed=0)
            assert np.asarray(obs).shape == (4,)
            await env.step(0)


async def policy_still_served(server: Any, token: str = TOKEN) -> None:
    """A legitimate ``RemotePolicy`` still gets actions from ``server``."""
    with anyio.fail_after(20):
        async with RemotePolicy(server.url, token=token) as remote:
            td = await remote(TensorDict(observation=torch.zeros(2, 4), batch_size=[2]))
            assert td["action"].shape == (2, 2)


async def vector_still_served(server: Any, token: str = TOKEN) -> None:
    """A legitimate ``RemoteVectorEnv`` still resets and steps all the envs of ``server``."""
    with anyio.fail_after(20):
        async with await RemoteVectorEnv.open(server.url, token=token) as env:
            obs, _ = await env.reset(seed=0)
            assert np.asarray(obs).shape == (server.num_envs, 4)
            await env.step(np.zeros(server.num_envs, dtype=np.int64))
