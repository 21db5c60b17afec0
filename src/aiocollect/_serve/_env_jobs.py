"""What an env server runs in its worker thread: the env calls of one message, and its reply encoded.

A message from a single-env connection holds one call. One from a batch connection (``RemoteEnvPool``)
holds the round's steps in columns (``"steps"``: the envs' indices and their actions, two arrays, no
per-env JSON) and any other call (a reset, an action that does not stack) as an item of ``"items"``; the
reply answers the steps in columns too (the observations stacked in one array when they share a shape
and dtype, rewards and flags as arrays, the infos as ``null`` when all are empty) and the items one by
one, in order. An env's error is that call's answer (``{"op": "error", ...}``); the others go on.
The message is decoded here too (:meth:`Job.parse`), so that the event loop never parses a client's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
from gymnasium import spaces

from ._common import error_header
from ._wire import ProtocolError, decode, encode, pack_tree, unpack_tree

__all__ = ["Job", "Steps", "parse_calls", "parse_steps", "run_job", "uniform_action_checker"]

Call = tuple[int, dict[str, Any], Any]  # (env index, the call's header, its value: an action or options)
Steps = tuple[list[int], np.ndarray]  # the envs to step and their actions (one row each)
Uniform = Callable[[np.ndarray], list[Any]]  # checks a column of actions for envs sharing an action space


class Job:
    """One message of a connection to envs ``start..stop-1``, its calls (once :meth:`parse` d) and (once
    run) the reply to send."""

    __slots__ = ("batch", "calls", "done", "message", "reply", "start", "steps", "stop")

    def __init__(self, message: bytes, start: int, stop: int, batch: bool) -> None:
        self.message, self.start, self.stop, self.batch = message, start, stop, batch
        self.calls: list[Call] = []
        self.steps: Steps | None = None
        self.done = anyio.Event()
        self.reply = b""

    def parse(self) -> None:
        """Decode the message into its calls and steps (``ProtocolError`` if malformed)."""
        header, arrays = decode(self.message, request=True)
        self.message = b""
        if self.batch:
            self.steps = parse_steps(header, arrays, self.start, self.stop)
        self.calls = parse_calls(header, arrays, self.start, self.stop, self.batch)


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


def parse_steps(header: dict[str, Any], arrays: list[Any], start: int, stop: int) -> Steps | None:
    """The steps of a batch message's ``"steps"`` section (arrays 0 and 1: the env indices and their
    actions); ``ProtocolError`` if malformed or out of ``[start, stop)``. The actions are checked where the
    envs step (:func:`run_job`)."""
    steps = header.get("steps")
    if steps is None:
        return None
    if not isinstance(steps, dict) or not isinstance(n := steps.get("n"), int) or len(arrays) < 2:
        raise ProtocolError("a batch's 'steps' must be {'n': count}, the indices and actions arrays 0 and 1")
    indices, actions = arrays[0], arrays[1]
    if indices.shape != (n,) or indices.dtype.kind not in "iu" or actions.ndim < 1 or actions.shape[0] != n:
        raise ProtocolError(f"a batch of {n} steps needs {n} env indices and {n} actions")
    index_list: list[int] = indices.tolist()
    if n and (min(index_list) < start or max(index_list) >= stop):
        raise ProtocolError(f"a batch's steps must name envs in [{start}, {stop})")
    if len(set(index_list)) != n:
        raise ProtocolError("a batch steps each env at most once")
    return index_list, actions


def uniform_action_checker(space: spaces.Space[Any]) -> Uniform | None:
    """A check of a whole column of actions at once, for envs that share the action ``space`` (Discrete
    or Box); ``None`` for other spaces (each action is then checked by its env's checker)."""
    if isinstance(space, spaces.Discrete):
        low, high = int(space.start), int(space.start) + int(space.n)

        def check_discrete(actions: np.ndarray) -> list[Any]:
            if actions.ndim != 1 or actions.dtype.kind not in "iu":
                raise ValueError(f"actions of {space} must be integer scalars")
            if actions.size and (int(actions.min()) < low or int(actions.max()) >= high):
                raise ValueError(f"an action is not in {space}")
            values: list[Any] = actions.tolist()
            return values

        return check_discrete
    if isinstance(space, spaces.Box):

        def check_box(actions: np.ndarray) -> list[Any]:
            if actions.shape[1:] != space.shape or actions.dtype != space.dtype:
                raise ValueError(
                    f"actions have shape {actions.shape[1:]} and dtype {actions.dtype}, the action space "
                    f"{space} has {space.shape} and {space.dtype}"
                )
            return list(actions)

        return check_box
    return None


def _value(header: dict[str, Any], arrays: list[Any]) -> Any:
    if header.get("op") not in ("reset", "step"):
        raise ProtocolError(f"unknown op {header.get('op')!r} (reset, step)")
    return unpack_tree(header.get("value"), arrays)


def run_job(
    envs: list[gym.Env[Any, Any]],
    checkers: list[Callable[[Any], Any]],
    job: Job,
    uniform: Uniform | None = None,
) -> bytes:
    """Run ``job``'s calls (its items in order, then its steps) and encode the reply (runs in the
    server's worker thread). ``uniform`` checks all the steps' actions at once (the envs share an action
    space); otherwise, or when that check fails, each env's checker checks its own action."""
    try:
        job.parse()
    except ProtocolError as exc:
        return encode(error_header(exc))
    results = []
    for index, header, value in job.calls:
        try:
            results.append(_run_call(envs[index], checkers[index], header, value))
        except Exception as exc:
            results.append(("error", error_header(exc)))
    arrays: list[Any] = []
    reply: dict[str, Any] = {"op": "batch"}
    if job.steps is not None:
        reply["steps"] = _run_steps(envs, checkers, job.steps, uniform, arrays)
    answers = [_answer(result, arrays) for result in results]
    if not job.batch:
        return encode(answers[0], arrays)
    reply["items"] = answers
    return encode(reply, arrays)


def _run_steps(
    envs: list[gym.Env[Any, Any]],
    checkers: list[Callable[[Any], Any]],
    steps: Steps,
    uniform: Uniform | None,
    arrays: list[Any],
) -> dict[str, Any]:
    """Step the envs; their answers in columns (arrays 0 to 3: observations, rewards, terminated,
    truncated) when the observations stack, else one answer each."""
    indices, actions = steps
    checked: list[Any] | None = None
    if uniform is not None:
        try:
            checked = uniform(actions)
        except ValueError:  # some action is wrong: each env's own check says which
            checked = None
    results: list[tuple[Any, ...]] = []
    errors: dict[str, Any] = {}
    for k, index in enumerate(indices):
        try:
            action = checked[k] if checked is not None else checkers[index](actions[k])
            results.append(envs[index].step(action))
        except Exception as exc:
            errors[str(k)] = error_header(exc)
            results.append(())
    good = [r for r in results if r]
    first = good[0][0] if good else None
    if (
        type(first) is not np.ndarray
        or first.dtype.kind not in "biuf"
        or any(
            type(r[0]) is not np.ndarray or r[0].shape != first.shape or r[0].dtype != first.dtype
            for r in good
        )
    ):
        answers = [
            errors[str(k)]
            if not r
            else _answer(("step", r[0], float(r[1]), bool(r[2]), bool(r[3]), r[4]), arrays)
            for k, r in enumerate(results)
        ]
        return {"n": len(results), "answers": answers}
    blank = np.zeros_like(first)
    arrays += [
        np.stack([r[0] if r else blank for r in results]),
        np.array([r[1] if r else 0.0 for r in results], dtype=np.float64),
        np.array([r[2] if r else False for r in results], dtype=np.bool_),
        np.array([r[3] if r else False for r in results], dtype=np.bool_),
    ]
    infos = (
        None
        if all(not r or not r[4] for r in results)
        else [pack_tree(r[4] if r else {}, arrays) for r in results]
    )
    return {"n": len(results), "info": infos, "errors": errors}


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
