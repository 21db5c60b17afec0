"""An env rebuilt from its factory after a fault (``RestartPolicy``): the rollout's env restarts.

Blocking code, run where the env is stepped (a rollout thread, a worker process). The rollout calls
:meth:`EnvRebuilder.rebuild` with the env that raised; it gets back a new :class:`ArrayEnv` of the same
shape, or the error re-raised when the policy does not restart it or its budget is spent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .._core._restart import Restart, RestartBudget, RestartPolicy, derive_seed, wait_interruptibly
from ._adapter import ArrayEnv

__all__ = ["EnvRebuilder", "close_quietly", "env_factory"]

logger = logging.getLogger("aiocollect.restarts")


def env_factory(create_env_fn: Any, policy: RestartPolicy | None) -> Callable[[], Any] | None:
    """What rebuilds the env of ``create_env_fn`` under ``policy``: ``None`` without a policy; a
    ``TypeError`` for an env instance, which cannot be built again."""
    if policy is None:
        return None
    if hasattr(create_env_fn, "step") and not isinstance(create_env_fn, type):
        raise TypeError(
            f"restart= rebuilds a failed env from its factory, but create_env_fn is an env instance "
            f"({type(create_env_fn).__name__}): pass a callable that returns one (e.g. "
            f"lambda: {type(create_env_fn).__name__}(...)), or drop restart="
        )
    return create_env_fn


def close_quietly(env: Any, cause: BaseException) -> None:
    """Close a failed env; an error on close is logged, never raised (the env is broken already)."""
    try:
        env.close()
    except Exception as exc:
        logger.warning(
            "closing %s after %s failed too: %s: %s",
            type(env).__name__,
            type(cause).__name__,
            type(exc).__name__,
            exc,
        )


class _ClosedEnv:
    """What the owner holds when its env was closed and no rebuild succeeded: closing it is a no-op."""

    def close(self) -> None:
        pass


class EnvRebuilder:
    """Rebuilds one env from ``factory`` under ``policy``'s budget.

    ``seed``: the seed the env was (last) given; rebuild ``k`` is seeded with ``derive_seed(seed, k)``.
    ``on_env``: told of every rebuilt env (its owner's reference: ``Collector.env``, a worker's env).
    ``on_restart``: told of each restart (its :class:`~aiocollect._core._restart.Restart` record) as it is
    admitted, before the backoff and the rebuild, where the env is stepped: the owner reports it at once
    (a ``Restarted`` event), whether or not a batch follows. Without it, ``budget.pending`` keeps them.
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        policy: RestartPolicy,
        *,
        seed: int | None = None,
        on_env: Callable[[Any], None] | None = None,
    ) -> None:
        self.factory = factory
        self.budget = RestartBudget(policy)
        self.seed = seed
        self.on_env = on_env
        self.on_restart: Callable[[Restart], None] | None = None

    def seeded(self, seed: int | None) -> None:
        """The env was seeded again (``set_seed``): later rebuilds derive their seeds from ``seed``."""
        self.seed = seed

    def _admitted(self) -> None:
        if self.on_restart is not None:
            for record in self.budget.drain():
                self.on_restart(record)

    def rebuild(
        self, failed: ArrayEnv, exc: BaseException, stop: Any, keys: list[Any], *, progressed: bool = True
    ) -> tuple[ArrayEnv, dict[Any, Any]]:
        """Close ``failed``, wait the backoff (cut short by ``stop``), build, seed, check and reset a new
        env: returns it and its reset observations. A build or reset that fails counts as one more
        failure. ``keys``: the recurrent states the env carries (``ArrayEnv.pass_to_env``). Raises the
        error (``exc``, or the last one) when the policy does not restart it or the budget is spent.
        ``progressed``: ``failed`` completed a step (the backoff starts again from its first value)."""
        delay = self.budget.admit(
            exc, progressed=progressed
        )  # raises first: a failure not restarted leaves the env to its owner
        self._admitted()
        close_quietly(failed.env, exc)
        while True:
            wait_interruptibly(delay, stop)
            raw = None
            try:
                raw = self.factory()
                seed = derive_seed(self.seed, self.budget.count)
                if seed is not None:
                    raw.set_seed(seed)
                env = ArrayEnv(raw)
                if env.batch_shape != failed.batch_shape or env.obs_specs.keys() != failed.obs_specs.keys():
                    raise RuntimeError(
                        f"the rebuilt env differs from the one it replaces (batch {env.batch_shape} vs "
                        f"{failed.batch_shape}, observations {list(env.obs_specs)} vs "
                        f"{list(failed.obs_specs)}): create_env_fn must build the same env every time"
                    )
                env.pass_to_env(keys)
                root = env.reset()
            except Exception as build_exc:
                if raw is not None:
                    close_quietly(raw, build_exc)
                try:
                    delay = self.budget.admit(build_exc, progressed=False)
                except BaseException:
                    if self.on_env is not None:
                        self.on_env(_ClosedEnv())  # the failed env is closed: not again by its owner
                    raise
                self._admitted()
                continue
            if self.on_env is not None:
                self.on_env(raw)
            return env, root
