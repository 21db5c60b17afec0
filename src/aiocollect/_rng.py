"""A private torch RNG state for a rollout, swapped in around each batch.

Policies sample with torch's global generator; a collector with a seed keeps its own state so that its
batches are reproducible whatever else draws random numbers between batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["RolloutRNG"]

T = TypeVar("T")


class RolloutRNG:
    """``run(fn)`` calls ``fn`` with the collector's own torch RNG state (none: the global one)."""

    def __init__(self, seed: int | None = None) -> None:
        self.state: torch.Tensor | None = None
        if seed is not None:
            self.seed(seed)

    def seed(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()

    def run(self, fn: Callable[[], T]) -> T:
        if self.state is None:
            return fn()
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            return fn()
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)
