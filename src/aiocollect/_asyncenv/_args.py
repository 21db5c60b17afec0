"""The arguments of ``AsyncEnvCollector`` (and ``MultiAsyncEnvCollector``) checked on their own, and the
choice of its engine: the fused one over process envs (``_fused.py``) or the engine on the loop."""

from __future__ import annotations

from typing import Any

from .._procenv._driven import is_process_env
from ._fused import FusedEngine
from ._policy import is_async_policy
from ._run import Engine

__all__ = ["engine_kind", "fused_arg", "max_wait_arg", "on_env_error_arg"]


def max_wait_arg(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"max_wait must be a number of seconds (e.g. 0.002), got {value!r}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"max_wait must be >= 0 and finite (seconds the oldest ready env may wait), got {value!r}"
        )
    return float(value)


def on_env_error_arg(value: Any) -> str:
    """``on_env_error``: ``"raise"`` or ``"drop"`` (also ``MultiAsyncEnvCollector``'s, per worker)."""
    if value not in ("raise", "drop"):
        raise ValueError(
            f"on_env_error must be 'raise' (an env's error ends the collector) or 'drop' (the env is closed "
            f"and dropped, the others go on), got {value!r}"
        )
    return str(value)


def fused_arg(value: Any, policy: Any, restart: Any) -> bool | None:
    """``fused``: ``None`` (``False`` where an async policy or ``restart`` rules the fused engine out),
    ``True`` (what rules it out is refused here) or ``False``."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"fused must be None (when possible), True or False, got {value!r}")
    async_policy = is_async_policy(policy)
    if value is None:  # the engine on the loop it is, for an async policy or restart=
        return False if async_policy or restart is not None else None
    if value:
        if async_policy:
            raise ValueError(
                "fused=True needs a torch policy (it runs in the collector's thread); an async policy is "
                "awaited on the loop: pass fused=None"
            )
        if restart is not None:
            raise ValueError(
                "fused=True cannot restart envs (restart= rebuilds them on the loop): drop restart= or pass "
                "fused=None"
            )
    return value


def engine_kind(given: bool | None, envs: list[Any], wraps: bool) -> Any:
    """The fused engine where it steps ``envs`` (``given``: :func:`fused_arg`'s; ``wraps``: the collector
    wraps its policy), else the engine on the loop; ``fused=True`` that cannot: ``ValueError``."""
    if given is False:
        return Engine
    if not all(is_process_env(env) for env in envs):
        why = "every env must be a ProcessVectorEnv or one of its split() parts"
    elif wraps:
        why = "the collector wraps its policy (init_random_frames)"
    else:
        return FusedEngine
    if given:
        raise ValueError(f"fused=True: {why}; pass fused=None to fall back to the engine on the loop")
    return Engine
