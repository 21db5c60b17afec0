"""One env's screens stored once per step: ``observation[t + 1]`` *is* ``("next", "observation")[t]``.

The next observation of step ``t`` is the observation of step ``t + 1`` unless the episode ended at ``t``.
So the batch of one env whose observation is a page or more per frame (:data:`CHAIN_MIN_BYTES`: screens,
not state vectors) keeps its frames in one buffer of ``T + 1`` (the *chain*): ``("next", "observation")``
is ``chain[1:]`` and ``"observation"`` is ``chain[:T]``. That is one copy per frame instead of two (11 µs
per 100 KB Atari frame). In a batch where an episode ends before the last step the two differ: from that
step on the observations are written to their own slot (``separate``, allocated with the batch), the
frames before copied there once, and the batch's ``"observation"`` is that slot, as without a chain.

A chained batch's two keys share memory: an in-place write to one shows in the other (docs/conventions.md).
Only the fused loop (``GymEnv._run_gym_steps``) links a chain; the other loops write ``separate``.
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np
import torch

from ._storage import numpy_dtype

__all__ = ["CHAIN_MIN_BYTES", "ObsChain"]

#: observations smaller than this per frame are copied twice as before (their copy costs < 0.5 µs)
CHAIN_MIN_BYTES = 4096


class ObsChain:
    """The chain of a batch of ``steps`` frames (see the module docstring), from the tensors a
    ``StoragePool`` gave for the batch's specs with :meth:`longer` applied.

    Example:
        >>> import numpy as np, torch
        >>> specs = [((3, 2048), torch.float32), ((3, 2048), torch.float32)]  # obs, ("next", "obs")
        >>> taken = [(t, t.numpy()) for t in (torch.zeros(s) for s, _ in ObsChain.longer(specs, 1))]
        >>> chain = ObsChain.over(taken, 1, 0)
        >>> taken[1][0].shape  # ("next", "observation"): the chain's last 3 frames
        torch.Size([3, 2048])
        >>> chain.begin(np.ones(2048), start=0) is None  # linked: the loop writes next observations only
        True
        >>> chain.observation().data_ptr() == chain.tensor.data_ptr()  # "observation": its first 3
        True
    """

    def __init__(self, tensor: torch.Tensor, chain: np.ndarray, separate: np.ndarray) -> None:
        self.tensor = tensor  # [T + 1, *frame]
        self.chain = chain  # its numpy array
        self.separate = separate  # [T, *frame]: "observation" once the chain is split
        self.linked = False

    @staticmethod
    def applies(batch_shape: tuple[int, ...], obs_specs: dict[Any, Any]) -> bool:
        """Whether a batch is chained: one env (no batch dims), one ``"observation"`` entry, a frame of
        :data:`CHAIN_MIN_BYTES` or more."""
        spec = obs_specs.get("observation")
        if batch_shape or len(obs_specs) != 1 or spec is None:
            return False
        if numpy_dtype(spec.dtype) is None:  # the loops write through numpy (not bfloat16, float8)
            return False
        return prod(spec.shape) * spec.dtype.itemsize >= CHAIN_MIN_BYTES

    @staticmethod
    def longer(specs: list[Any], at: int) -> list[Any]:
        """``specs`` with the entry ``at`` (``("next", "observation")``) one frame longer: the chain."""
        (steps, *frame), dtype = specs[at]
        return [*specs[:at], ((steps + 1, *frame), dtype), *specs[at + 1 :]]

    @classmethod
    def over(cls, taken: list[tuple[torch.Tensor, Any]], at: int, obs_at: int) -> ObsChain:
        """The chain of ``taken[at]`` (a tensor and its numpy array, as ``StoragePool.take_arrays`` gives
        them), which becomes its last ``T`` frames (``("next", "observation")``); ``taken[obs_at]``'s
        array is ``separate``."""
        chain = cls(*taken[at], taken[obs_at][1])
        taken[at] = (chain.tensor[1:], chain.chain[1:])
        return chain

    def begin(self, root: Any, start: int) -> np.ndarray | None:
        """The observation slot the fused loop writes from step ``start`` on, where it acts on ``root``:
        ``None`` from step 0 (linked: ``root`` goes to ``chain[0]`` here, and the loop writes the next
        observations only); from a later step (an env restarted mid-batch), ``separate[start:]``."""
        if start == 0:
            self.chain[0] = root
            self.linked = True
            return None
        if self.linked:
            self.split(start)
        return self.separate[start:]

    def split(self, steps: int) -> np.ndarray:
        """An episode ended at step ``steps - 1``: the observations before ``steps`` are copied to
        ``separate``, which the loop writes from then on; returns it."""
        self.separate[:steps] = self.chain[:steps]
        self.linked = False
        return self.separate

    def observation(self) -> torch.Tensor | None:
        """The batch's ``"observation"`` where the chain held to the end (a view of ``chain[:T]``), else
        ``None`` (the batch keeps ``separate``)."""
        return self.tensor[:-1] if self.linked else None
