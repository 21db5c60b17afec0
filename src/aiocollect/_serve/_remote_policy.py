"""``RemotePolicy``: an async policy (``await policy(td)``) answered by a :func:`serve_policy` server."""

from __future__ import annotations

import ssl
from typing import Any

import torch
from tensordict import TensorDictBase

from .._policies._weights import as_weights
from ._common import remote_error
from ._tensors import leaves_to_wire, td_leaves, wire_to_tensors
from ._wire import ProtocolError, decode, encode
from ._ws import CLIENT_HEARTBEAT, UnreadError, WebSocket, ask, check_client_tls, connect, heartbeat

__all__ = ["RemotePolicy"]


class RemotePolicy:
    """A policy served by :func:`aiocollect.serve_policy`: ``td = await policy(td)`` sends ``td``'s
    entries (a batch of observations) and writes the server's answer (``"action"``, ...) into ``td``.

    Usable as the policy of :class:`aiocollect.AsyncEnvCollector` (central inference across machines).
    Concurrent calls each use a connection of their own (kept for reuse), so the server can batch them
    with other clients' calls. ``await policy.update_weights(module_or_weights)`` loads new weights into
    the served policy and returns the server's new weight version. Close it with ``async with`` or
    :meth:`aclose`. A lost server raises :class:`aiocollect.RemoteConnectionError`; a wrong token
    ``PermissionError``.

    Args:
        url: the server's ``ws://host:port`` (``server.url``).
        token: the server's shared secret (``server.token``).
        connect_timeout: seconds to connect and complete the WebSocket handshake.
        heartbeat_interval, heartbeat_timeout: while a call waits, the server is pinged after
            ``heartbeat_interval`` quiet seconds; one silent for ``heartbeat_timeout`` seconds fails the
            call with :class:`aiocollect.RemoteConnectionError` (a long forward pass is not silence: the
            server answers pings meanwhile). ``None``: no heartbeat. An idle connection the server
            dropped is replaced at the next call.
        ssl_context: for a ``wss://`` url, the ``ssl.SSLContext`` that checks the server's certificate.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str,
        connect_timeout: float = 10.0,
        heartbeat_interval: float | None = CLIENT_HEARTBEAT[0],
        heartbeat_timeout: float | None = CLIENT_HEARTBEAT[1],
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        check_client_tls(url, ssl_context)  # a malformed url fails here, not at the first call
        if not isinstance(token, str) or not token:
            raise ValueError("token must be the server's token (server.token), a non-empty string")
        self.url, self.connect_timeout = url, connect_timeout
        self.heartbeat = heartbeat(heartbeat_interval, heartbeat_timeout)
        self.ssl_context = ssl_context
        self._token = token
        self._idle: list[WebSocket] = []
        self._open: set[WebSocket] = set()
        self._closed = False
        #: the server's weight version seen in the last answer
        self.version: int | None = None

    async def _request(self, message: bytes) -> tuple[dict[str, Any], list[Any]]:
        if self._closed:
            raise RuntimeError(f"RemotePolicy({self.url!r}) is closed")
        while self._idle:
            ws = self._idle.pop()
            try:
                return await self._exchange(ws, message)
            except UnreadError:  # this idle connection was gone before the server read the request
                pass
        ws = await connect(
            self.url,
            "/policy",
            self._token,
            connect_timeout=self.connect_timeout,
            beat=self.heartbeat,
            ssl_context=self.ssl_context,
        )
        self._open.add(ws)
        return await self._exchange(ws, message)

    async def _exchange(self, ws: WebSocket, message: bytes) -> tuple[dict[str, Any], list[Any]]:
        ok = False
        try:
            header, arrays = decode(await ask(ws, message))
            ok = True
        finally:
            if ok and not self._closed:
                self._idle.append(ws)
            else:  # cancelled or failed mid-call: its answer would arrive out of turn
                self._open.discard(ws)
                await ws.abort()
        if header["op"] == "error":
            raise remote_error(header, f"policy server {self.url}")
        return header, arrays

    async def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Fill ``td`` (batch ``[n]``) with the policy's outputs for its entries; returns ``td``."""
        keys, arrays = leaves_to_wire(td_leaves(td))
        header, arrays = await self._request(encode({"op": "act", "keys": keys}, arrays))
        if header["op"] != "act":
            raise ProtocolError(f"expected an 'act' answer, got {header['op']!r}")
        self.version = header.get("version")
        for key, tensor in wire_to_tensors(header, arrays).items():
            td.set(key, tensor.to(td.device) if td.device is not None else tensor)
        return td

    async def update_weights(self, weights: Any) -> int:
        """Load ``weights`` (an ``nn.Module``, a TensorDict of weights or a state dict) into the served
        policy; returns the server's new weight version. The server checks names and shapes first."""
        flat = as_weights(weights).flatten_keys(".")
        items = [(k, v.data if isinstance(v, torch.nn.Parameter) else v) for k, v in td_leaves(flat)]
        keys, arrays = leaves_to_wire(items)
        header, _ = await self._request(encode({"op": "weights", "keys": keys}, arrays))
        if header["op"] != "weights":
            raise ProtocolError(f"expected a 'weights' answer, got {header['op']!r}")
        self.version = int(header["version"])
        return self.version

    async def aclose(self) -> None:
        """Close its connections; idempotent."""
        self._closed = True
        opened, self._open, self._idle = list(self._open), set(), []
        for ws in opened:
            await ws.aclose()

    async def __aenter__(self) -> RemotePolicy:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"RemotePolicy({self.url!r})"
