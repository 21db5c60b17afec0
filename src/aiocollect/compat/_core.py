"""``CompatCollector``: torchrl's iterator surface (as coroutines) over one aiocollect collector."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.lowlevel
from tensordict import TensorDictBase

from .._local._collector import Collector as NativeCollector

__all__ = ["CompatCollector"]


def _tracked(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a coroutine method), its coroutines kept until the collector's next step, which
    checks that each was awaited (:meth:`CompatCollector._check_awaited`)."""

    @functools.wraps(method)
    def call(self: CompatCollector, *args: Any, **kwargs: Any) -> Any:
        coro = method(self, *args, **kwargs)
        calls = self.__dict__.setdefault("_calls", [])
        if len(calls) >= 64:  # those awaited since are forgotten
            calls[:] = [c for c in calls if inspect.getcoroutinestate(c[1]) == inspect.CORO_CREATED]
        calls.append((name, coro))
        return coro

    if hasattr(inspect, "markcoroutinefunction"):  # Python 3.12+: still a coroutine function to inspect
        inspect.markcoroutinefunction(call)
    return call


def _track_coroutines(cls: type) -> None:
    """Wrap ``cls``'s own public coroutine methods with :func:`_tracked`."""
    for name, value in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(value):
            setattr(cls, name, _tracked(name, value))


class CompatCollector:
    """torchrl's iterator surface (as coroutines) over one aiocollect collector.

    Its methods are coroutines where torchrl's block (``set_seed``, ``update_policy_weights_``,
    ``reset``, ...): one called and never awaited did nothing, and the collector's next step raises a
    ``RuntimeError`` naming it, rather than leaving the seeding or the weight update undone in silence.
    """

    _inner: Any
    _needs_entering = True
    #: the coroutines of the calls since the last step, by method name (see ``_tracked``)
    _calls: list[tuple[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _track_coroutines(cls)

    def _setup(self, inner: Any, post_collect_hook: Any, pre_collect_hook: Any) -> None:
        self._inner = inner
        for name, hook in (("post_collect_hook", post_collect_hook), ("pre_collect_hook", pre_collect_hook)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be a callable or None, got {hook!r}")
        self._post_collect_hook = post_collect_hook
        self._pre_collect_hook = pre_collect_hook
        self._entered = False  # by `async with` or by us
        self._entered_by_us = False
        self._shut = False
        self._exhausted = False  # total_frames reached: iteration ends (then shut down)
        #: the state at a clean shutdown: what state_dict() returns afterwards (TorchRL's final checkpoint)
        self._final_state: dict[str, Any] | None = None

    # -- context and start-up ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self._inner.__aenter__()
        self._entered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            if exc_type is None:
                await self._keep_final_state()
        finally:  # shut down even if reading the state was cancelled
            self._entered = False
            self._shut = True
            result = await self._inner.__aexit__(exc_type, exc, tb)
        return result

    async def _keep_final_state(self) -> None:
        """Read the state before a clean shutdown, for a ``state_dict()`` after it (TorchRL's users save
        the final checkpoint after the loop, which has shut the collector down)."""
        if self._shut or not (self._entered or not self._needs_entering):
            return
        try:
            self._final_state = await self._inner.state_dict()
        except Exception:  # a collector that cannot say its state (a worker died) still shuts down
            self._final_state = None

    async def _ensure_started(self) -> None:
        if self._shut:
            raise RuntimeError(f"{type(self).__name__} was shut down; build a new one")
        if not self._entered and self._needs_entering:
            await self._inner.__aenter__()
            self._entered = self._entered_by_us = True

    async def _stop(self, exc: BaseException | None = None) -> None:
        """Shut down; exits the collector's context if we entered it."""
        try:
            if exc is None:
                await self._keep_final_state()
        finally:  # shut down even if reading the state was cancelled
            await self._close(exc)

    async def _close(self, exc: BaseException | None) -> None:
        self._shut = True
        # no cancel scope of our own around this: the task group being left was entered before it
        # (the collectors shield their own shutdown)
        if self._entered_by_us:
            self._entered = self._entered_by_us = False
            await self._inner.__aexit__(
                type(exc) if exc is not None else None, exc, exc.__traceback__ if exc else None
            )
        else:
            await self._inner.aclose()

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Any:
        raise TypeError(
            f"{type(self).__name__} is an async iterable: write `async for batch in collector:` inside a "
            "coroutine (run it with anyio.run(main) or asyncio.run(main()))"
        )

    def __aiter__(self) -> Self:
        return self

    def iterator(self) -> Self:
        """The collector itself (``async for batch in collector.iterator():``)."""
        return self

    async def __anext__(self) -> TensorDictBase | None:
        await anyio.lowlevel.checkpoint()  # a call started as a task (start_soon) begins first
        self._check_awaited()
        if self._exhausted:
            raise StopAsyncIteration
        await self._ensure_started()
        if self._pre_collect_hook is not None:
            self._pre_collect_hook()
        try:
            batch = await self._inner.__anext__()
        except StopAsyncIteration:
            self._exhausted = True
            await self._stop()
            raise
        except BaseException as exc:
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                await self._stop(exc)  # as torchrl: any error shuts the collector down
            raise
        if self._post_collect_hook is not None and batch is not None:
            self._post_collect_hook(batch)
        return batch

    def _check_awaited(self) -> None:
        """Raise if a method called since the last step was never awaited (it did nothing)."""
        calls: list[tuple[str, Any]] = self.__dict__.get("_calls", [])
        self._calls = []
        forgotten = [(n, c) for n, c in calls if inspect.getcoroutinestate(c) == inspect.CORO_CREATED]
        for _, coro in forgotten:
            coro.close()  # (no "never awaited" RuntimeWarning later: this error says it)
        if forgotten:
            cls, names = type(self).__name__, sorted({n for n, _ in forgotten})
            calls_text = " and ".join(f"{cls}.{n}(...)" for n in names)
            raise RuntimeError(
                f"{calls_text} {'was' if len(names) == 1 else 'were'} called but never awaited, so it did "
                f"nothing: write `await collector.{names[0]}(...)` (a synchronous helper that calls it "
                "becomes `async def` and is awaited too)"
            )

    async def next(self) -> TensorDictBase | None:
        """The next batch, or ``None`` when ``total_frames`` are collected (torchrl's ``next()``)."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return None

    def __len__(self) -> int:
        return len(self._inner)

    # -- control ----------------------------------------------------------------------------------
    async def update_policy_weights_(
        self,
        policy_or_weights: Any = None,
        *,
        weights: Any = None,
        policy: Any = None,
        worker_ids: Any = None,
        model_id: str | None = None,
        weights_dict: Any = None,
        **kwargs: Any,
    ) -> int:
        """``await collector.update_weights(..., wait=True)``: copies (never aliases) weights and, as
        torchrl's call does, returns only once every targeted worker runs them; returns the version.
        ``wait=False`` returns as soon as they are published (aiocollect's default)."""
        if worker_ids is not None:
            if isinstance(self._inner, NativeCollector):
                raise TypeError("worker_ids: an in-process collector has no workers")
            kwargs["worker_ids"] = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        if model_id not in (None, "policy"):
            raise TypeError(f"model_id={model_id!r}: only the policy's weights are synchronised")
        if weights_dict is not None:
            raise TypeError("weights_dict: only the policy's weights are synchronised; pass them as weights=")
        sources = [s for s in (policy_or_weights, weights, policy) if s is not None]
        if len(sources) > 1:
            raise TypeError("give the weights once: policy_or_weights, weights= or policy=")
        kwargs.setdefault("wait", True)
        await self._ensure_started()
        return int(await self._inner.update_weights(sources[0] if sources else None, **kwargs))

    async def shutdown(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - torchrl's signature; not used
        close_env: bool = True,
        raise_on_error: bool = True,
    ) -> None:
        """Stop the workers and close the envs (``await collector.aclose()``). Idempotent.

        ``timeout`` and ``raise_on_error`` are accepted and unused: the shutdown is bounded by the worker
        pool's own deadlines (a worker that does not stop is killed), and never raises for a dead worker.
        """
        if not close_env:
            raise TypeError("close_env=False is not supported: the collector owns its envs")
        await self._stop()

    async def async_shutdown(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - torchrl's signature; not used
        close_env: bool = True,
    ) -> None:
        """The same as :meth:`shutdown`."""
        await self.shutdown(timeout, close_env)

    async def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the envs (worker ``i`` after worker ``i - 1``); returns the last seed used."""
        if static_seed:
            raise TypeError("static_seed=True is not supported: worker i is seeded after worker i - 1")
        await self._ensure_started()
        return int(await self._inner.set_seed(seed))

    async def reset(self, index: Any = None, reset_idx: Any = None, **kwargs: Any) -> None:
        """Reset every env (new episodes, new trajectory ids)."""
        if index is not None or reset_idx is not None or kwargs:
            raise TypeError("partial resets are not supported: reset() resets every env")
        await self._ensure_started()
        await self._inner.reset()

    async def state_dict(self) -> dict[str, Any]:
        """The collector's state; after the iteration ended (or ``shutdown()``), its final state."""
        if self._shut and self._final_state is not None:
            return self._final_state
        await self._ensure_started()
        return await self._inner.state_dict()

    async def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        await self._ensure_started()
        await self._inner.load_state_dict(state_dict)

    async def start(self) -> None:
        """Collect into the replay buffer in the background until ``shutdown()``."""
        if not self._entered:
            await self._inner.__aenter__()
            self._entered = self._entered_by_us = True
        await self._inner.start()

    @asynccontextmanager
    async def pause(self) -> AsyncIterator[None]:
        """``async with collector.pause():`` no batch is collected (or delivered) inside."""
        async with self._inner.pause():
            yield

    @property
    def policy_version(self) -> int:
        return int(self._inner.policy_version)

    def get_policy_version(self) -> int:
        return self.policy_version

    @property
    def frames_per_batch(self) -> int:
        return int(self._inner.frames_per_batch)

    @property
    def requested_frames_per_batch(self) -> int:
        return self.frames_per_batch

    @property
    def total_frames(self) -> int:
        return int(self._inner.total_frames)

    def stats(self, workers: str = "aggregate") -> dict[str, Any]:
        """torchrl's ``stats()`` keys from :meth:`statistics`."""
        if workers != "aggregate":
            raise TypeError("per-worker statistics are not kept; use stats() (aggregate)")
        s = self._inner.statistics()
        total = self.total_frames
        return {
            "frames": s.frames,
            "batches": s.batches,
            "total_frames": total,
            "completed": 0 < total <= s.frames,
            "requested_frames_per_batch": self.frames_per_batch,
            "policy_version": s.policy_version,
        }

    def statistics(self) -> Any:
        return self._inner.statistics()

    @property
    def replay_buffer(self) -> Any:
        return self._inner.replay_buffer

    @property
    def inner(self) -> Any:
        """The aiocollect collector underneath."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        hint = _NOT_AVAILABLE.get(name)
        if hint is None:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")
        raise AttributeError(f"{type(self).__name__}.{name} is not available in aiocollect: {hint}")


_track_coroutines(CompatCollector)

_NOT_AVAILABLE = {
    "receive_weights": "weights flow one way, from the trainer: use update_policy_weights_",
    "register_scheme_receiver": "weight sync schemes are not used: use update_policy_weights_",
    "increment_version": "update_policy_weights_ bumps the version",
    "map_fn": (
        "the multi-process collectors have `await collector.map_fn('env.method', ...)`; in process, call "
        "the method on collector.env"
    ),
    "cascade_execute": "use `await collector.map_fn('env.method', ...)` on a multi-process collector",
    "get_distant_attr": (
        "the multi-process collectors have `await collector.get_distant_attr('env.name')`; in process, "
        "read collector.env"
    ),
    "getattr_rb": "use collector.replay_buffer",
    "enable_profile": "profile the loop with torch.profiler around the `async for`",
    "disable_profile": "profile the loop with torch.profiler around the `async for`",
    "rollout": "use `await collector.next()` (it counts frames and applies postproc)",
}
