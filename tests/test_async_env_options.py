"""``AsyncEnvOptions`` (``_asyncenv/_options.py``): both async-env collectors' keywords checked once into one
frozen object, which reaches ``MultiAsyncEnvCollector``'s workers as it is; a worker's view
(``for_member``) is derived from it, never checked again."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

import pytest

import aiocollect._asyncenv._options as options_module
from aiocollect import AsyncEnvCollector, MultiAsyncEnvCollector
from aiocollect._asyncenv._options import AsyncEnvOptions


class Ping:  # never built: the constructors check their keywords before any env is
    pass


def multi(**given: Any) -> AsyncEnvOptions:
    return AsyncEnvOptions.of("MultiAsyncEnvCollector", [4, 4], **{"frames_per_batch": [8, 12], **given})


def test_a_workers_view_is_derived_from_the_collectors_options() -> None:
    options = multi(init_random_frames=30, total_frames=96, split_trajs=True, seed=3, min_batch=2)
    assert options.per_worker == (8, 12) and options.frames_per_batch == 12
    first, second = options.for_member(0), options.for_member(1)
    assert (first.frames_per_batch, second.frames_per_batch) == (8, 12)
    # each worker's share of the random frames, ceil(30 / 2) = 15, rounded up to whole batches of its own
    assert (first.random_frames, second.random_frames) == (16, 24)
    assert (first.member, second.member) == (0, 1)
    # a worker tracks every frame's version (the trainer's floors), runs endless, sends frames only
    assert first.track_policy_version and first.total_frames == -1 and not first.split_trajs
    assert (first.seed, first.min_batch, first.prefetch) == (3, 2, 1)  # the rest as the collector's
    assert options.for_member(1, generation=2).random_frames == 0  # a replacement's: its predecessor's
    with pytest.raises(FrozenInstanceError):
        first.frames_per_batch = 1  # type: ignore[misc]


def test_a_workers_view_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks ran once, in ``of``: deriving a view calls none of them."""
    options = multi(init_random_frames=8, max_wait=0.01)

    def checked_again(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"checked again: {args}")

    for name in dir(options_module):
        if name.endswith("_arg") or name in ("positive_int", "optional_positive_int", "non_negative_int"):
            monkeypatch.setattr(options_module, name, checked_again)
    assert options.for_member(1).frames_per_batch == 12


def test_on_policy_options_hold_the_workers_and_prefetch_nothing() -> None:
    options = multi(max_policy_lag=0)
    assert options.pause_when_held and options.prefetch == 0
    assert not multi(max_policy_lag=1).pause_when_held and multi(max_policy_lag=1).prefetch == 1


def test_each_collector_checks_frames_per_batch_in_its_own_terms() -> None:
    with pytest.raises(TypeError, match="frames_per_batch must be a positive int, got \\[8\\]"):
        AsyncEnvCollector([Ping], frames_per_batch=[8])  # one collector, one size
    with pytest.raises(ValueError, match="frames_per_batch has 1 values for 2 workers"):
        MultiAsyncEnvCollector([[Ping], [Ping]], frames_per_batch=[8])
    with pytest.raises(ValueError, match="frames_per_batch\\[1\\] must be a positive int, got 0"):
        MultiAsyncEnvCollector([[Ping], [Ping]], frames_per_batch=[8, 0])
    with pytest.raises(ValueError, match="max_wait must be >= 0"):
        MultiAsyncEnvCollector([[Ping]], frames_per_batch=8, max_wait=-1)


def test_the_budget_is_whole_batches_and_warns_when_cut() -> None:
    with pytest.warns(UserWarning, match="total_frames=100 is not a multiple of frames_per_batch=64"):
        options = AsyncEnvOptions.of("AsyncEnvCollector", [8], frames_per_batch=64, total_frames=100)
    assert options.target() == 128
    assert AsyncEnvOptions.of("AsyncEnvCollector", [8], frames_per_batch=8).target() == -1  # endless
    assert options.min_batch_of(8) == 4 and options.min_batch_of(1) == 1
