"""Arguments of the multi-process collectors checked before any process starts (env constructors, start
method), and the switch for warnings raised inside worker processes."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence
from typing import Any

import cloudpickle

__all__ = [
    "env_fns_arg",
    "pickled_env_fns",
    "set_worker_warnings",
    "show_worker_warnings",
    "start_method_arg",
]

#: set by set_worker_warnings(); None: the AIOCOLLECT_WORKER_WARNINGS environment variable decides
_WORKER_WARNINGS: bool | None = None
_ENV_SWITCH = "AIOCOLLECT_WORKER_WARNINGS"


def set_worker_warnings(show: bool | None) -> None:
    """Show (``True``) or hide (``False``, the default) warnings raised inside worker processes.

    Worker processes ignore every warning by default (optional dependencies make them noisy, once per
    worker). When shown, a worker's warnings print on its stderr, which is the trainer's. The environment
    variable ``AIOCOLLECT_WORKER_WARNINGS=1`` shows them too; a call here takes precedence over it
    (``None`` hands the choice back to the variable). Collectors read the setting when they are
    constructed. Workers of ``worker_backend="serial"`` and the in-process ``Collector`` are threads of the
    trainer: their warnings go through the trainer's own filters, whatever this says.
    """
    global _WORKER_WARNINGS
    if show is not None and not isinstance(show, bool):
        raise TypeError(f"set_worker_warnings takes True, False or None, got {show!r}")
    _WORKER_WARNINGS = show


def show_worker_warnings() -> bool:
    if _WORKER_WARNINGS is not None:
        return _WORKER_WARNINGS
    return os.environ.get(_ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def env_fns_arg(create_env_fns: Any) -> Sequence[Any]:
    """``create_env_fns``: a non-empty list of env constructors, one per worker."""
    if isinstance(create_env_fns, (str, bytes)) or not isinstance(create_env_fns, Sequence):
        raise TypeError(
            f"create_env_fns must be a list of env constructors, one per worker, got {create_env_fns!r}"
        )
    if not create_env_fns:
        raise ValueError("create_env_fns is empty: give one env constructor per worker")
    for i, fn in enumerate(create_env_fns):
        if not callable(fn):
            raise TypeError(f"create_env_fns[{i}] must be a callable returning an env, got {fn!r}")
    return create_env_fns


def pickled_env_fns(create_env_fns: Sequence[Any]) -> list[bytes]:
    """The env constructors, cloudpickled for the worker processes (a bad one fails here)."""
    payloads = []
    for i, fn in enumerate(create_env_fns):
        try:
            payloads.append(cloudpickle.dumps(fn))
        except Exception as exc:
            raise TypeError(f"create_env_fns[{i}] cannot be pickled for the worker processes: {exc}") from exc
    return payloads


def start_method_arg(start_method: Any) -> str:
    """A multiprocessing start method available here (``None``: forkserver on Linux, else spawn)."""
    if start_method is None:
        return "forkserver" if sys.platform.startswith("linux") else "spawn"
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"start_method={start_method!r} is not available here; use one of "
            f"{multiprocessing.get_all_start_methods()}"
        )
    return str(start_method)
