"""One error vocabulary: every aiocollect exception pickles with its fields (it crosses processes and
machines); a remote exception keeps its type, or becomes a WorkerError with its type name, message and
traceback text."""

from __future__ import annotations

import pickle
import signal
from pathlib import Path

import cloudpickle
import pytest

import aiocollect
from aiocollect import (
    CheckpointError,
    CollectorClosedError,
    RemoteConnectionError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from aiocollect._core._errors import RemoteFailure, worker_died, worker_error


def _examples() -> dict[type, BaseException]:
    return {
        CollectorClosedError: CollectorClosedError("the collector is closed: done"),
        WorkerTimeoutError: WorkerTimeoutError("worker 1 did not deliver within worker_timeout=5 s"),
        WorkerDiedError: WorkerDiedError(3, -9),
        WorkerError: worker_error("mymod.Boom", "it broke", "Traceback ...\nmymod.Boom: it broke\n"),
        RemoteConnectionError: RemoteConnectionError(
            "the env server at ws://127.0.0.1:1 closed the connection"
        ),
        CheckpointError: CheckpointError("'ckpt.pt' is not a whole checkpoint", Path("ckpt.pt"), 27113),
    }


def test_every_exported_exception_has_a_round_trip_case():
    exported = {
        obj
        for name in aiocollect.__all__
        if isinstance(obj := getattr(aiocollect, name), type) and issubclass(obj, BaseException)
    }
    assert exported == set(_examples())


@pytest.mark.parametrize("cls", list(_examples()), ids=lambda c: c.__name__)
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_exceptions_pickle_round_trip_with_their_fields(cls, dumps):
    exc = _examples()[cls]
    exc.add_note("a note")
    clone = pickle.loads(dumps(exc))
    assert type(clone) is cls
    assert str(clone) == str(exc)
    assert clone.__notes__[-1] == "a note"
    assert vars(clone) == vars(exc)  # index, exitcode, type_name, ..., the notes


def test_worker_died_error_keeps_index_exitcode_and_signal():
    clone = pickle.loads(pickle.dumps(WorkerDiedError(2, -signal.SIGKILL)))
    assert (clone.index, clone.exitcode, clone.signal) == (2, -9, 9)
    assert clone.engine is None and clone.rank is None and clone.actor is None
    assert "worker 2 died" in str(clone)


def test_a_dead_node_names_engine_rank_signal_and_cause():
    cause = RuntimeError("eof")
    err = worker_died(1, -15, member="node", engine="torch.distributed.rpc", rank=2, host="h", cause=cause)
    assert isinstance(err, WorkerDiedError)
    assert str(err) == "node 1 (torch.distributed.rpc rank 2, on h) died (killed by SIGTERM)"
    assert (err.index, err.exitcode, err.signal, err.engine, err.rank, err.host) == (
        1,
        -15,
        15,
        "torch.distributed.rpc",
        2,
        "h",
    )
    assert err.__cause__ is cause
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.engine, clone.rank, clone.signal, str(clone)) == (err.engine, 2, 15, str(err))


def test_a_dead_actor_without_exit_code_says_what_the_engine_said():
    err = worker_died(0, member="actor", engine="ray", actor="ab12", cause=RuntimeError("actor died\nmore"))
    assert str(err) == "actor 0 (ray, actor ab12) died (RuntimeError: actor died)"
    assert err.signal is None and err.actor == "ab12"


class _Local(Exception):
    """Stands for a class the trainer does not have."""


def test_remote_failure_keeps_the_type_when_it_unpickles():
    try:
        raise FloatingPointError("the env exploded")
    except FloatingPointError as exc:
        failure = RemoteFailure(exc, "node 1 (host, pid 1)")
    error = pickle.loads(pickle.dumps(failure)).error()
    assert type(error) is FloatingPointError
    assert "raised in node 1" in "".join(error.__notes__)


def test_remote_failure_becomes_a_worker_error_when_it_does_not_unpickle():
    try:
        raise _Local("from a module the trainer lacks")
    except _Local as exc:
        failure = RemoteFailure(exc, "node 0")
        failure.payload = pickle.dumps(exc).replace(b"_Local", b"_Lost_")  # its class is gone here
    error = pickle.loads(pickle.dumps(failure)).error()
    assert type(error) is WorkerError
    assert error.type_name.endswith("test_errors._Local")
    assert error.message == "from a module the trainer lacks"
    assert "raise _Local" in error.traceback
    assert "raised in node 0" in str(error)
