"""Checkpoint files that survive a kill mid-write: :func:`save_checkpoint` writes atomically, and
:func:`load_checkpoint` names a file that is not a whole checkpoint.

``torch.save(state, "ckpt.pt")`` writes the final path in place: a SIGKILL (a preemption past its grace
period, the OOM killer) during the write of a large checkpoint leaves a truncated file, and the previous
checkpoint is gone with it. :func:`save_checkpoint` writes a temporary file in the same folder, flushes it
to disk (``fsync``), renames it over the path (``os.replace``, atomic on POSIX) and flushes the folder, so
the path holds the previous checkpoint or the new one, whole, at every moment.

Example:
    >>> import tempfile, pathlib, torch
    >>> from aiocollect import load_checkpoint, save_checkpoint
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt.pt"
    >>> _ = save_checkpoint({"frames": 1000, "weights": torch.zeros(3)}, path)
    >>> load_checkpoint(path)["frames"]
    1000
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import zipfile
from pathlib import Path
from typing import Any

import torch

from ._errors import keep_fields_when_pickled

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: truncated (a write that was killed), or not a ``torch.save``
    file. ``path`` is the file, ``size`` its bytes."""

    def __init__(self, message: str, path: Path, size: int) -> None:
        super().__init__(message)
        self.path, self.size = path, size


keep_fields_when_pickled(CheckpointError)  # its path and size go with it across processes


def _path_arg(name: str, path: Any) -> Path:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name}: path must be a str or a path-like object (pathlib.Path), got {path!r}")
    return Path(path)


def _temporary(path: Path) -> re.Pattern[str]:
    """The names of ``path``'s temporary files (``.<name>.<pid>.<random>.tmp``, in its folder)."""
    return re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]+\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(path: Path) -> None:
    """Remove the temporary files a writer of ``path`` left when it was killed mid-write (its pid gone)."""
    pattern = _temporary(path)
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            match = pattern.fullmatch(entry.name)
            if match is not None and not _alive(int(match.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _fsync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (the rename) to disk; a file system that cannot (some network ones) is
    left as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``state`` (a collector's ``state_dict()``, with anything else to resume: the trainer's policy
    and optimizer, a replay buffer) to ``path`` with ``torch.save``, atomically: a kill at any moment leaves
    at ``path`` the previous checkpoint or this one, whole, never a truncated file.

    The bytes go to a temporary file in ``path``'s folder (``.<name>.<pid>.<random>.tmp``, made with the
    permissions ``open`` gives a new file), flushed to disk (``fsync``), renamed over ``path``
    (``os.replace``), then the folder is flushed so that the rename survives a power loss. Temporary files
    of earlier writers that were killed mid-write are removed first. Returns ``path``.

    Raises ``FileNotFoundError`` naming the folder if it does not exist, and what ``torch.save`` raises
    for a ``state`` it cannot write (``path`` is then left as it was).
    """
    path = _path_arg("save_checkpoint", path)
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(
            f"save_checkpoint: the folder {str(folder)!r} of {str(path)!r} does not exist: create it first "
            "(e.g. Path(path).parent.mkdir(parents=True, exist_ok=True))"
        )
    _sweep(path)
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)
    return path


def load_checkpoint(
    path: str | os.PathLike[str], *, map_location: Any = None, weights_only: bool = True
) -> Any:
    """The checkpoint at ``path``: ``torch.load(path, weights_only=True)`` (no code runs while it loads;
    the collectors' states hold tensors, numbers, strings, lists and dicts only).

    A file that is not a whole checkpoint (truncated by a kill mid-write, or not a ``torch.save`` file)
    raises :class:`CheckpointError` naming it and its size, rather than the reader's ``failed finding
    central directory``. A missing file raises ``FileNotFoundError``; ``map_location`` and
    ``weights_only`` are ``torch.load``'s.
    """
    path = _path_arg("load_checkpoint", path)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at {str(path)!r}")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        if zipfile.is_zipfile(path):
            raise  # a whole file: the error is about its content (e.g. a class weights_only refuses)
        size = path.stat().st_size
        raise CheckpointError(
            f"load_checkpoint: {str(path)!r} ({size:,} bytes) is not a whole checkpoint: it is truncated (a "
            "write killed before it ended: torch.save writes its path in place) or not a torch.save file. "
            "Load an earlier checkpoint, and write them with aiocollect.save_checkpoint, which replaces the "
            "file atomically",
            path,
            size,
        ) from exc
