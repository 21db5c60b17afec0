"""torchrl's collector classes (and their names before 0.13) on aiocollect's collectors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tensordict import TensorDictBase

from .._local._collector import Collector as NativeCollector
from .._multi import MultiAsyncCollector as NativeMultiAsync
from .._multi import MultiSyncCollector as NativeMultiSync
from ._core import CompatCollector
from ._keywords import (
    BuiltInWorker,
    InitThenCreate,
    check_keywords,
    normalise,
    one_device,
    policy_arg,
    torchrl_rollout,
    with_kwargs,
)

__all__ = [
    "AsyncCollector",
    "Collector",
    "CompatMulti",
    "MultiAsyncCollector",
    "MultiCollector",
    "MultiSyncCollector",
    "MultiSyncDataCollector",
    "MultiaSyncDataCollector",
    "SyncDataCollector",
    "aSyncDataCollector",
]


class Collector(CompatCollector):
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
                "MultiSyncCollector or MultiAsyncCollector (their worker_backend='process'|'serial' picks "
                "processes or threads)"
            )
        if isinstance(create_env_fn, Sequence) and not isinstance(create_env_fn, str):
            if len(create_env_fn) != 1:
                raise TypeError(
                    f"{owner} takes one env; for {len(create_env_fn)} env constructors use "
                    "MultiSyncCollector or MultiAsyncCollector"
                )
            create_env_fn = create_env_fn[0]
        create_env_fn = with_kwargs(create_env_fn, create_env_kwargs)
        policy = policy_arg(policy, policy_factory, owner, in_process=True)
        ours = torchrl_rollout(normalise(check_keywords(kwargs, owner)))
        self._setup(NativeCollector(create_env_fn, policy, **ours), post_collect_hook, pre_collect_hook)

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


class CompatMulti(CompatCollector):
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
            fns = [with_kwargs(fn, kw) for fn, kw in zip(fns, per_worker, strict=True)]
        if init_fn is not None:
            if not callable(init_fn):
                raise TypeError(f"{owner}: init_fn must be a callable, got {init_fn!r}")
            fns = [InitThenCreate(init_fn, fn) for fn in fns]
        policy = policy_arg(policy, policy_factory, owner, in_process=False)
        self._from_factory = isinstance(policy, BuiltInWorker)
        ours = normalise(check_keywords(kwargs, owner))
        for name in ("device", "storing_device", "env_device", "policy_device"):
            if name in ours:
                ours[name] = one_device(name, ours[name])
        ours = torchrl_rollout(ours)
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


class MultiSyncCollector(CompatMulti):
    """torchrl's ``MultiSyncCollector`` (``MultiSyncDataCollector``) on
    :class:`aiocollect.MultiSyncCollector`.

    ``create_env_fn`` is a list (one constructor per worker) or one constructor with ``num_workers``.
    """

    _cls = NativeMultiSync


class MultiAsyncCollector(CompatMulti):
    """torchrl's ``MultiAsyncCollector`` (``MultiaSyncDataCollector``) on
    :class:`aiocollect.MultiAsyncCollector`.

    ``frames_per_batch`` is the size of each batch (one worker's); a list gives worker ``i`` batches of
    ``frames_per_batch[i]`` frames (torchrl's documented meaning of a per-worker sequence).
    """

    _cls = NativeMultiAsync

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


def MultiCollector(create_env_fn: Any, policy: Any = None, *, sync: bool, **kwargs: Any) -> CompatMulti:
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
