"""Checkpoint files and a SIGKILL in the middle of a write (a preemption past its grace period, the OOM
killer): ``save_checkpoint`` leaves the previous checkpoint whole (the bytes went to a temporary file, which
the next save removes), where ``torch.save`` on the final path leaves a truncated file, which
``load_checkpoint`` names. The child process is killed once it says it has written 8 MB of a 64 MB
checkpoint (``checkpoint_child.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiocollect import CheckpointError, load_checkpoint, save_checkpoint

CHILD = Path(__file__).with_name("checkpoint_child.py")


def killed_mid_write(mode: str, path: Path) -> None:
    """Run the child: its first checkpoint saved, SIGKILL it in the middle of its second."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), mode, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "saved 1", child.communicate(timeout=60)
        line = child.stdout.readline().strip()
        assert line.startswith("writing "), child.communicate(timeout=60)
        assert int(line.split()[1]) >= 8 * 2**20
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL


def temporaries(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def test_a_kill_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    killed_mid_write("atomic", path)
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.arange(10.0))
    [left] = temporaries(path)  # the killed write's bytes, beside it
    assert left.stat().st_size >= 8 * 2**20
    save_checkpoint({"step": 3}, path)  # the next save removes what the dead writer left
    assert load_checkpoint(path) == {"step": 3}
    assert temporaries(path) == []


def test_a_truncated_checkpoint_is_named(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    killed_mid_write("plain", path)  # torch.save on the final path: the previous checkpoint is gone
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)
    with pytest.raises(CheckpointError, match="is not a whole checkpoint: it is truncated") as info:
        load_checkpoint(path)
    assert info.value.path == path and info.value.size == path.stat().st_size >= 8 * 2**20
    assert str(path) in str(info.value)


def test_save_checkpoint_writes_with_the_usual_permissions(tmp_path: Path) -> None:
    path = save_checkpoint({"a": torch.zeros(2)}, tmp_path / "ckpt.pt")
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    assert path.stat().st_mode & 0o777 == probe.stat().st_mode & 0o777
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.zeros(2))


def test_bad_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist: create it first"):
        save_checkpoint({}, tmp_path / "missing" / "ckpt.pt")
    with pytest.raises(TypeError, match="path must be a str or a path-like"):
        save_checkpoint({}, 3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "none.pt")
    with pytest.raises(CheckpointError, match=r"not a torch\.save file"):
        (tmp_path / "text.pt").write_text("hello")
        load_checkpoint(tmp_path / "text.pt")


def test_a_state_that_cannot_be_saved_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = save_checkpoint({"step": 1}, tmp_path / "ckpt.pt")
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.save raises for a lambda
        save_checkpoint({"step": 2, "fn": lambda: None}, path)
    assert load_checkpoint(path) == {"step": 1}
    assert temporaries(path) == []
