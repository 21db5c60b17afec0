"""The remote collectors' exposure, without starting nodes: argument checks, private submitit folders,
stores that listen on the address they are given (not on every interface)."""

from __future__ import annotations

import os
import stat

import psutil
import pytest

from aiocollect import DistributedCollector, GymEnv
from aiocollect._remote._launchers import private_files, private_folder
from aiocollect._transport._groups import master_store


def pendulum():
    return GymEnv("Pendulum-v1")


@pytest.mark.parametrize("bad", ["", 127001, b"127.0.0.1"])
def test_trainer_address_is_checked_before_anything_starts(bad):
    with pytest.raises(TypeError, match="trainer_address must be the host name or IP address"):
        DistributedCollector(pendulum, frames_per_batch=8, num_collectors=1, trainer_address=bad)


def test_master_store_listens_on_its_host_only():
    before = {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN"}
    store = master_store("127.0.0.1", 0, 10.0)
    try:
        listening = [
            c.laddr
            for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr not in before
        ]
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", store.port)]
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


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
