"""The ``AsyncEnvCollector`` a ``MultiAsyncEnvCollector`` worker process runs (``_worker.py``): it keeps each
delivered batch's episodes, takes its first actions at random (``init_random_frames``), learns its first env
id over all workers once its envs are built (its seeds follow from it, and from its generation when it
replaces a worker that died), and can hold its policy calls."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio

from .._core._restart import derive_seed
from .._observe._events import EventStream
from ._collector import AsyncEnvCollector
from ._envset import EnvSet
from ._policy import BatchPolicy
from ._worker_random import RandomFirst

__all__ = ["InnerCollector"]


class InnerCollector(AsyncEnvCollector):
    """An ``AsyncEnvCollector`` that keeps each delivered batch's episodes, whose first
    ``random_actions`` actions are random (``init_random_frames``), and which learns its first env id
    over all workers from ``place`` once its envs are built (its seeds, and ``random_seed``, are offset
    by it)."""

    episodes: list[tuple[int, float, int]] = []  # noqa: RUF012 - replaced per batch
    random_actions = 0
    random_seed: int | None = None
    #: a replacement's generation (``restart=``): its seeds derived from the first worker's
    generation = 0
    place: Callable[[EnvSet], Awaitable[int]] | None = None
    #: on_env_error="drop" or restart=: the events of the envs dropped or restarted (subscribed before any
    #: env steps), for the parent
    drops: EventStream | None = None

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """No policy call starts while this is open (as in ``pause()``, without waiting for the steps in
        flight: a hung env does not hold it back)."""
        self._paused += 1
        if self._unpaused is None:
            self._unpaused = anyio.Event()
        try:
            yield
        finally:
            self._paused -= 1
            if not self._paused and self._unpaused is not None:
                self._unpaused.set()
                self._unpaused = None

    async def _envs_opened(self, spec: EnvSet) -> None:
        assert self.place is not None
        first = await self.place(spec)
        if self._seed is not None:  # env i of this worker is env first + i of the collector
            self._seed = derive_seed(self._seed + first, self.generation)
        if self.random_seed is not None:
            self.random_seed += first
        if self._drop_failed or self._restart_policy is not None:
            self.drops = self.events(kinds={"worker_failed", "restarted"})

    def _engine_policy(self, policy: BatchPolicy, spec: EnvSet) -> Any:
        if not self.random_actions:
            return policy
        return RandomFirst(policy, spec.action_space, actions=self.random_actions, seed=self.random_seed)

    def _record(
        self,
        frames: int,
        episodes: list[tuple[int, float, int]],
        *,
        worker_id: int | None,
        policy_version: int,
    ) -> None:
        self.episodes = list(episodes)
        super()._record(frames, episodes, worker_id=worker_id, policy_version=policy_version)
