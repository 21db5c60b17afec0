"""Keep the cyclic garbage collector's full scans off the objects that exist when a collector starts.

An ``AsyncEnvCollector`` with a thousand envs in flight keeps about ten thousand short-lived objects alive at
any moment (each env's pending future, timer and coroutine frames). Every young collection finds them alive
and promotes them, so CPython's full collections come every few seconds, and each one scans every object of
the process: after ``import torch`` about 200,000 of them, 100-150 ms during which the event loop stands still
(measured: 7 full collections, 1.0 s in all, in a 5 s run of ``benchmarks/async_envs.py``; 20% of the time).
``gc.freeze()`` moves the objects alive now (modules, the model, the envs) to the permanent generation that
full collections skip; ``gc.unfreeze()`` gives them back when the last holder is done.

The setting is process-wide, so holders are counted (two collectors running at once freeze once), and a
process that froze by itself before the first holder (``gc.get_freeze_count() > 0``, as aiocollect's worker
processes do) keeps its permanent generation. A ``gc.freeze()`` made by other code while held is seen only
when the permanent generation has grown past its size after our freeze (frozen objects may die meanwhile):
then it is kept too; a smaller one is undone with ours.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["GcHold"]

_lock = threading.Lock()
_holders = 0
_frozen_count: int | None = None  # the permanent generation's size right after our freeze (None: not ours)


class GcHold:
    """One holder of the freeze: :meth:`hold` once, :meth:`release` once (a second call does nothing).

    Example:
        >>> import gc
        >>> hold = GcHold()
        >>> hold.hold()
        >>> gc.get_freeze_count() > 0
        True
        >>> hold.release()
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = False

    def hold(self) -> None:
        global _holders, _frozen_count
        if self._held:
            return
        with _lock:
            if _holders == 0:
                _frozen_count = None
                if gc.isenabled() and gc.get_freeze_count() == 0:
                    gc.freeze()
                    _frozen_count = gc.get_freeze_count()
            _holders += 1
            self._held = True

    def release(self) -> None:
        global _holders, _frozen_count
        if not self._held:
            return
        with _lock:
            self._held = False
            _holders -= 1
            if _holders == 0 and _frozen_count is not None:
                # frozen objects only die (the count falls); more than we froze: somebody froze on top
                if gc.get_freeze_count() <= _frozen_count:
                    gc.unfreeze()
                _frozen_count = None
