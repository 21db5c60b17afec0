"""Argument checks shared by the collectors: each error names the argument and the fix.

A value of the wrong type raises ``TypeError``; a value of the right type out of range, ``ValueError``.
The options objects (``_core/_options.py``) are built from these checks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, overload

import torch
from tensordict.nn import InteractionType

__all__ = [
    "MIN_FRAME_BYTES",
    "Devices",
    "batch_memory",
    "compile_arg",
    "device_arg",
    "exploration_type_arg",
    "flag",
    "frames_per_batch_arg",
    "init_random_frames_arg",
    "int_type",
    "is_int",
    "lag_arg",
    "non_negative_int",
    "optional_callable",
    "optional_positive_int",
    "policy_arg",
    "positive_int",
    "replay_buffer_arg",
    "seed_arg",
    "timeout_arg",
    "total_frames_arg",
    "traj_ids_arg",
]


#: the bytes every frame of a batch takes whatever the env: its reward, done flags and trajectory id
MIN_FRAME_BYTES = 4 + 6 + 8


def _memory() -> int | None:
    """This machine's physical memory in bytes (``None`` where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def _size(n: int) -> str:
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.1f} {unit}"
    return f"{n} bytes"


def batch_memory(frames: int, nbytes: int, what: str) -> None:
    """Refuse a batch of ``frames`` frames that needs ``nbytes`` (``what`` says of which entries) when it
    would not fit in this machine's memory, with a ``ValueError`` naming ``frames_per_batch``: before any
    process starts or any batch is allocated (a ``MemoryError`` of tebibytes otherwise)."""
    memory = _memory()
    if memory is not None and nbytes > memory:
        raise ValueError(
            f"frames_per_batch={frames:,} needs {_size(nbytes)} per batch ({nbytes // max(frames, 1):,} "
            f"bytes per frame for {what}), more than this machine's {_size(memory)} of memory: choose a "
            "smaller frames_per_batch (a batch is held whole in memory)"
        )


def frames_per_batch_arg(value: Any, name: str = "frames_per_batch") -> int:
    """``frames_per_batch`` (or one worker's, ``name``): a positive int whose batch can fit in memory
    (:func:`batch_memory`, at :data:`MIN_FRAME_BYTES` a frame: the env's own entries come on top)."""
    frames = positive_int(name, value)
    batch_memory(frames, frames * MIN_FRAME_BYTES, "the rewards, done flags and trajectory ids alone")
    return frames


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_type(name: str, value: Any, what: str) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is an int (``what``: the values it takes)."""
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


def positive_int(name: str, value: Any) -> int:
    int_type(name, value, "a positive int")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def optional_positive_int(name: str, value: Any, *, fix: str = "use None to disable it") -> int | None:
    if value is None:
        return None
    int_type(name, value, f"a positive int or None ({fix})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int or None ({fix}), got {value!r}")
    return int(value)


def non_negative_int(name: str, value: Any, *, fix: str) -> int:
    int_type(name, value, f"an int >= 0 ({fix})")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0 ({fix}), got {value!r}")
    return int(value)


def total_frames_arg(value: Any) -> int:
    """``-1`` or ``None``: endless; otherwise a positive int."""
    what = "a positive int, or -1 (or None) for an endless collector"
    if value is None:
        return -1
    int_type("total_frames", value, what)
    if value == -1:
        return -1
    if value <= 0:
        raise ValueError(f"total_frames must be {what}, got {value!r}")
    return int(value)


def init_random_frames_arg(value: Any) -> int:
    if value is None:
        return 0
    return non_negative_int("init_random_frames", value, fix="None or 0: no random frames")


_EXPLORATION = {t.value: t for t in InteractionType}


def exploration_type_arg(value: Any) -> InteractionType:
    """``"random"``, ``"deterministic"``, ``"mode"``, ``"mean"``, ``"median"`` or an ``InteractionType``."""
    if isinstance(value, InteractionType):
        return value
    if not isinstance(value, str) or value.lower() not in _EXPLORATION:
        # one error type for any value outside the choices (as before the options objects)
        choices = f"one of {sorted(_EXPLORATION)} or a tensordict.nn.InteractionType"
        raise ValueError(f"exploration_type={value!r} is not {choices}")
    return _EXPLORATION[value.lower()]


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def optional_callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable or None, got {value!r}")
    return value


def compile_arg(value: Any) -> bool | Mapping[str, Any]:
    if isinstance(value, (bool, Mapping)):
        return value
    raise TypeError(f"compile_policy must be True, False or a dict of torch.compile kwargs, got {value!r}")


@overload
def seed_arg(value: int) -> int: ...
@overload
def seed_arg(value: Any) -> int | None: ...
def seed_arg(value: Any) -> int | None:
    if value is not None and not is_int(value):
        raise TypeError(f"seed must be an int or None, got {value!r}")
    return value


def policy_arg(value: Any) -> Any:
    """A collector's ``policy`` checked; a mapping ``{group: module}`` (a policy per agent group) is made a
    ``GroupPolicy`` where the rollout takes its own copy (``own_policy``)."""
    if value is not None and not callable(value) and not isinstance(value, Mapping):
        raise TypeError(
            "policy must be a TensorDictModule, an nn.Module, a callable td -> td, a dict {group: module} "
            f"or None, got {value!r}"
        )
    return value


def replay_buffer_arg(value: Any) -> Any:
    if value is not None and not callable(getattr(value, "extend", None)):
        raise TypeError(
            f"replay_buffer must have an extend(batch) method (e.g. a torchrl ReplayBuffer), got {value!r}"
        )
    return value


def device_arg(name: str, value: Any) -> torch.device | None:
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}={value!r} is not a torch device ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={value!r} but CUDA is not available here; use 'cpu'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{name}={value!r} but this machine has {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name}={value!r} but MPS is not available here; use 'cpu'")
    return device


@dataclass(frozen=True)
class Devices:
    """Where the env steps, the policy runs and the batch is stored (``device`` fills the others)."""

    env: torch.device | None = None
    policy: torch.device | None = None
    storing: torch.device | None = None


def lag_arg(value: Any) -> int | None:
    if value is None:
        return None
    return non_negative_int("max_policy_lag", value, fix="batches a worker may run behind; None: no limit")


def traj_ids_arg(start: Any, stride: Any) -> tuple[int, int]:
    """``traj_id_start`` (a non-negative int) and ``traj_id_stride`` (a positive int)."""
    start = non_negative_int("traj_id_start", start, fix="the first trajectory id")
    return start, positive_int("traj_id_stride", stride)


def timeout_arg(value: Any, name: str = "worker_timeout") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive number of seconds or None, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)
