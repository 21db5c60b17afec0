"""A private torch RNG state for a rollout, swapped in around each batch.

Policies sample with torch's global generator; a collector with a seed keeps its own state so that its
batches are reproducible whatever else draws random numbers between batches. torch's generator is one per
process: the swap, the batch and the swap back run under :data:`TORCH_RNG_LOCK`, so seeded collectors in
one process (in-process collectors, serial workers) take turns, and each draws only from its own state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["TORCH_RNG_LOCK", "RolloutRNG", "forked_rng"]

T = TypeVar("T")

#: held while a seeded batch runs with its own state swapped in (re-entrant: a batch may fork the RNG)
TORCH_RNG_LOCK = threading.RLock()


class RolloutRNG:
    """``run(fn)`` calls ``fn`` with the collector's own torch RNG state (none: the global one).

    Example:
        >>> import torch
        >>> rng = RolloutRNG(seed=0)
        >>> a = rng.run(lambda: torch.rand(2))
        >>> torch.equal(a, RolloutRNG(seed=0).run(lambda: torch.rand(2)))
        True
    """

    def __init__(self, seed: int | None = None) -> None:
        self.state: torch.Tensor | None = None
        if seed is not None:
            self.seed(seed)

    def seed(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()

    def run(self, fn: Callable[[], T]) -> T:
        if self.state is None:
            return fn()
        with TORCH_RNG_LOCK:
            outer = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                return fn()
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(outer)


@contextlib.contextmanager
def forked_rng() -> Iterator[None]:
    """``torch.random.fork_rng`` (CPU) under :data:`TORCH_RNG_LOCK`: a dry call that draws numbers and puts
    the state back must not replay a seeded batch's draws made meanwhile in another thread."""
    with TORCH_RNG_LOCK, torch.random.fork_rng(devices=[]):
        yield
