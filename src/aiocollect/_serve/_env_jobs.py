"""What an env server runs in its worker thread: the env calls of one message, and its reply encoded.

A message from a single-env connection holds one call; one from a batch connection (``RemoteEnvPool``)
holds one call per env it steps, and its reply one answer per call, in order, with their arrays in one
list. An env's error is that call's answer (``{"op": "error", ...}``); the others go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import gymnasium as gym
import numpy as np

from ._common import error_header
from ._wire import ProtocolError, encode, pack_tree, unpack_tree

__all__ = ["Job", "parse_calls", "run_job"]

Call = tuple[int, dict[str, Any], Any]  # (env index, the call's header, its value: an action or options)


class Job:
    """The calls of one message, and (once run) the reply to send."""

    __slots__ = ("batch", "calls", "done", "reply")

    def __init__(self, calls: list[Call], batch: bool) -> None:
        self.calls, self.batch = calls, batch
        self.done = anyio.Event()
        self.reply = b""


def parse_calls(header: dict[str, Any], arrays: list[Any], start: int, stop: int, batch: bool) -> list[Call]:
    """The calls a decoded message asks for (``ProtocolError`` if malformed or out of ``[start, stop)``)."""
    if not batch:
        return [(start, header, _value(header, arrays))]
    items = header.get("items") if header["op"] == "batch" else None
    if not isinstance(items, list):
        raise ProtocolError(f"a batch connection takes 'batch' messages with 'items', got {header['op']!r}")
    calls = []
    for item in items:
        index = item.get("i") if isinstance(item, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not start <= index < stop:
            raise ProtocolError(f"batch item {item!r} must name an env 'i' in [{start}, {stop})")
        calls.append((index, item, _value(item, arrays)))
    return calls


def _value(header: dict[str, Any], arrays: list[Any]) -> Any:
    if header.get("op") not in ("reset", "step"):
        raise ProtocolError(f"unknown op {header.get('op')!r} (reset, step)")
    return unpack_tree(header.get("value"), arrays)


def run_job(envs: list[gym.Env[Any, Any]], checkers: list[Callable[[Any], Any]], job: Job) -> bytes:
    """Run ``job``'s calls in order and encode the reply (runs in the server's worker thread).

    A batch of steps whose observations are arrays of one shape and dtype (the usual case) is answered
    in columns: the observations stacked into one array, rewards, terminated and truncated as arrays,
    one info tree per call; any other batch as one answer per call."""
    results = []
    for index, header, value in job.calls:
        try:
            results.append(_run_call(envs[index], checkers[index], header, value))
        except Exception as exc:
            results.append(("error", error_header(exc)))
    if job.batch and _columnar(results):
        return _encode_columns(results)
    arrays: list[Any] = []
    answers = [_answer(result, arrays) for result in results]
    if job.batch:
        return encode({"op": "batch", "items": answers}, arrays)
    return encode(answers[0], arrays)


def _run_call(
    env: gym.Env[Any, Any], check: Callable[[Any], Any], header: dict[str, Any], value: Any
) -> tuple[Any, ...]:
    if header["op"] == "reset":
        seed = header.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ProtocolError(f"reset seed must be an int or null, got {seed!r}")
        if value is not None and not isinstance(value, dict):
            raise ProtocolError("reset options must be a dict or null")
        return ("reset", *env.reset(seed=seed, options=value))
    obs, reward, terminated, truncated, info = env.step(check(value))
    return "step", obs, float(reward), bool(terminated), bool(truncated), info


def _answer(result: tuple[Any, ...], arrays: list[Any]) -> dict[str, Any]:
    """One call's answer; its arrays appended to ``arrays`` (none when it cannot be packed)."""
    if result[0] == "error":
        return dict(result[1])
    mark = len(arrays)
    try:
        if result[0] == "reset":
            return {"op": "reset", "obs": pack_tree(result[1], arrays), "info": pack_tree(result[2], arrays)}
        _, obs, reward, terminated, truncated, info = result
        obs_tree, info_tree = pack_tree(obs, arrays), pack_tree(info, arrays)
        return {
            "op": "step",
            "obs": obs_tree,
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "info": info_tree,
        }
    except Exception as exc:
        del arrays[mark:]
        return error_header(exc)


def _columnar(results: list[tuple[Any, ...]]) -> bool:
    if not results or any(r[0] != "step" or type(r[1]) is not np.ndarray for r in results):
        return False
    first = results[0][1]
    return first.dtype.kind in "biuf" and all(
        r[1].shape == first.shape and r[1].dtype == first.dtype for r in results
    )


def _encode_columns(results: list[tuple[Any, ...]]) -> bytes:
    arrays: list[Any] = [
        np.stack([r[1] for r in results]),
        np.array([r[2] for r in results], dtype=np.float64),
        np.array([r[3] for r in results], dtype=np.bool_),
        np.array([r[4] for r in results], dtype=np.bool_),
    ]
    infos = [pack_tree(r[5], arrays) for r in results]
    return encode({"op": "batch", "columns": {"n": len(results), "info": infos}}, arrays)
