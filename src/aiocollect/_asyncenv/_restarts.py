"""Restarts of ``AsyncEnvCollector``'s envs (``restart=RestartPolicy(...)``), one budget per env.

An env (a vector env: all its sub-envs) whose ``reset`` or ``step`` raises is closed, and rebuilt from its
env fn in a worker thread after the backoff (``anyio.sleep`` on the loop: the other envs go on meanwhile);
its task starts again from ``reset``, seeded with a seed derived from its own and its restart count. The
engine (``_run.Engine``) ends the failed env's trajectories first.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread

from .._core._restart import RestartBudget, RestartPolicy, derive_seed
from .._envs._rebuild import env_factory
from .._observe._events import Restarted
from ._envset import EnvSet, close_once, open_env, spaces_of, vector_width
from ._frames import FrameBatch, PolicyCall

__all__ = ["EnvRestarts", "restart_arg", "truncate_last_frames"]


def restart_arg(restart: Any, env_fns: list[Any]) -> RestartPolicy | None:
    """``restart=``: a :class:`RestartPolicy` or ``None``; with one, every env fn must build its env (an env
    instance cannot be built again)."""
    if restart is not None and not isinstance(restart, RestartPolicy):
        raise TypeError(
            f"restart must be a RestartPolicy or None, got {restart!r}: "
            "e.g. restart=RestartPolicy(max_restarts=3, window=60.0)"
        )
    for fn in env_fns:
        env_factory(fn, restart)
    return restart


class EnvRestarts:
    """The budgets of an engine's envs (``u``: an env's index in ``env_fns``) and how to rebuild one.

    ``worker``: the ``Restarted`` events' worker (0 in process; a worker's index in
    ``MultiAsyncEnvCollector``), ``offset``: added to the env ids they carry (its first env's global id).
    """

    def __init__(
        self, policy: RestartPolicy, env_fns: list[Any], limiter: Any, spec: EnvSet, hub: Any
    ) -> None:
        self.budgets = [RestartBudget(policy) for _ in env_fns]
        self.env_fns = env_fns
        self.limiter = limiter
        self.spec = spec
        self.hub = hub
        self.worker = 0
        self.offset = 0
        self._frames_at_start = [0] * len(env_fns)  # env u's first row's frames when it (re)started

    def seed(self, seed: int | None, u: int) -> int | None:
        """The seed of env ``u``'s reset: ``seed`` at first, then one derived from it per restart."""
        return derive_seed(seed, self.budgets[u].count)

    def per_row(self, rows: int) -> list[int]:
        """Per row (env id): its env's restarts (a vector env's on its first row, 0 on the others)."""
        counts = [0] * rows
        for u, first in enumerate(self.spec.firsts):
            counts[first] = self.budgets[u].count
        return counts

    async def rebuild(
        self, u: int, exc: Exception, close: Callable[[int], Awaitable[None]], frames: list[int]
    ) -> Any:
        """Env ``u``'s replacement, after ``close(u)`` and the backoff; raises the error to end with
        (``exc``, or a failed build's) when the policy does not restart it or the budget is spent.
        ``frames``: the frames of each row so far (whether the env stepped since it started)."""
        budget = self.budgets[u]
        first = self.spec.firsts[u]
        progressed = frames[first] > self._frames_at_start[u]
        self._frames_at_start[u] = frames[first]
        delay = budget.admit(exc, first, progressed=progressed)
        self._publish(budget)
        await close(u)
        expected = (self.spec.observation_space, self.spec.action_space)
        while True:
            await anyio.sleep(delay)
            env = None
            try:
                env = await anyio.to_thread.run_sync(open_env, self.env_fns[u], u, self.limiter)
                if spaces_of(env) != expected:
                    raise RuntimeError(
                        f"env_fns[{u}] rebuilt an env with the spaces {spaces_of(env)}, not {expected}: an "
                        "env fn must build the same env every time"
                    )
                if vector_width(env) != self.spec.widths[u]:
                    raise RuntimeError(f"env_fns[{u}] rebuilt an env of another width: build the same env")
            except Exception as build_exc:
                if env is not None:  # the build's own error is the one that counts
                    await close_once([env], set(), 0)
                delay = budget.admit(build_exc, first, progressed=False)
                self._publish(budget)
                continue
            return env

    def _publish(self, budget: RestartBudget) -> None:
        """A ``Restarted`` event per attempt as it is made (failed rebuilds included), so that the events
        and ``statistics().restarts`` agree while an env is still being rebuilt."""
        for record in budget.drain():
            self.hub.publish(Restarted(self.worker, self.offset + record.env, record.cause, record.restarts))


def truncate_last_frames(batch: FrameBatch, calls: list[PolicyCall], rows: set[int]) -> None:
    """Mark the last frame of each of ``rows`` (env ids) in ``batch`` truncated, unless it ended its
    episode already; ``calls``: the policy calls of the batch's frames, in order. Consumes ``rows``."""
    bases = [call.base for call in calls]
    for frame in range(batch.filled - 1, -1, -1):
        number = batch.source[frame]
        call = calls[bisect_right(bases, number) - 1]
        i = int(call.env_ids[number - call.base])
        if i in rows:
            rows.discard(i)
            if not batch.terminated[frame]:
                batch.truncated[frame] = True
            if not rows:
                return
