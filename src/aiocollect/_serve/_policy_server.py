"""``serve_policy``: one torch policy answering many clients, their concurrent requests batched.

Requests (``act``: a batch of observations) from all connections meet in one queue. A batcher task waits
for the first, gathers more until ``max_batch`` rows or ``max_wait`` seconds, and runs the policy once on
their concatenation in a worker thread, then answers each client with its rows. Weight updates
(``weights``) run in the same thread between forward passes and bump ``version``.
"""

from __future__ import annotations

import contextlib
import ssl
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from .._policies._weights import check_compatible, copy_weights, flat_weights
from ._common import Server, check_host_port, check_server_tls, check_token, error_message
from ._tensors import leaves_to_wire, td_leaves, wire_keys, wire_to_tensors
from ._wire import ProtocolError, decode, encode, small_header
from ._ws import SERVER_HEARTBEAT, Heartbeat, accept, heartbeat

__all__ = ["PolicyServer", "serve_policy"]


class _Request:
    __slots__ = ("done", "keys", "reply", "rows", "tensors")

    def __init__(self, tensors: dict[Any, torch.Tensor], rows: int) -> None:
        self.tensors, self.rows = tensors, rows
        self.keys = tuple(tensors)
        self.done = anyio.Event()
        self.reply = b""


class PolicyServer(Server):
    """A running policy server (see :func:`serve_policy`): ``url``, ``token``, ``port``; ``version``
    (weight updates so far), ``forward_calls`` and ``batch_sizes`` (rows per forward pass)."""

    def __init__(
        self,
        policy: Any,
        host: str,
        port: int,
        token: str | None,
        max_batch: int,
        max_wait: float,
        beat: Heartbeat | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not callable(policy):
            raise TypeError(
                f"policy must be a TensorDictModule, an nn.Module or a callable td -> td, got {policy!r}"
            )
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1 (rows per forward pass), got {max_batch!r}")
        if not isinstance(max_wait, int | float) or max_wait < 0:
            raise ValueError(f"max_wait must be seconds >= 0 to wait for a fuller batch, got {max_wait!r}")
        check_host_port(host, port)
        self.policy = policy
        self.host, self.port, self.token = host, port, check_token(token)
        self.heartbeat = beat
        self.ssl_context = check_server_tls(ssl_context)
        self.max_batch, self.max_wait = max_batch, float(max_wait)
        self.version = 0
        self.forward_calls = 0
        self.batch_sizes: list[int] = []
        self._weights = flat_weights(policy) if isinstance(policy, torch.nn.Module) else None
        self._queue: list[_Request] = []
        self._arrived = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> PolicyServer:
        async with contextlib.AsyncExitStack() as stack:
            await self._listen(stack, self._handle, self._batcher)
            self._stack = stack.pop_all()
        return self

    # -- connections ------------------------------------------------------------------------------------
    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        accepted = await accept(stream, self.token, _route, beat=self.heartbeat, ssl_context=self.ssl_context)
        if accepted is None:
            return
        ws = accepted[0]
        try:
            await self._answer_in_order(ws, self._answer)
        finally:
            await ws.abort()

    async def _answer(self, message: bytes) -> bytes:
        try:
            if small_header(message):
                header, arrays = decode(message, request=True)
            else:  # a big header is parsed off the event loop
                header, arrays = await anyio.to_thread.run_sync(_decode_request, message)
            if header["op"] == "weights":
                weights = TensorDict(
                    dict(zip(wire_keys(header, len(arrays)), map(torch.from_numpy, arrays), strict=True))
                )
                version = await anyio.to_thread.run_sync(self._load, weights, limiter=self._limiter)
                return encode({"op": "weights", "version": version})
            if header["op"] != "act":
                raise ProtocolError(f"unknown op {header['op']!r} (act, weights)")
            tensors = wire_to_tensors(header, arrays)
            rows = {t.shape[0] if t.ndim else -1 for t in tensors.values()}
            if len(rows) != 1 or -1 in rows:
                raise ValueError(
                    f"every observation entry needs the same leading batch size, got {sorted(rows)}"
                )
        except Exception as exc:
            return error_message(exc)
        request = _Request(tensors, rows.pop())
        self._queue.append(request)
        self._arrived.set()
        await request.done.wait()
        return request.reply

    def _load(self, weights: TensorDictBase) -> int:
        if self._weights is None:
            raise TypeError(
                f"the served policy {type(self.policy).__name__} is not an nn.Module: it has no weights"
            )
        weights = weights.flatten_keys(".")
        check_compatible(self._weights, weights)
        copy_weights(self._weights, weights)
        self.version += 1
        return self.version

    # -- batching ---------------------------------------------------------------------------------------
    async def _batcher(self) -> None:
        while True:
            while not self._queue:
                await self._arrived.wait()
                self._arrived = anyio.Event()
            with anyio.move_on_after(self.max_wait):
                while sum(r.rows for r in self._queue) < self.max_batch:
                    await self._arrived.wait()
                    self._arrived = anyio.Event()
            batch: list[_Request] = []
            rows = 0
            while self._queue and (not batch or rows + self._queue[0].rows <= self.max_batch):
                rows += self._queue[0].rows
                batch.append(self._queue.pop(0))
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._forward_all, batch, limiter=self._limiter)
            for request in batch:
                request.done.set()

    def _forward_all(self, batch: list[_Request]) -> None:
        groups: dict[tuple[Any, ...], list[_Request]] = {}
        for request in batch:
            groups.setdefault(request.keys, []).append(request)
        for requests in groups.values():
            try:
                outputs = self._forward(requests)
            except Exception as exc:
                for request in requests:
                    request.reply = error_message(exc)
                continue
            start = 0
            for request in requests:
                keys, arrays = leaves_to_wire(
                    (k, v[start : start + request.rows]) for k, v in outputs.items()
                )
                request.reply = encode({"op": "act", "keys": keys, "version": self.version}, arrays)
                start += request.rows

    def _forward(self, requests: list[_Request]) -> dict[Any, torch.Tensor]:
        rows = sum(r.rows for r in requests)
        inputs = {k: torch.cat([r.tensors[k] for r in requests]) for k in requests[0].keys}
        td = TensorDict(inputs, batch_size=[rows])
        self.forward_calls += 1
        self.batch_sizes.append(rows)
        with torch.no_grad():
            if isinstance(self.policy, torch.nn.Module) and not isinstance(self.policy, TensorDictModuleBase):
                return {"action": self.policy(td["observation"])}
            out = self.policy(td)
        out = td if out is None else out
        if not isinstance(out, TensorDictBase):
            raise TypeError(
                f"policy returned {type(out).__name__}; a callable policy must return a TensorDict"
            )
        return {
            k: v
            for k, v in td_leaves(out)
            if k not in inputs and not any(p.startswith("_") for p in ((k,) if isinstance(k, str) else k))
        }


def _decode_request(message: bytes) -> tuple[dict[str, Any], list[Any]]:
    return decode(message, request=True)


async def _route(path: str) -> int | None:
    return None if path.endswith("/policy") else 404


def serve_policy(
    policy: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_batch: int = 1024,
    max_wait: float = 0.002,
    heartbeat_interval: float | None = SERVER_HEARTBEAT[0],
    heartbeat_timeout: float | None = SERVER_HEARTBEAT[1],
    ssl_context: ssl.SSLContext | None = None,
) -> PolicyServer:
    """A WebSocket server running ``policy`` for many :class:`aiocollect.RemotePolicy` clients, batching
    their concurrent requests into one forward pass (in a worker thread, under ``torch.no_grad()``).

    ``policy``: a ``TensorDictModule`` or a callable ``td -> td`` (its new entries are the answer), or a
    plain ``nn.Module`` called on ``td["observation"]`` (its output is ``"action"``). A forward pass runs
    once ``max_batch`` rows wait or ``max_wait`` seconds after the first request, whichever first.
    ``RemotePolicy.update_weights`` replaces the weights of an ``nn.Module`` policy between passes.
    An async context manager; ``token=None`` makes a random token (``server.token``). A client
    connection silent for ``heartbeat_timeout`` seconds (pinged after ``heartbeat_interval`` quiet ones)
    is dropped (either ``None``: never). With ``ssl_context`` it speaks TLS (``wss://``).

    Example:
        >>> import anyio, torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from aiocollect import RemotePolicy, serve_policy
        >>> policy = TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["action"])
        >>> async def main():
        ...     async with serve_policy(policy) as server:
        ...         async with RemotePolicy(server.url, token=server.token) as remote:
        ...             td = await remote(TensorDict(observation=torch.zeros(3, 4), batch_size=[3]))
        ...             return td["action"].shape
        >>> anyio.run(main)
        torch.Size([3, 2])
    """
    beat = heartbeat(heartbeat_interval, heartbeat_timeout)
    return PolicyServer(policy, host, port, token, max_batch, max_wait, beat, ssl_context)
