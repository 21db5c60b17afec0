"""An authenticated key-value store for the rendezvous of our private process groups.

torch's ``TCPStore`` accepts any client that reaches its port, and a client can list every key
(``list_keys``), read, write and delete them: a local user could set a group's abort key or overwrite a
rank's address and stall its rendezvous. :class:`StoreServer` replaces it: a client must send the
store's random 128-bit token (compared in constant time) before a single request is served, and the
token only travels on the collector's authenticated control channel (or a worker's private pipe).
:class:`StoreClient` is a ``torch.distributed.Store``, so gloo, nccl and RPC rendezvous on it as on a
``TCPStore``.

The protocol is raw bytes, never pickles: a request is an operation byte and a list of byte strings,
a reply a status byte and a list of byte strings. The server is a listening socket and one daemon thread
per connection (a group has a handful), all owned by the server and gone after :meth:`StoreServer.close`.

API: ``StoreServer(host, port=0)`` (``.address``, ``.client(timeout)``, ``.close()``);
``StoreClient(address, timeout)`` (``.close()``); ``StoreAddress`` (host, port, token; picklable).

Example:
    >>> server = StoreServer("127.0.0.1")
    >>> client = server.client(10.0)
    >>> client.set("k", "v"); client.get("k")
    b'v'
    >>> client.close(); server.close()
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import secrets
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ._wire import connect_retrying

__all__ = ["StoreAddress", "StoreClient", "StoreServer"]

_MAGIC = b"AIOSTOR1"
_HELLO = struct.Struct("!8s16s")
_HEAD = struct.Struct("!BI")  # operation (request) or status (reply), number of items
_LEN = struct.Struct("!I")
_HELLO_TIMEOUT = 3.0  # seconds a connection may take to authenticate (a client sends its hello at once)
_MAX_ITEM = 1 << 30

# operations
_SET, _GET, _ADD, _CHECK, _WAIT, _DELETE, _NUM_KEYS, _COMPARE_SET = range(1, 9)
# reply statuses
_OK, _TIMEOUT, _ERROR = range(3)


@dataclass(frozen=True)
class StoreAddress:
    """Where a :class:`StoreServer` listens, and its token (travels on an authenticated channel only)."""

    host: str
    port: int
    token: bytes

    def __repr__(self) -> str:  # the token stays out of logs and tracebacks
        return f"StoreAddress(host={self.host!r}, port={self.port})"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the store connection closed")
        data += chunk
    return bytes(data)


def _send_frame(sock: socket.socket, code: int, items: list[bytes]) -> None:
    parts = [_HEAD.pack(code, len(items))]
    for item in items:
        parts += [_LEN.pack(len(item)), item]
    sock.sendall(b"".join(parts))


def _recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    code, count = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    items = []
    for _ in range(count):
        (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
        if size > _MAX_ITEM:
            raise ValueError(f"store item of {size} bytes")
        items.append(_recv_exact(sock, size))
    return code, items


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class StoreServer:
    """The master side: listens on ``host`` only (``port`` 0: a free one), serves authenticated clients."""

    def __init__(self, host: str, port: int = 0) -> None:
        self._token = secrets.token_bytes(16)
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.address = StoreAddress(host, int(listener.getsockname()[1]), self._token)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept_loop, name="aiocollect-store", daemon=True)
        self._accepter.start()

    def client(self, timeout: float) -> StoreClient:
        """An authenticated client of this store."""
        return StoreClient(self.address, timeout)

    # -- serving ----------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name="aiocollect-store-conn", daemon=True
                )
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_HELLO_TIMEOUT)
            magic, token = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            if magic != _MAGIC or not hmac.compare_digest(token, self._token):
                return  # not ours: closed before any request is read
            conn.settimeout(None)
            conn.sendall(b"\x01")
            while True:
                op, items = _recv_frame(conn)
                status, reply = self._handle(op, items)
                _send_frame(conn, status, reply)
        except (OSError, EOFError, ValueError, struct.error):
            return
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    def _wait_for(self, keys: list[str], timeout: float) -> bool:
        """With the lock held: wait until every key is set (or the store closes)."""
        return self._cond.wait_for(lambda: self._closed or all(k in self._data for k in keys), timeout) and (
            not self._closed
        )

    def _handle(self, op: int, items: list[bytes]) -> tuple[int, list[bytes]]:
        data = self._data
        with self._cond:
            if op == _SET:
                data[items[0].decode()] = items[1]
                self._cond.notify_all()
                return _OK, []
            if op == _GET:
                key = items[0].decode()
                if not self._wait_for([key], float(items[1])):
                    return _TIMEOUT, [f"key {key!r} was not set within {float(items[1]):g} s".encode()]
                return _OK, [data[key]]
            if op == _ADD:
                key = items[0].decode()
                value = int(data.get(key, b"0")) + int(items[1])
                data[key] = str(value).encode()
                self._cond.notify_all()
                return _OK, [data[key]]
            if op == _CHECK:
                return _OK, [b"1" if all(k.decode() in data for k in items) else b"0"]
            if op == _WAIT:
                keys = [k.decode() for k in items[1:]]
                if not self._wait_for(keys, float(items[0])):
                    return _TIMEOUT, [f"keys {keys} were not all set within {float(items[0]):g} s".encode()]
                return _OK, []
            if op == _DELETE:
                return _OK, [b"1" if data.pop(items[0].decode(), None) is not None else b"0"]
            if op == _NUM_KEYS:
                return _OK, [str(len(data)).encode()]
            if op == _COMPARE_SET:
                key, expected, desired = items[0].decode(), items[1], items[2]
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = desired
                    self._cond.notify_all()
                    return _OK, [desired]
                return _OK, [expected if current is None else current]
        return _ERROR, [f"unknown store operation {op}".encode()]

    def close(self) -> None:
        """Stop listening, end every connection and join their threads (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv()
        self._accepter.join(5.0)
        for thread in self._threads:
            thread.join(5.0)


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` served by a :class:`StoreServer` (one request at a time)."""

    def __init__(self, address: StoreAddress, timeout: float) -> None:
        super().__init__()
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        sock = connect_retrying(address.host, address.port, self._timeout, retry_every=0.1)
        try:
            sock.sendall(_HELLO.pack(_MAGIC, address.token))
            if sock.recv(1) != b"\x01":
                raise PermissionError(f"the store at {address.host}:{address.port} refused this client")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self._sock: socket.socket | None = sock

    def _call(self, op: int, items: list[bytes]) -> list[bytes]:
        with self._lock:
            sock = self._sock
            if sock is None:
                raise RuntimeError("the store client is closed")
            _send_frame(sock, op, items)
            status, reply = _recv_frame(sock)
        if status == _TIMEOUT:
            raise dist.DistStoreError(reply[0].decode())  # what a TCPStore raises (a RuntimeError)
        if status != _OK:
            raise RuntimeError(reply[0].decode())
        return reply

    # -- torch.distributed.Store ------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._call(_SET, [key.encode(), _bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call(_GET, [key.encode(), str(self._timeout).encode()])[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(_ADD, [key.encode(), str(int(amount)).encode()])[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(_CHECK, [k.encode() for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        seconds = self._timeout if timeout is None else _seconds(timeout)
        self._call(_WAIT, [str(seconds).encode()] + [k.encode() for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._call(_DELETE, [key.encode()])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(_NUM_KEYS, [])[0])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call(_COMPARE_SET, [key.encode(), _bytes(expected), _bytes(desired)])[0]

    def set_timeout(self, timeout: Any) -> None:
        self._timeout = _seconds(timeout)

    def close(self) -> None:
        """Close the connection (idempotent); the store object may outlive it in a process group. A
        thread blocked in a request (an abandoned ``wait``) gets an error at once."""
        sock = self._sock
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv (it holds the lock)
        with self._lock:
            self._sock = None
        sock.close()
