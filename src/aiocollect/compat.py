"""TorchRL's collector names on top of aiocollect: a migration is a changed import plus ``async``.

``SyncDataCollector`` / ``Collector``, ``MultiSyncDataCollector`` / ``MultiSyncCollector``,
``MultiaSyncDataCollector`` / ``MultiAsyncCollector``, ``aSyncDataCollector`` / ``AsyncCollector``,
``MultiCollector`` and ``split_trajectories`` take torchrl's keyword names (``create_env_fn`` as a list,
``num_workers``, ``create_env_kwargs``, ``policy_factory``, ``init_fn``, ``post_collect_hook``, ...) and map
them onto :mod:`aiocollect`'s collectors. Every method that talks to the collection is a coroutine::

    # torchrl                                      # aiocollect.compat
    from torchrl.collectors import MultiSyncCollector  from aiocollect.compat import MultiSyncCollector
    collector = MultiSyncCollector(                    collector = MultiSyncCollector(
        [env_fn] * 2, policy,                              [env_fn] * 2, policy,
        frames_per_batch=256, total_frames=10_000)         frames_per_batch=256, total_frames=10_000)
    for data in collector:                             async for data in collector:
        ...                                                ...
        collector.update_policy_weights_()                 await collector.update_policy_weights_()
    collector.shutdown()                               await collector.shutdown()

The collector starts on the first ``async for`` step (or at ``async with collector:``, the structured
form, preferred) and stops when the iteration ends, when it raises (as torchrl shuts down on an error),
or at ``shutdown()``. A collector started by ``async for`` must be shut down by the task that iterated
it, outside any cancel scope opened after the iteration started (it holds a task group).

torchrl keywords that aiocollect does not implement raise a ``TypeError`` that says what to do instead;
see ``docs/migrating-from-torchrl.md`` for the full table.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

import anyio
from tensordict import TensorDictBase

from . import _collector, _multi
from ._envs._spaces import NestedKey
from ._trajectories import split_trajectories as _split_trajectories

__all__ = [
    "AsyncCollector",
    "Collector",
    "MultiAsyncCollector",
    "MultiCollector",
    "MultiSyncCollector",
    "MultiSyncDataCollector",
    "MultiaSyncDataCollector",
    "SyncDataCollector",
    "aSyncDataCollector",
    "aenumerate",
    "split_trajectories",
]

# -- keyword mapping -------------------------------------------------------------------------------
#: torchrl keywords that are refused whatever their value, with what to do instead
_REFUSED: dict[str, str] = {
    "weight_updater": "aiocollect publishes weights itself: call `await collector.update_policy_weights_()`",
    "weight_sync_schemes": (
        "aiocollect publishes weights through shared memory with a version counter; call "
        "`await collector.update_policy_weights_(policy_or_weights)`"
    ),
    "weight_recv_schemes": "a collector is never a weight receiver in aiocollect; drop the keyword",
    "interruptor": "use MultiSyncCollector(preemptive_threshold=...) for preemption",
    "worker_idx": "worker indices are set by the multi-process collectors; drop the keyword",
    "trajs_per_batch": (
        "batches of whole trajectories are not implemented; use split_trajs=True or "
        "aiocollect.split_trajectories on the batches"
    ),
    "trajs_per_write": "trajs_per_batch is not implemented, so neither is trajs_per_write",
    "traj_format": "trajs_per_batch is not implemented, so neither is traj_format",
    "collector_class": (
        "workers always run aiocollect's rollout; drop collector_class (multi-level collectors are not "
        "implemented)"
    ),
    "backend_options": "Collector does not dispatch; build MultiSyncCollector or MultiAsyncCollector",
    "num_collectors": (
        "Collector does not dispatch to other classes (no metaclass): use "
        "MultiSyncCollector([env_fn] * n, ...) or MultiAsyncCollector([env_fn] * n, ...)"
    ),
    "sync": "Collector does not dispatch: use MultiSyncCollector (sync=True) or MultiAsyncCollector",
}

#: torchrl keywords accepted only with these values (torchrl's default, or what aiocollect always does)
_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "reset_when_done": ((True,), "reset_when_done is deprecated in torchrl and always True"),
    "extend_buffer": ((True,), "the whole batch is extended into the replay buffer; drop extend_buffer"),
    "track_traj_ids": (
        (True,),
        "trajectory ids are always written; drop them with batch.exclude(('collector', 'traj_ids'))",
    ),
    "compact_obs": ((False,), "drop the ('next', obs) keys in a postproc (batch.exclude(...))"),
    "cudagraph_policy": (
        (None, False),
        "wrap the policy in tensordict.nn.CudaGraphModule yourself, or use compile_policy",
    ),
    "auto_register_policy_transforms": (
        (None, False),
        "add the InitTracker / TensorDictPrimer transforms to the env yourself",
    ),
}

#: torchrl keywords that change nothing in aiocollect (any value is accepted)
_IGNORED = frozenset(
    {
        # batches are never reused: each one is a fresh TensorDict, so there is no buffer to share
        "return_same_td",
        # batches are always preallocated
        "use_buffers",
        # the policy is wrapped by type (TensorDictModule / nn.Module / callable), never checked further
        "trust_policy",
        # aiocollect never calls torch.cuda.synchronize()
        "no_cuda_sync",
    }
)


def _check_keywords(kwargs: dict[str, Any], owner: str) -> dict[str, Any]:
    """Drop the ignored keywords, refuse the unsupported ones; the rest go to aiocollect."""
    out = {}
    for name, value in kwargs.items():
        if name in _REFUSED:
            raise TypeError(f"{owner}: torchrl's {name}= is not supported: {_REFUSED[name]}")
        if name in _ONLY:
            allowed, fix = _ONLY[name]
            if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
                raise (ValueError if name == "reset_when_done" else TypeError)(
                    f"{owner}: {name}={value!r} is not supported: {fix}"
                )
            continue
        if name in _IGNORED:
            continue
        out[name] = value
    return out


def _normalise(kwargs: dict[str, Any]) -> dict[str, Any]:
    """torchrl's spellings of "off" (``-1``, ``0``, ``None``) -> aiocollect's."""
    if "total_frames" in kwargs and (kwargs["total_frames"] is None or _negative(kwargs["total_frames"])):
        kwargs["total_frames"] = -1
    for name in ("max_frames_per_traj", "init_random_frames"):
        value = kwargs.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            kwargs[name] = None
    if kwargs.get("split_trajs", False) is None:
        kwargs["split_trajs"] = False
    if kwargs.get("compile_policy", False) is None:
        kwargs["compile_policy"] = False
    version = kwargs.get("track_policy_version", False)
    if not isinstance(version, bool):
        raise TypeError(
            "track_policy_version takes True or False (aiocollect writes ('collector', 'policy_version') "
            f"itself); got {version!r}"
        )
    return kwargs


def _negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0


def _one_device(name: str, value: Any) -> Any:
    """A per-worker device list with one device -> that device (aiocollect takes one per collector)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        distinct = {str(v) for v in value}
        if len(distinct) > 1:
            raise TypeError(
                f"{name}={list(value)!r}: per-worker devices are not supported; give one device for all "
                "workers"
            )
        return value[0] if len(value) else None
    return value


def _with_kwargs(fn: Any, kwargs: Mapping[str, Any] | None) -> Any:
    if not kwargs:
        return fn
    if hasattr(fn, "step") and not isinstance(fn, type):  # an env instance (a class is a constructor)
        raise TypeError("create_env_kwargs needs a callable create_env_fn; an env instance is already built")
    return functools.partial(fn, **kwargs)


def _build(factory: Callable[[], Any]) -> Any:
    return factory()


class _BuiltInWorker:
    """Stands for ``policy_factory()`` in a multi-process collector: unpickling it in a worker builds the
    policy there (the policy itself is never pickled)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory

    def __call__(self, td: TensorDictBase) -> TensorDictBase:  # pragma: no cover - never in the parent
        raise RuntimeError("a policy_factory policy runs in the workers only")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_build, (self.factory,))


class _InitThenCreate:
    """torchrl's ``init_fn``: run first in the worker, then build the env."""

    def __init__(self, init_fn: Callable[[], Any], create_env_fn: Callable[[], Any]) -> None:
        self.init_fn = init_fn
        self.create_env_fn = create_env_fn

    def __call__(self) -> Any:
        self.init_fn()
        return self.create_env_fn()


def _policy_arg(policy: Any, policy_factory: Any, owner: str, *, in_process: bool) -> Any:
    if policy_factory is None:
        return policy
    if policy is not None:
        raise TypeError(
            f"{owner}: policy and policy_factory are mutually exclusive (torchrl's weight_sync_schemes, "
            "which allow both, are not supported)"
        )
    if isinstance(policy_factory, Sequence):
        raise TypeError(f"{owner}: per-worker policy factories are not supported; give one callable")
    if not callable(policy_factory):
        raise TypeError(f"{owner}: policy_factory must be a callable, got {policy_factory!r}")
    return policy_factory() if in_process else _BuiltInWorker(policy_factory)


# -- the collectors --------------------------------------------------------------------------------
class _CompatCollector:
    """torchrl's iterator surface (as coroutines) over one aiocollect collector."""

    _inner: Any
    _needs_entering = True

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

    # -- context and start-up ---------------------------------------------------------------------
    async def __aenter__(self) -> Any:
        await self._inner.__aenter__()
        self._entered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._entered = False
        self._shut = True
        return await self._inner.__aexit__(exc_type, exc, tb)

    async def _ensure_started(self) -> None:
        if self._shut:
            raise RuntimeError(f"{type(self).__name__} was shut down; build a new one")
        if not self._entered and self._needs_entering:
            await self._inner.__aenter__()
            self._entered = self._entered_by_us = True

    async def _stop(self, exc: BaseException | None = None) -> None:
        """Shut down; exits the collector's context if we entered it."""
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

    def __aiter__(self) -> Any:
        return self

    def iterator(self) -> Any:
        """The collector itself (``async for batch in collector.iterator():``)."""
        return self

    async def __anext__(self) -> TensorDictBase | None:
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
            if not isinstance(self._inner, _multi._MultiCollectorBase):
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


class Collector(_CompatCollector):
    """torchrl's ``Collector`` / ``SyncDataCollector`` (one env, in process) -> :class:`aiocollect.Collector`.

    ``create_env_fn`` may be an env, a callable or a one-element list; ``policy_factory`` builds the
    policy here. ``backend=``/``num_collectors=``/``sync=`` dispatch is not implemented: build
    :class:`MultiSyncCollector` or :class:`MultiAsyncCollector`.

    Example:
        >>> import anyio
        >>> from aiocollect import GymEnv
        >>> from aiocollect.compat import SyncDataCollector
        >>> async def main():
        ...     collector = SyncDataCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=32,
        ...                                   total_frames=64)
        ...     async for data in collector:
        ...         print(data.batch_size)
        ...     await collector.shutdown()
        >>> anyio.run(main)
        torch.Size([32])
        torch.Size([32])
    """

    _needs_entering = False

    def __init__(
        self,
        create_env_fn: Any,
        policy: Any = None,
        *,
        policy_factory: Callable[[], Any] | None = None,
        create_env_kwargs: Mapping[str, Any] | None = None,
        post_collect_hook: Callable[[TensorDictBase], Any] | None = None,
        pre_collect_hook: Callable[[], Any] | None = None,
        backend: Any = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        if backend is not None:
            raise TypeError(
                f"{owner}: backend={backend!r} dispatch is not implemented (no metaclass): build "
                "MultiSyncCollector or MultiAsyncCollector (their backend='process'|'serial' picks "
                "processes or threads)"
            )
        if isinstance(create_env_fn, Sequence) and not isinstance(create_env_fn, str):
            if len(create_env_fn) != 1:
                raise TypeError(
                    f"{owner} takes one env; for {len(create_env_fn)} env constructors use "
                    "MultiSyncCollector or MultiAsyncCollector"
                )
            create_env_fn = create_env_fn[0]
        create_env_fn = _with_kwargs(create_env_fn, create_env_kwargs)
        policy = _policy_arg(policy, policy_factory, owner, in_process=True)
        ours = _normalise(_check_keywords(kwargs, owner))
        self._setup(_collector.Collector(create_env_fn, policy, **ours), post_collect_hook, pre_collect_hook)

    @property
    def env(self) -> Any:
        return self._inner.env

    @property
    def policy(self) -> Any:
        return self._inner.policy

    async def getattr_env(self, name: str) -> Any:
        return getattr(self._inner.env, name)

    async def getattr_policy(self, name: str) -> Any:
        return getattr(self._inner.policy, name)


class _CompatMulti(_CompatCollector):
    _cls: type

    def __init__(
        self,
        create_env_fn: Any,
        policy: Any = None,
        *,
        num_workers: int | None = None,
        policy_factory: Callable[[], Any] | None = None,
        create_env_kwargs: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
        init_fn: Callable[[], Any] | None = None,
        post_collect_hook: Callable[[TensorDictBase], Any] | None = None,
        pre_collect_hook: Callable[[], Any] | None = None,
        cat_results: Any = None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        if pre_collect_hook is not None:
            raise TypeError(
                f"{owner}: pre_collect_hook is not supported (torchrl runs it in the workers, before each "
                "rollout); call it in your loop, or put the work in the env factory"
            )
        fns = self._env_fns(create_env_fn, num_workers, owner)
        if create_env_kwargs is not None:
            per_worker = (
                [create_env_kwargs] * len(fns)
                if isinstance(create_env_kwargs, Mapping)
                else list(create_env_kwargs)
            )
            if len(per_worker) != len(fns):
                raise ValueError(
                    f"{owner}: create_env_kwargs has {len(per_worker)} entries for {len(fns)} workers"
                )
            fns = [_with_kwargs(fn, kw) for fn, kw in zip(fns, per_worker, strict=True)]
        if init_fn is not None:
            if not callable(init_fn):
                raise TypeError(f"{owner}: init_fn must be a callable, got {init_fn!r}")
            fns = [_InitThenCreate(init_fn, fn) for fn in fns]
        policy = _policy_arg(policy, policy_factory, owner, in_process=False)
        self._from_factory = isinstance(policy, _BuiltInWorker)
        ours = _normalise(_check_keywords(kwargs, owner))
        for name in ("device", "storing_device", "env_device", "policy_device"):
            if name in ours:
                ours[name] = _one_device(name, ours[name])
        if cat_results is not None:
            ours["cat_results"] = cat_results
        self._setup(self._cls(fns, policy, **ours), post_collect_hook, None)

    @staticmethod
    def _env_fns(create_env_fn: Any, num_workers: int | None, owner: str) -> list[Any]:
        if isinstance(create_env_fn, Sequence) and not isinstance(create_env_fn, str):
            fns = list(create_env_fn)
            if num_workers is not None and num_workers != len(fns):
                raise ValueError(f"{owner}: num_workers={num_workers} but {len(fns)} env constructors")
            return fns
        if num_workers is None:
            raise TypeError(
                f"{owner}: give a list of env constructors (one per worker) or num_workers with one "
                "constructor"
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"{owner}: num_workers must be a positive int, got {num_workers!r}")
        return [create_env_fn] * num_workers

    async def update_policy_weights_(self, policy_or_weights: Any = None, **kwargs: Any) -> int:
        if (
            self._from_factory
            and policy_or_weights is None
            and not any(kwargs.get(k) is not None for k in ("weights", "policy"))
        ):
            raise TypeError(
                "the policy was built by policy_factory in each worker, so the collector has no weights "
                "to publish: pass policy= (an nn.Module) instead of policy_factory to update weights"
            )
        return await super().update_policy_weights_(policy_or_weights, **kwargs)

    async def getattr_env(self, name: str) -> Any:
        """An attribute of worker 0's env."""
        await self._ensure_started()
        return await self._inner.getattr_env(name)

    async def get_distant_attr(self, attr: str) -> list[Any]:
        """The object at ``attr`` (``"env...."`` or ``"policy...."``) in every worker, in worker order."""
        await self._ensure_started()
        return list(await self._inner.get_distant_attr(attr))

    async def map_fn(
        self,
        method_name: str,
        list_of_args: Sequence[Sequence[Any]] | None = None,
        list_of_kwargs: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[Any]:
        """Call the method at ``method_name`` (``"env...."`` or ``"policy...."``) in every worker."""
        await self._ensure_started()
        return list(await self._inner.map_fn(method_name, list_of_args, list_of_kwargs))

    async def getattr_policy(self, name: str) -> Any:
        """An attribute of worker 0's policy."""
        await self._ensure_started()
        return await self._inner.getattr_policy(name)


class MultiSyncCollector(_CompatMulti):
    """torchrl's ``MultiSyncCollector`` (``MultiSyncDataCollector``) on
    :class:`aiocollect.MultiSyncCollector`.

    ``create_env_fn`` is a list (one constructor per worker) or one constructor with ``num_workers``.
    """

    _cls = _multi.MultiSyncCollector


class MultiAsyncCollector(_CompatMulti):
    """torchrl's ``MultiAsyncCollector`` (``MultiaSyncDataCollector``) on
    :class:`aiocollect.MultiAsyncCollector`.

    ``frames_per_batch`` is the size of each batch (one worker's); a per-worker list is refused.
    """

    _cls = _multi.MultiAsyncCollector

    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Any) -> None:
        if kwargs.get("cat_results") not in (None, "stack"):
            raise ValueError("cat_results applies to MultiSyncCollector only")
        kwargs.pop("cat_results", None)
        if "preemptive_threshold" in kwargs:
            raise TypeError("preemptive_threshold applies to MultiSyncCollector only")
        super().__init__(create_env_fn, policy, **kwargs)


class AsyncCollector(MultiAsyncCollector):
    """torchrl's ``AsyncCollector`` / ``aSyncDataCollector``: a :class:`MultiAsyncCollector` with one worker
    process (as :class:`aiocollect.ProcessCollector`)."""

    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Any) -> None:
        if isinstance(create_env_fn, Sequence) and not isinstance(create_env_fn, str):
            if len(create_env_fn) != 1:
                raise TypeError("AsyncCollector takes one env constructor")
        else:
            create_env_fn = [create_env_fn]
        if kwargs.get("num_workers") not in (None, 1):
            raise TypeError("AsyncCollector has one worker; use MultiAsyncCollector for more")
        kwargs.pop("num_workers", None)
        super().__init__(create_env_fn, policy, **kwargs)


def MultiCollector(create_env_fn: Any, policy: Any = None, *, sync: bool, **kwargs: Any) -> _CompatMulti:
    """torchrl's ``MultiCollector(sync=...)``: a plain factory, ``sync`` is required (True or False)."""
    if not isinstance(sync, bool):
        raise TypeError(f"sync must be True or False, got {sync!r}")
    cls = MultiSyncCollector if sync else MultiAsyncCollector
    return cls(create_env_fn, policy, **kwargs)


#: torchrl's names before 0.13
SyncDataCollector = Collector
MultiSyncDataCollector = MultiSyncCollector
MultiaSyncDataCollector = MultiAsyncCollector
aSyncDataCollector = AsyncCollector


def split_trajectories(
    rollout_tensordict: TensorDictBase,
    *,
    prefix: str | None = None,
    trajectory_key: NestedKey | None = None,
    done_key: NestedKey | None = None,
    as_nested: bool = False,
) -> TensorDictBase:
    """torchrl's ``split_trajectories`` signature over :func:`aiocollect.split_trajectories`.

    The mask goes to ``(prefix, "mask")`` (default ``("collector", "mask")``); ids are read at
    ``trajectory_key`` (default ``(prefix, "traj_ids")``). Splitting on done flags (``done_key`` without
    trajectory ids) and nested tensors (``as_nested=True``) are not supported. Unlike torchrl, padded
    trajectory ids are ``-1``, not ``0`` (``0`` is a real id).
    """
    if as_nested:
        raise TypeError("as_nested=True is not supported; the result is zero-padded with a mask")
    prefix = prefix or "collector"
    key = trajectory_key if trajectory_key is not None else (prefix, "traj_ids")
    if done_key is not None and key not in rollout_tensordict.keys(include_nested=True):
        raise TypeError(
            "splitting on done flags (done_key=) without trajectory ids is not supported; aiocollect "
            "batches always carry ('collector', 'traj_ids')"
        )
    return _split_trajectories(rollout_tensordict, trajectory_key=key, mask_key=(prefix, "mask"))


class aenumerate:
    """``enumerate`` for ``async for``: ``async for i, data in aenumerate(collector):``.

    A plain async iterator (not an async generator), so breaking out of the loop leaves nothing to
    finalise.
    """

    def __init__(self, iterable: Any, start: int = 0) -> None:
        self._iterator = aiter(iterable)
        self._count = start

    def __aiter__(self) -> aenumerate:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        item = await anext(self._iterator)
        index, self._count = self._count, self._count + 1
        return index, item
