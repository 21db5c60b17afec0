"""Exceptions raised by the collectors, and how they cross process and machine boundaries.

One vocabulary whatever the engine: a worker, node or actor that died is a ``WorkerDiedError`` (with
``index``, ``exitcode``/``signal`` where known, and for remote collectors ``engine``, ``rank`` or ``actor``,
the engine's own exception as ``__cause__``); an exception raised remotely keeps its type, or, when it
cannot be rebuilt where it is raised, becomes a ``WorkerError`` carrying its ``type_name``, ``message`` and
``traceback`` text. Every one of them pickles with its fields (:func:`keep_fields_when_pickled`).
"""

from __future__ import annotations

import copyreg
import pickle
import signal as _signal
import traceback as _traceback
from typing import Any

import cloudpickle


class CollectorClosedError(RuntimeError):
    """The collector was closed (by ``aclose()``, by leaving ``async with``, or after a failure)."""


class WorkerTimeoutError(TimeoutError):
    """A worker did not deliver (or answer) within ``worker_timeout`` seconds: a hung env or policy."""


# -- pickling with fields -----------------------------------------------------------------------------
def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _reduce(exc: BaseException) -> tuple[Any, ...]:
    return _rebuild, (type(exc), exc.args, dict(exc.__dict__))


def keep_fields_when_pickled(*classes: type[BaseException]) -> None:
    """Pickle ``classes`` as their ``args`` plus their attributes (``index``, ``exitcode``, notes...),
    without calling ``__init__`` again: an exception whose constructor takes other arguments than its
    message (``WorkerDiedError(index, exitcode)``) otherwise fails to unpickle, or loses its fields."""
    for cls in classes:
        copyreg.pickle(cls, _reduce)


# -- the shared vocabulary ----------------------------------------------------------------------------
class WorkerDiedError(RuntimeError):
    """A worker (or a remote node or actor) ended without reporting an exception (e.g. killed by a signal).

    Attributes: ``index``, ``exitcode`` and ``signal`` where known; for remote collectors ``engine``,
    ``rank``, ``actor`` and ``host`` (``None`` when not applicable)."""

    engine: str | None = None
    rank: int | None = None
    actor: str | None = None
    host: str | None = None

    def __init__(self, index: int, exitcode: int | None) -> None:
        how = f"exit code {exitcode}" if exitcode is not None else "unknown exit code"
        if exitcode is not None and exitcode < 0:
            how += f" (signal {-exitcode})"
        super().__init__(f"worker {index} died ({how})")
        self.index = index
        self.exitcode = exitcode

    @property
    def signal(self) -> int | None:
        """The signal that killed it, if one did."""
        return _signal_of(self.exitcode)


class WorkerError(RuntimeError):
    """A worker raised an exception that could not be sent as itself (it did not pickle, or its class is
    missing here): ``type_name``, ``message`` and ``traceback`` text of the original, where known."""

    type_name: str | None = None
    message: str | None = None
    traceback: str | None = None


def _signal_of(exitcode: int | None) -> int | None:
    return -exitcode if exitcode is not None and exitcode < 0 else None


def _signal_name(number: int) -> str:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


keep_fields_when_pickled(WorkerDiedError, WorkerError)


def worker_died(
    index: int,
    exitcode: int | None = None,
    *,
    member: str = "worker",
    engine: str | None = None,
    rank: int | None = None,
    actor: str | None = None,
    host: str | None = None,
    cause: BaseException | None = None,
) -> WorkerDiedError:
    """A ``WorkerDiedError`` for member ``index`` (a worker, node or actor) with what is known of how it
    ended; ``cause`` (the engine's own exception) becomes its ``__cause__``."""
    where = [f"{engine} rank {rank}" if rank is not None else engine, f"actor {actor}" if actor else None]
    where.append(f"on {host}" if host else None)
    said = ", ".join(w for w in where if w)
    if exitcode is not None:
        how = f"exit code {exitcode}"
        sig = _signal_of(exitcode)
        if sig is not None:
            how = f"killed by {_signal_name(sig)}"
    elif cause is not None:
        how = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
    else:
        how = "unknown exit code"
    err = WorkerDiedError(index, exitcode)
    err.args = (f"{member} {index}{f' ({said})' if said else ''} died ({how})",)
    err.engine, err.rank, err.actor, err.host = engine, rank, actor, host
    err.__cause__ = cause
    return err


def worker_error(type_name: str, message: str, traceback: str, where: str = "") -> WorkerError:
    """A ``WorkerError`` standing for a remote exception that cannot be rebuilt here."""
    err = WorkerError(f"{type_name}: {message}" + (f" (raised in {where})" if where else ""))
    err.type_name, err.message, err.traceback = type_name, message, traceback
    if traceback:
        err.add_note(f"--- remote traceback ---\n{traceback}")
    return err


class RemoteFailure:
    """An exception on its way from a node to the trainer: its pickle (unpickled only by the trainer,
    and only after the connection that carried it was authenticated) and, should that fail there (a class
    the trainer does not have), its type name, message and traceback text."""

    __slots__ = ("message", "payload", "traceback", "type_name", "where")

    def __init__(self, exc: BaseException, where: str) -> None:
        self.type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        self.message = str(exc)
        self.traceback = "".join(_traceback.format_exception(exc))
        self.where = where
        exc.add_note(f"\n--- raised in {where}; remote traceback ---\n{self.traceback}")
        try:
            self.payload: bytes | None = cloudpickle.dumps(exc)
        except Exception:
            self.payload = None

    def __getstate__(self) -> tuple[Any, ...]:
        return self.type_name, self.message, self.traceback, self.where, self.payload

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.type_name, self.message, self.traceback, self.where, self.payload = state

    def error(self) -> BaseException:
        """The exception with its own type, or a ``WorkerError`` with its fields."""
        if self.payload is not None:
            try:
                exc = pickle.loads(self.payload)
            except Exception:
                pass
            else:
                if isinstance(exc, BaseException):
                    return exc
        return worker_error(self.type_name, self.message, self.traceback, self.where)


def as_error(value: Any) -> Any:
    """``value.error()`` for a :class:`RemoteFailure`, ``value`` otherwise."""
    return value.error() if isinstance(value, RemoteFailure) else value


__all__ = [
    "CollectorClosedError",
    "RemoteFailure",
    "WorkerDiedError",
    "WorkerError",
    "WorkerTimeoutError",
    "as_error",
    "keep_fields_when_pickled",
    "worker_died",
    "worker_error",
]
