"""An in-process ``Collector``'s env restarts, reported as they happen (``RestartPolicy``).

The rollout thread admits a restart (``EnvRebuilder.on_restart``) and rings a doorbell; a task on the
collector's loop publishes a ``Restarted`` event per record at once, whether or not the batch it came in
ever completes. ``count`` is the number of events published, which is what ``statistics().restarts``
reports: the two agree at every moment.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .._observe._events import EventHub, Restarted
from .._rollout._thread import Doorbell

__all__ = ["RestartReport"]


class RestartReport:
    """The ``Restarted`` events of ``rebuilder``'s env restarts (``None``: no restart policy), on ``hub``."""

    def __init__(self, hub: EventHub, rebuilder: Any) -> None:
        self._hub, self._rebuilder = hub, rebuilder
        self.count = 0
        self._bell = Doorbell()
        self._pending: deque[Any] = deque()  # admitted in the rollout thread, not published yet
        if rebuilder is not None:
            rebuilder.on_restart = self._admitted

    def _admitted(self, record: Any) -> None:
        """In the rollout thread: never waits for the loop."""
        self._pending.append(record)
        self._bell.ring()

    def publish(self) -> None:
        """Publish the restarts admitted and not reported yet (on the loop)."""
        while self._pending:
            self.count += 1
            self._hub.publish(Restarted.of(0, self._pending.popleft()))

    async def run(self) -> None:
        """Publish each restart as the rollout thread admits it, until cancelled (in the task group)."""
        if self._rebuilder is None:
            return
        while True:
            await self._bell.wait()
            self.publish()

    def close(self) -> None:
        self._bell.close()
