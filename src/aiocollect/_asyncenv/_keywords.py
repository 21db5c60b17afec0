"""The async-env collectors' keywords, written once: :class:`AsyncEnvKeywords` (``AsyncEnvCollector``'s),
:class:`MultiAsyncEnvKeywords` (``MultiAsyncEnvCollector``'s), both over the keywords they share. Each
constructor takes its list as ``**kwargs: Unpack[...]`` (mypy and IDEs show the keywords; ``help()`` too,
through ``explicit_keywords``) and hands the filled list on: to :meth:`~._options.AsyncEnvOptions.of`,
which checks what it reads of it (and fills in, from these lists, what it is not given), and for
``MultiAsyncEnvCollector`` what its worker pool takes as it is (:data:`POOL_KEYWORDS`).

A keyword's default is in its annotation, ``Annotated[type, Default(value)]``; the annotations are read
with ``typing.get_type_hints``, so the names in them are imported at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypedDict

from tensordict import TensorDictBase
from tensordict.nn import InteractionType

from .._core._mistakes import Default
from .._core._restart import RestartPolicy
from .._weightsync._schemes import WeightSync

__all__ = [
    "POOL_KEYWORDS",
    "AsyncEnvKeywords",
    "MultiAsyncEnvKeywords",
    "picked",
]


class _SharedKeywords(TypedDict, total=False):
    """The keywords of both async-env collectors (each adds its own ``frames_per_batch`` and ``prefetch``:
    their types or defaults differ)."""

    total_frames: Annotated[int | None, Default(-1)]
    trajs_per_batch: Annotated[int | None, Default(None)]
    min_batch: Annotated[int | None, Default(None)]
    max_wait: Annotated[float, Default(0.002)]
    max_frames_per_traj: Annotated[int | None, Default(None)]
    split_trajs: Annotated[bool, Default(False)]
    exploration_type: Annotated[str | InteractionType, Default("random")]
    seed: Annotated[int | None, Default(None)]
    track_policy_version: Annotated[bool, Default(False)]
    on_env_error: Annotated[str, Default("raise")]
    postproc: Annotated[Callable[[TensorDictBase], TensorDictBase] | None, Default(None)]
    replay_buffer: Annotated[Any, Default(None)]
    progress: Annotated[Any, Default(None)]
    restart: Annotated[RestartPolicy | None, Default(None)]
    group_size: Annotated[int | None, Default(None)]
    on_update: Annotated[str, Default("continue")]


class AsyncEnvKeywords(_SharedKeywords, total=False):
    """``AsyncEnvCollector``'s keywords (see its docstring)."""

    frames_per_batch: Annotated[int | None, Default(None)]
    prefetch: Annotated[int, Default(1)]
    freeze_gc: Annotated[bool, Default(True)]
    fused: Annotated[bool | None, Default(None)]


class MultiAsyncEnvKeywords(_SharedKeywords, total=False):
    """``MultiAsyncEnvCollector``'s keywords (see its docstring)."""

    frames_per_batch: Annotated[int | Sequence[int] | None, Default(None)]
    prefetch: Annotated[int | None, Default(None)]
    init_random_frames: Annotated[int | None, Default(None)]
    max_policy_lag: Annotated[int | None, Default(None)]
    update_at_each_batch: Annotated[bool, Default(False)]
    loop: Annotated[Literal["asyncio", "uvloop", "trio"], Default("asyncio")]
    storing_device: Annotated[Any, Default(None)]
    num_threads: Annotated[int | None, Default(None)]
    num_sub_threads: Annotated[int, Default(1)]
    worker_backend: Annotated[Literal["process", "serial"], Default("process")]
    start_method: Annotated[str | None, Default(None)]
    weight_sync: Annotated[WeightSync | None, Default(None)]
    worker_timeout: Annotated[float | None, Default(None)]
    traj_id_start: Annotated[int, Default(0)]
    traj_id_stride: Annotated[int, Default(1)]


#: the keywords ``MultiAsyncEnvCollector``'s worker pool takes as the user gave them (the per-worker frames,
#: the budget, the random frames, the lag and ``postproc`` it takes checked, from the options)
POOL_KEYWORDS = (
    "replay_buffer",
    "storing_device",
    "update_at_each_batch",
    "progress",
    "num_threads",
    "num_sub_threads",
    "worker_backend",
    "start_method",
    "weight_sync",
    "worker_timeout",
    "traj_id_start",
    "traj_id_stride",
    "restart",
)


def picked(kwargs: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The keywords ``names`` of a filled keyword list.

    >>> picked({"seed": 1, "loop": "trio", "prefetch": 0}, ("seed", "prefetch"))
    {'seed': 1, 'prefetch': 0}
    """
    return {name: kwargs[name] for name in names}
