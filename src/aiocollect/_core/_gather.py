"""Concurrent awaits whose first error propagates as itself, not wrapped in an ExceptionGroup."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ["gather"]


async def gather(*fns: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Run ``fns`` concurrently and return their results in order.

    The first to raise cancels the others and its exception propagates unchanged (type and traceback),
    which is what a caller of ``update_weights`` or ``async with`` expects to catch.

    Example:
        >>> async def one():
        ...     return 1
        >>> anyio.run(gather, one, one)
        [1, 1]
    """
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    async def run(i: int, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            results[i] = await fn()
        except Exception as exc:
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for i, fn in enumerate(fns):
            tg.start_soon(run, i, fn)
    if errors:
        raise errors[0]
    return results
