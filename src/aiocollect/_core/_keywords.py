"""The keyword list every in-process and multi-process collector takes (:class:`RolloutKeywords`), written
once: the fields of :class:`~._options.RolloutOptions` given flat (:data:`ROLLOUT_KEYWORDS`), the weight
schedule's, and what a batch goes through on its way to the consumer. Each family adds its own
(``_local/_keywords.py``, ``_multi/_keywords.py``; the remote collectors' ``_remote/_keywords.py``), read by
:func:`~._mistakes.explicit_keywords` (defaults, signature, typos) and by mypy (``Unpack``).

A keyword's default is in its annotation, ``Annotated[type, Default(value)]``; the annotations are read
with ``typing.get_type_hints``, so the names in them are imported at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Annotated, Any, TypedDict

from tensordict import TensorDictBase
from tensordict.nn import InteractionType

from ._mistakes import Default
from ._options import RolloutOptions, WeightSchedule
from ._restart import RestartPolicy

__all__ = ["ROLLOUT_KEYWORDS", "RolloutKeywords", "rollout_keywords"]


class RolloutKeywords(TypedDict, total=False):
    """The keywords of ``Collector`` and the multi-process collectors: what a batch is (the fields of
    ``RolloutOptions``, given flat; or all of them as ``rollout=``), the weight schedule's (or
    ``weights=``), and what a batch goes through on its way (``postproc``, ``replay_buffer``)."""

    total_frames: Annotated[int | None, Default(-1)]
    max_frames_per_traj: Annotated[int | None, Default(None)]
    init_random_frames: Annotated[int | None, Default(None)]
    reset_at_each_iter: Annotated[bool, Default(False)]
    split_trajs: Annotated[bool, Default(False)]
    exploration_type: Annotated[str | InteractionType, Default("random")]
    set_truncated: Annotated[bool, Default(False)]
    seed: Annotated[int | None, Default(None)]
    device: Annotated[Any, Default(None)]
    env_device: Annotated[Any, Default(None)]
    policy_device: Annotated[Any, Default(None)]
    storing_device: Annotated[Any, Default(None)]
    compile_policy: Annotated[bool | Mapping[str, Any], Default(False)]
    traj_id_start: Annotated[int, Default(0)]
    traj_id_stride: Annotated[int, Default(1)]
    restart: Annotated[RestartPolicy | None, Default(None)]
    rollout: Annotated[RolloutOptions | None, Default(None)]
    track_policy_version: Annotated[bool, Default(False)]
    max_policy_lag: Annotated[int | None, Default(None)]
    weights: Annotated[WeightSchedule | None, Default(None)]
    postproc: Annotated[Callable[[TensorDictBase], TensorDictBase] | None, Default(None)]
    replay_buffer: Annotated[Any, Default(None)]
    progress: Annotated[Any, Default(None)]
    worker_timeout: Annotated[float | None, Default(None)]


#: the keywords of :class:`RolloutKeywords` that are fields of ``RolloutOptions`` (each family's own
#: ``frames_per_batch`` aside)
ROLLOUT_KEYWORDS = tuple(
    k for k in RolloutKeywords.__annotations__ if k in {f.name for f in fields(RolloutOptions)}
)


def rollout_keywords(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``RolloutOptions`` fields of a filled keyword list (for ``RolloutOptions.from_kwargs``)."""
    return {name: kwargs[name] for name in ROLLOUT_KEYWORDS}
