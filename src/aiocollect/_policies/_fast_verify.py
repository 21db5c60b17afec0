"""The fast path's check (``_fast_policy``): two runners' outputs compared bit for bit, from the same RNG
state and with the policy's buffers put back after a dry call."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._core._rng import TORCH_RNG_LOCK
from .._envs._spaces import NestedKey

__all__ = ["BufferSnapshot", "rng_devices", "same_outputs", "verify_fast_runner"]

Runner = Callable[[Mapping[NestedKey, Tensor]], dict[NestedKey, Tensor]]


def _bits_equal(a: Any, b: Any) -> bool:
    if type(a) is not Tensor or type(b) is not Tensor:
        return False
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    # NaNs (and -0.0 vs 0.0) compare by their bits
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
    size = a.element_size()
    a, b = a.contiguous(), b.contiguous()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
        size //= 2
    return torch.equal(a.view(bits[size]), b.view(bits[size]))


def same_outputs(fast: Mapping[NestedKey, Any], slow: Mapping[NestedKey, Any]) -> bool:
    """Same keys in the same order, each value a tensor with the same dtype, shape, device and bits."""
    if list(fast) != list(slow):
        return False
    return all(_bits_equal(fast[k], slow[k]) for k in slow)


def rng_devices() -> list[int]:
    """The CUDA devices whose RNG a dry call forks (none unless CUDA is in use)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


class BufferSnapshot:
    """The policy's buffers (running statistics...) before a dry call, to put back after it."""

    def __init__(self, policy: Any) -> None:
        module = policy if isinstance(policy, torch.nn.Module) else None
        self._saved = [(b, b.clone()) for b in module.buffers()] if module is not None else []

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self._saved:
                buffer.copy_(saved)


def verify_fast_runner(fast: Runner, slow: Runner, obs: Mapping[NestedKey, Tensor]) -> bool:
    """Whether ``fast(obs)`` and ``slow(obs)`` are bit-identical from the same RNG state.

    A dry run: the torch RNG (forked) and the policy's buffers are left as they were. An exception in
    the fast runner counts as a mismatch; one in the slow runner propagates.
    """
    policy = getattr(fast, "policy", None)
    snapshot = BufferSnapshot(policy)
    with TORCH_RNG_LOCK.shared(), torch.random.fork_rng(devices=rng_devices()):
        state = torch.get_rng_state()
        try:
            fast_out = fast(obs)
        except Exception:
            fast_out = None
        snapshot.restore()
        torch.set_rng_state(state)
        try:
            slow_out = slow(obs)
        finally:
            snapshot.restore()
    return fast_out is not None and same_outputs(fast_out, slow_out)
