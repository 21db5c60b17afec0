"""``RayCollector``: each remote collector is a Ray actor running one of our collectors; the trainer awaits
their batches as Ray object refs and merges them on its own event loop.

What crosses the network: the env constructors and the policy once (``cloudpickle``, put in the object
store once and fetched by every actor), one pickled batch per delivered batch (actor -> trainer), and the
weights once per update (``ray.put`` once; each targeted actor fetches the same object with its next
request, or at once with ``update_weights(wait=True)``). Everything else is small control calls.

Ray is imported when a ``RayCollector`` is entered, never by ``import aiocollect``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Unpack, cast

from .._core._mistakes import explicit_keywords
from .._core._validation import flag, positive_int, total_frames_arg
from .._fleet._collector import FleetCollector
from .._fleet._transport import FleetSetup
from .._local._collector import Collector
from .._multi._async import MultiAsyncCollector, ProcessCollector
from .._multi._sync import MultiSyncCollector
from ._args import (
    check_keywords,
    check_policy,
    collector_kwargs_arg,
    member_rollouts,
    payloads,
    per_member,
    seconds_or_none,
    split_frames,
    weight_plan,
    with_restart,
)
from ._keywords import RayKeywords
from ._ray_fleet import DEFAULT_REMOTE_CONFIG, ActorPlan, RayActors
from ._ray_replace import ActorRespawn


def _env_args(create_env_fn: Any, n: int, collector_class: type) -> list[Any]:
    """Each actor's env argument: a constructor, or (a multi-process collector class) a list of them,
    one per worker."""
    multi = issubclass(collector_class, (MultiSyncCollector, MultiAsyncCollector)) and not issubclass(
        collector_class, ProcessCollector
    )
    if callable(create_env_fn) and not isinstance(create_env_fn, Sequence):
        env_fns = [create_env_fn] * n
    else:
        env_fns = per_member("create_env_fn", create_env_fn, n, (), "actor")
    for i, fn in enumerate(env_fns):
        if multi:
            if callable(fn) and not isinstance(fn, Sequence):
                env_fns[i] = [fn]
            elif not (isinstance(fn, Sequence) and fn and all(callable(f) for f in fn)):
                raise TypeError(
                    f"create_env_fn[{i}] must be an env constructor or a list of them (the actor's "
                    f"{collector_class.__name__} workers), got {fn!r}"
                )
        elif not callable(fn):
            raise TypeError(f"create_env_fn[{i}] must be a callable returning an env, got {fn!r}")
    return env_fns


_COLLECTOR_CLASSES = (Collector, MultiSyncCollector, MultiAsyncCollector)


class RayCollector(FleetCollector):
    """Collect with ``num_collectors`` Ray actors, each running one of our collectors.

    ``async with RayCollector(...) as c: async for batch in c:`` as with every collector. Entering starts
    a local Ray cluster (or connects to ``ray_init_config["address"]``; or uses the one ``ray.init`` made
    already), starts the actors and waits until each one's collector runs; leaving closes every remote
    collector (its worker processes are reaped), kills every actor (``ray.kill``) and shuts down the
    cluster only if this collector started it.

    Args:
        create_env_fn: an env constructor for every actor, or a list of ``num_collectors``, one per actor.
            With a multi-process ``collector_class``, an actor's entry is the list of its workers' env
            constructors (a single constructor means one worker). They and the policy are pickled with
            ``cloudpickle``: functions and classes are pickled by reference, so their modules must be
            importable on the Ray nodes (``runtime_env={"py_modules": [...]}`` in ``remote_config`` or
            ``ray_init_config``), unless registered with ``cloudpickle.register_pickle_by_value``.
        policy: as for :class:`Collector` (an ``nn.Module``, a ``TensorDictModule``, a callable or None).
        frames_per_batch: frames per delivered batch. ``sync=True``: split evenly over the actors (each
            collects ``ceil(frames_per_batch / num_collectors)``); ``sync=False``: each actor's batch.
        total_frames: frames to deliver before ``async for`` ends; ``-1`` for endless.
        num_collectors: how many actors.
        collector_class: what each actor runs: :class:`Collector` (default), :class:`MultiSyncCollector`
            or :class:`MultiAsyncCollector` (worker processes inside the actor), or
            :class:`ProcessCollector`.
        collector_kwargs: keyword arguments of ``collector_class``, one dict for all or a list, one per
            actor. A ``seed`` in a shared dict seeds actor ``i`` after actor ``i - 1`` (distinct seeds,
            as :meth:`set_seed`); an ``init_random_frames`` in a shared dict is split over the actors.
        remote_config: Ray actor options (``num_cpus``, ``num_gpus``, ``memory``, ``resources``,
            ``runtime_env``, ``scheduling_strategy``...), one dict or one per actor; default
            ``{"num_cpus": 1}``.
        ray_init_config: ``ray.init`` arguments when Ray is not initialised yet; with ``"address"`` it
            connects to that cluster, otherwise it starts a local one (``address="local"``).
        sync: ``True``: every batch stacks one batch of each actor (``[num_collectors, ...]``), asked
            for together; ``False``: each actor's batch as it arrives, with ``("collector",
            "worker_id")``, while the actor collects its next one.
        update_at_each_batch: send the trainer's current weights before every request: to the actor
            that delivered (``sync=False``, its next batch is asked for when ``async for`` asks for the
            next batch, after the training step) or to all actors (``sync=True``).
            ``update_after_each_batch`` is its deprecated spelling.
        max_weight_update_interval: an actor that delivered this many batches without receiving
            weights is sent the trainer's current weights before its next batch (``None``: never; ``0``
            and ``-1`` are deprecated spellings of it).
        weights: a :class:`~aiocollect.WeightSchedule` instead of the two keywords above.
        replay_buffer: batches go there (``extend`` runs in a worker thread) and ``async for`` yields
            ``None``; :meth:`start` collects into it in the background.
        progress_timeout: seconds an actor may take to deliver one batch (default 600: generous, so that
            a hung env or policy is noticed without any setting); then the collector fails with
            ``WorkerTimeoutError`` naming the actor, which is killed at once. ``None``: no limit.
        progress: as for :class:`Collector`.
        restart: a :class:`~aiocollect.RestartPolicy`: an actor that dies (killed, its node lost) or
            misses ``progress_timeout`` is replaced by a new actor (a derived seed, fresh trajectory
            ids, the newest weights loaded before its first batch), at most ``max_restarts`` times
            within ``window`` seconds per actor; each actor's collector restarts its envs under the
            same policy (unless ``collector_kwargs`` gives it a ``restart`` of its own). See
            docs/faults.md.

    Example:
        >>> import anyio
        >>> from aiocollect import GymEnv, RayCollector
        >>> async def main():  # doctest: +SKIP
        ...     async with RayCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=256,
        ...                             total_frames=1024, num_collectors=2) as c:
        ...         async for batch in c:
        ...             print(batch.batch_size, batch["collector", "worker_id"][0].item())
        >>> anyio.run(main)  # doctest: +SKIP
    """

    _member_noun = "actor"

    @explicit_keywords(keywords=RayKeywords)
    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Unpack[RayKeywords]) -> None:
        n = self.num_collectors = positive_int("num_collectors", kwargs["num_collectors"])
        sync, collector_kwargs = flag("sync", kwargs["sync"]), kwargs["collector_kwargs"]
        collector_class = kwargs["collector_class"]
        if not isinstance(collector_class, type) or not issubclass(collector_class, _COLLECTOR_CLASSES):
            raise TypeError(
                "collector_class must be Collector, MultiSyncCollector, MultiAsyncCollector or "
                f"ProcessCollector, got {collector_class!r}"
            )
        self._collector_class = collector_class
        policy = check_policy(policy)
        weights = weight_plan(policy, kwargs)
        env_args = _env_args(create_env_fn, n, collector_class)
        kwargs_list, seed = collector_kwargs_arg(
            collector_kwargs, n, "RayCollector", "actor", list_seeds=True
        )
        if (collector_kwargs is None or isinstance(collector_kwargs, Mapping)) and kwargs_list[0].get(
            "init_random_frames"
        ):  # a shared budget of random frames: split over the actors
            share = math.ceil(int(kwargs_list[0]["init_random_frames"]) / n)
            kwargs_list = [{**kw, "init_random_frames": share} for kw in kwargs_list]
        remote_list = per_member("remote_config", kwargs["remote_config"] or {}, n, Mapping, "actor")
        ray_init_config = kwargs["ray_init_config"]
        if ray_init_config is not None and not isinstance(ray_init_config, Mapping):
            raise TypeError(f"ray_init_config must be a dict of ray.init arguments, got {ray_init_config!r}")
        per_actor_fpb = split_frames(kwargs["frames_per_batch"], n, sync, "actor", stacklevel=3)
        kwargs_list = with_restart(kwargs_list, kwargs["restart"])
        # pickled here (small: a bad one fails now); the policy once, in a thread, when entered
        check_keywords(collector_class, kwargs_list)
        rollouts = member_rollouts(kwargs_list, per_actor_fpb)  # checked here, sent typed (and taken out)
        actors = ActorPlan(
            sync=sync,
            payloads=payloads(env_args, collector_class, kwargs_list, "actor"),
            rollouts=rollouts,
            remote_configs=[{**DEFAULT_REMOTE_CONFIG, **dict(rc)} for rc in remote_list],
            ray_init_config=dict(ray_init_config) if ray_init_config is not None else None,
            weights=weights,
            progress_timeout=seconds_or_none("progress_timeout", kwargs["progress_timeout"]),
            restart=kwargs["restart"],
        )
        setup = FleetSetup(
            size=n,
            sync=sync,
            total_frames=total_frames_arg(kwargs["total_frames"]),
            frames_per_batch=per_actor_fpb * n if sync else per_actor_fpb,
            policy=policy,
            weights_template=weights.template,
            seed=seed,
            replay_buffer=kwargs["replay_buffer"],
            progress=kwargs["progress"],
            restart=kwargs["restart"],
        )
        self._init_fleet(setup, partial(RayActors, plan=actors, replacing=ActorRespawn))

    # -- introspection ----------------------------------------------------------------------------
    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles (while the collector is entered)."""
        return [a.handle for a in cast("RayActors", self._transport).actors]

    def actor_info(self) -> list[dict[str, Any]]:
        """Where each actor runs: ``pid``, ``node_id``, ``hostname`` and its ``frames_per_batch``."""
        return [dict(a.info) for a in cast("RayActors", self._transport).actors]

    def __repr__(self) -> str:
        return (
            f"RayCollector(num_collectors={self.num_collectors}, collector_class="
            f"{self._collector_class.__name__}, frames_per_batch={self.frames_per_batch}, "
            f"total_frames={self.total_frames}, sync={self._sync}, closed={self._closed})"
        )


__all__ = ["RayCollector"]
