"""The async vector envs of ``AsyncEnvCollector``'s engine on the loop (``_run.py``): one task per vector env
of ``N`` sub-envs, and here what it makes of a vector step's values.

The task stages its ``N`` observations as a block (rows ``first`` to ``first + N - 1``, the sub-envs' env
ids), queues its ``N`` rows as ready at once, waits once for the ``N`` actions (one policy call gives them
all: the policy task never splits a vector env's rows), awaits one ``step``, and appends ``N`` frames as
block copies (``Engine.append``: over two batches where one fills up). The protocol's autoreset is
same-step: the frame's next observation of an ended sub-env is ``info["final_obs"][k]``, and its staged
observation for the next step the reset one, ``obs[k]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._envset import EnvSet

__all__ = ["blocks_of", "column", "final_obs"]


def blocks_of(spec: EnvSet, obs: Any, width: int) -> list[np.ndarray]:
    """A vector env's observation as one array ``[width, ...]`` per key, its shapes checked."""
    blocks = [np.asarray(value) for value in spec.arrays(obs)]
    for (key, leaf), block in zip(spec.obs_specs.items(), blocks, strict=True):
        if block.shape != (width, *leaf.shape):
            raise ValueError(
                f"an async vector env of {width} sub-envs gave the observation {key!r} of shape "
                f"{block.shape}; it must be {(width, *leaf.shape)} (num_envs first)"
            )
    return blocks


def final_obs(spec: EnvSet, blocks: list[np.ndarray], done: np.ndarray, info: Any) -> list[np.ndarray]:
    """The next observations of a step: the reset ones in ``blocks``, where a sub-env ended its final
    one from ``info["final_obs"]`` (same-step autoreset)."""
    finals = info.get("final_obs") if isinstance(info, Mapping) else None
    ended = done.nonzero()[0].tolist()
    if finals is None or len(finals) != len(done) or any(finals[k] is None for k in ended):
        raise ValueError(
            f"an async vector env's sub-envs {ended} ended without info['final_obs'][k]: the async "
            "vector env protocol resets ended sub-envs in the same step and gives their final "
            "observations in info['final_obs'] (gymnasium's AutoresetMode.SAME_STEP)"
        )
    nxt = [block.copy() for block in blocks]
    for k in ended:
        for slot, value in zip(nxt, spec.arrays(finals[k]), strict=True):
            slot[k] = value
    return nxt


def column(value: Any, dtype: Any, width: int, what: str) -> np.ndarray:
    """A vector step's ``reward``, ``terminated`` or ``truncated`` as an array ``(width,)``, checked."""
    array = np.asarray(value, dtype=dtype)
    if array.shape != (width,):
        raise ValueError(
            f"an async vector env of {width} sub-envs gave {what} of shape {array.shape}; it must be "
            f"({width},)"
        )
    return array
