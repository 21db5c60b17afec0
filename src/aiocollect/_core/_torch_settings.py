"""torch's per-thread settings, copied from the thread that enters a collector into the threads it runs
torch in.

``torch.set_num_threads(1)`` applies to the calling thread only (OpenMP and MKL keep their settings per
thread), and so do flush-denormal and grad mode. A rollout thread that does not copy them runs with torch's
defaults: an OpenMP team over every core for each vectorised op, whose spin-waits burn the other core (a
trainer's, another worker's) and stall when it is busy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TorchSettings"]

# the smallest positive float32 subnormal, as a tensor: multiplying it by one gives zero when the thread
# flushes denormals (there is no getter for torch.set_flush_denormal)
_SUBNORMAL = 1e-45


def _flushes_denormals() -> bool:
    value = torch.tensor([_SUBNORMAL], dtype=torch.float32)
    return bool((value * 1.0).item() == 0.0)


@dataclass(frozen=True)
class TorchSettings:
    """The torch settings of one thread; :meth:`capture` reads the calling thread's, :meth:`apply` sets them
    in the calling thread.

    Example:
        >>> import threading, torch
        >>> settings = TorchSettings.capture()
        >>> seen = []
        >>> def worker():
        ...     settings.apply()
        ...     seen.append(torch.get_num_threads())
        >>> t = threading.Thread(target=worker); t.start(); t.join()
        >>> seen == [torch.get_num_threads()]
        True
    """

    num_threads: int
    flush_denormal: bool
    default_dtype: torch.dtype
    grad_enabled: bool

    @classmethod
    def capture(cls) -> TorchSettings:
        return cls(
            num_threads=torch.get_num_threads(),
            flush_denormal=_flushes_denormals(),
            default_dtype=torch.get_default_dtype(),
            grad_enabled=torch.is_grad_enabled(),
        )

    def apply(self) -> None:
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        torch.set_flush_denormal(self.flush_denormal)
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
