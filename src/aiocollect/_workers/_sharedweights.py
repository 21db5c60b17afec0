"""Weights in shared memory with a version counter (a seqlock): publish in the parent, load in workers.

The parent writes the weights and bumps the counter (odd while writing); a worker compares the published
version with the one it runs at each batch boundary and copies the new weights into its own policy, never
mid-step. Workers never alias the trainer's tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from .._weights import copy_weights, module_weights
from ._shm import Layout, SharedBlock, layout_of


def flat_weights(module: torch.nn.Module) -> TensorDictBase:
    return module_weights(module).flatten_keys(".")


class SharedWeights:
    """Parent side: create with the policy's layout, ``publish`` new weights."""

    def __init__(self, weights: TensorDictBase) -> None:
        flat = weights.flatten_keys(".")
        self.layout: Layout = layout_of(flat)
        self.block = SharedBlock(self.layout, ())
        self.seq = SharedBlock([("seq", (1,), torch.int64)], ())
        self.seq.td["seq"].zero_()
        copy_weights(self.block.td, flat)

    @property
    def version(self) -> int:
        return int(self.seq.td["seq"][0]) // 2

    def publish(self, weights: TensorDictBase) -> int:
        """Copy ``weights`` in (blocking; run it off the loop for big models) and bump the version."""
        seq = self.seq.td["seq"]
        start = int(seq[0])
        seq.fill_(start + 1)
        try:
            copy_weights(self.block.td, weights.flatten_keys("."))
        finally:
            seq.fill_(start + 2)
        return (start + 2) // 2

    def names(self) -> tuple[str, str, Layout]:
        return self.block.name, self.seq.name, self.layout

    def unlink(self) -> None:
        for block in (self.block, self.seq):
            block.unlink()
            block.close()


class WeightsReader:
    """Worker side: ``load_into(policy)`` copies newer weights, returns the version now running."""

    def __init__(self, block_name: str, seq_name: str, layout: Layout) -> None:
        self.block = SharedBlock(layout, (), name=block_name)
        self.seq = SharedBlock([("seq", (1,), torch.int64)], (), name=seq_name)
        self._seq = self.seq.td["seq"].numpy()

    @property
    def published(self) -> int:
        return int(self._seq[0]) // 2

    def load_into(self, policy: Any, current: int) -> int:
        for _ in range(1000):
            start = int(self._seq[0])
            if start % 2 or start // 2 == current:
                if start % 2 == 0:
                    return current
                continue  # being written: retry
            copy_weights(flat_weights(policy), self.block.td)
            if int(self._seq[0]) == start:
                return start // 2
        return current

    def close(self) -> None:
        self.block.close()
        self.seq.close()
