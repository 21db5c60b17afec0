"""A local Ray cluster started by ``RayCollector`` stays on loopback: every process of it listens on
``127.0.0.1`` only (``ss -ltnp``), and the node's address is ``127.0.0.1`` (Ray would move it to the
machine's network address). ``-m distributed`` (``nox -s distributed``): it starts Ray."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys

import anyio
import cloudpickle
import psutil
import pytest

from aiocollect import RayCollector
from aiocollect._remote._ray_local import is_loopback
from support import pendulum

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180), pytest.mark.usefixtures("support_by_value")]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return ("asyncio", {"use_uvloop": False})


def listeners(pids: set[int]) -> list[tuple[str, str]]:
    """``(local address, process)`` of every TCP listener of ``pids``, as ``ss -ltnp`` shows them."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if any(f"pid={pid}," in fields[-1] for pid in pids):
            found.append((fields[3], fields[-1]))
    return found


def host_of(address: str) -> str:
    """``127.0.0.1:80`` -> ``127.0.0.1``; ``[::ffff:127.0.0.1]:80`` -> ``127.0.0.1``; ``*:80`` -> ``*``."""
    host = address.rsplit(":", 1)[0].strip("[]").split("%")[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def test_is_loopback() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.1.2.3", "192.0.2.2", "", None, "ray.example"]))


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
async def test_a_local_cluster_listens_on_loopback_only() -> None:
    ray = pytest.importorskip("ray")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if ray.is_initialized():  # pragma: no cover - another module's cluster
        pytest.skip("ray is initialised already")
    with anyio.fail_after(150):
        async with RayCollector(
            pendulum, frames_per_batch=8, num_collectors=1, remote_config={"num_cpus": 0}
        ) as collector:
            await collector.__anext__()
            assert ray.util.get_node_ip_address() == "127.0.0.1"
            pids = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
            found = listeners(pids)
            names = " ".join(process for _, process in found)
            assert "gcs_server" in names and "raylet" in names, found
            exposed = [(a, p) for a, p in found if not is_loopback(host_of(a))]
            assert exposed == [], exposed
    assert not ray.is_initialized()
