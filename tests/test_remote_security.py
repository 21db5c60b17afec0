"""The remote collectors' exposure, without starting nodes: argument checks, private submitit folders,
stores that listen on the address they are given (not on every interface) and serve only clients with
their token."""

from __future__ import annotations

import datetime
import os
import socket
import stat
import struct
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from aiocollect import DistributedCollector, GymEnv
from aiocollect._remote._launchers import private_files, private_folder
from aiocollect._transport._groups import new_group
from aiocollect._transport._store import StoreAddress, StoreClient, StoreServer
from support import blocked_in, fd_count, poll_until


def pendulum():
    return GymEnv("Pendulum-v1")


@pytest.mark.parametrize("bad", ["", 127001, b"127.0.0.1"])
def test_trainer_address_is_checked_before_anything_starts(bad):
    with pytest.raises(TypeError, match="trainer_address must be the host name or IP address"):
        DistributedCollector(pendulum, frames_per_batch=8, num_collectors=1, trainer_address=bad)


def _listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def _store_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiocollect-store")]


def test_store_listens_on_its_host_only_and_leaves_nothing():
    fds, before = fd_count(), _listening()
    server = StoreServer("127.0.0.1")
    client = server.client(10.0)
    assert _listening() - before == {("127.0.0.1", server.address.port)}
    client.set("k", "v")
    assert client.get("k") == b"v"
    client.close()
    server.close()
    server.close()  # idempotent
    assert _store_threads() == []
    assert _listening() == before
    assert fd_count() == fds


def _rogue_attempts(port: int) -> list[str]:
    """What a local client without the token tries; the list of what it achieved (nothing, we hope)."""
    achieved = []
    try:  # torch's own client, as one would attack a TCPStore
        rogue = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1))
    except Exception:
        pass
    else:  # pragma: no cover - the failure this test is for
        rogue.set("abort", "1")
        achieved.append("a TCPStore client connected and set 'abort'")
    for token in (b"", bytes(16), os.urandom(16)):  # our protocol, with a wrong (or no) token
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"AIOSTOR1" + token)
            if token:
                # a request as an authenticated client would send it: SET "abort" = "1"
                sock.sendall(b"\x01\x00\x00\x00\x02" + b"\x00\x00\x00\x05abort" + b"\x00\x00\x00\x011")
            try:
                sock.shutdown(socket.SHUT_WR)
                reply = sock.recv(64)
            except OSError:  # the store closed it already
                reply = b""
            if reply:  # pragma: no cover - the failure this test is for
                achieved.append(f"token {token!r} got a reply: {reply!r}")
    return achieved


def test_store_serves_no_client_without_its_token():
    """torch's TCPStore lets any local client list, set and delete keys (the abort key of a rendezvous, a
    rank's address); our store closes a connection that does not start with its token, before reading a
    request."""
    fds = fd_count()
    server = StoreServer("127.0.0.1")
    try:
        # a client that connects and never authenticates holds nobody up (it is closed after 3 s)
        idle = socket.create_connection(("127.0.0.1", server.address.port))
        assert _rogue_attempts(server.address.port) == []
        forged = StoreAddress("127.0.0.1", server.address.port, os.urandom(16))
        with pytest.raises(PermissionError, match="refused this client"):
            StoreClient(forged, 2.0)
        client = server.client(5.0)
        assert client.num_keys() == 0 and not client.check(["abort"])
        client.close()
        idle.close()
        assert "token" not in repr(server.address)  # it stays out of logs and tracebacks
    finally:
        server.close()
    assert _store_threads() == []
    assert fd_count() == fds


def test_store_is_a_torch_store_for_gloo_and_prefixes(timing):
    server = StoreServer("127.0.0.1")
    clients = [server.client(10.0), server.client(10.0)]
    try:
        a = clients[0]
        assert a.add("n", 2) == 2 and a.add("n", 3) == 5
        assert a.compare_set("c", "", "x") == b"x" and a.compare_set("c", "y", "z") == b"x"
        assert a.check(["n", "c"]) and a.delete_key("c") and not a.check(["c"])
        dist.PrefixStore("p", a).set("k", b"\x00\xff")
        assert a.get("p/k") == b"\x00\xff" and a.num_keys() == 2
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"not all set within 0\.2 s"):  # torch's DistStoreError
            a.wait(["never"], datetime.timedelta(seconds=0.2))
        timing.bound(time.monotonic() - start, 2, "the wait's timeout")  # 0.2 s, not the client's 10 s
        groups: list = [None, None]

        def build(rank: int) -> None:
            groups[rank] = new_group("gloo", clients[rank], rank, 2, timeout=20, host="127.0.0.1")

        threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        received = torch.zeros(3)
        work = groups[1].send([torch.arange(3.0)], 0, 7)
        groups[0].recv([received], 1, 7).wait()
        work.wait()
        assert received.tolist() == [0.0, 1.0, 2.0]
        groups.clear()
        del work
    finally:
        for c in clients:
            c.close()
        server.close()


def test_closing_a_client_wakes_a_thread_blocked_in_it(timing):
    """An abandoned rendezvous thread (a node failed meanwhile) ends when its store closes, instead of
    holding the process until a timeout (60 s here: the thread ends long before, within the join)."""
    server = StoreServer("127.0.0.1")
    client = server.client(60.0)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            client.wait(["never"])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    poll_until(lambda: blocked_in(thread, "_recv_exact"))  # waiting for the store's reply
    start = time.monotonic()
    client.close()
    thread.join(30)
    assert not thread.is_alive() and errors
    timing.bound(time.monotonic() - start, 1, "waking the thread")
    server.close()


@pytest.mark.parametrize("pattern", ["%j", "job_%j", "sub/%j", ""])
def test_submitit_folders_are_private(tmp_path, pattern):
    root = tmp_path / "runs"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    folder = f"{root}/{pattern}" if pattern else str(root)
    made = private_folder(folder)
    expected = root / "sub" if pattern.startswith("sub/") else root
    assert made == expected
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    job = made / "123"
    job.mkdir(mode=0o755)
    pickle = job / "123_submitted.pkl"
    pickle.write_bytes(b"token")
    os.chmod(pickle, 0o644)
    private_files(folder)
    assert stat.S_IMODE(pickle.stat().st_mode) == 0o600
    assert stat.S_IMODE(job.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"progress_timeout": 0}, "progress_timeout must be a positive number of seconds or None"),
        ({"progress_timeout": "1"}, "progress_timeout must be"),
        ({"collector_kwargs": {"worker_timeout": -1}}, r"collector_kwargs\['worker_timeout'\] must be"),
    ],
)
def test_timeouts_are_checked_in_the_trainer_before_any_node_starts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedCollector(pendulum, frames_per_batch=8, num_collectors=1, **kwargs)


def _reset(port: int, data: bytes) -> None:
    """Connect to ``port``, send ``data`` and reset the connection (``SO_LINGER`` 0: an RST, no FIN)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if data:
            sock.sendall(data)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.distributed
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_connection_reset_on_the_control_listener_ends_that_connection_only() -> None:
    """A local user's connection that resets before (or during) its hello ended the whole collector
    (ConnectionResetError in the handshake reached the collector's task group)."""
    import anyio

    from support import ConstantPolicy

    with anyio.fail_after(120):
        async with DistributedCollector(
            pendulum, ConstantPolicy(0.0), frames_per_batch=8, num_collectors=1
        ) as collector:
            await collector.__anext__()
            port = collector._transport._address.port
            for data in (b"", b"x", b"\xff" * 100):
                _reset(port, data)
            async with await anyio.connect_tcp("127.0.0.1", port) as garbage:
                await garbage.send(b"\x00" * 32)  # a hello's size, wrong: closed by the trainer
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await garbage.receive()
            for _ in range(3):
                assert (await collector.__anext__()).batch_size == (8,)
