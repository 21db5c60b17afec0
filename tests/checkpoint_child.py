"""A process that writes checkpoints and is killed in the middle of one (``test_checkpoint_files.py``).

``python checkpoint_child.py MODE PATH``: writes a first checkpoint (``{"step": 1, ...}``) and prints
``saved 1``; then writes a second, 64 MB one, and once 8 MB of it are written prints ``writing BYTES`` and
waits (the parent SIGKILLs it then). ``MODE``: ``atomic`` (``aiocollect.save_checkpoint``) or ``plain``
(``torch.save(state, PATH)``, the final path written in place).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from aiocollect import save_checkpoint

STALL_AT = 8 * 2**20


class Stalling:
    """A file that, once ``STALL_AT`` bytes went through it, flushes them, says so and waits for ever."""

    def __init__(self, f: Any) -> None:
        self._f, self._written = f, 0

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self._written += n
        if self._written >= STALL_AT:
            self._f.flush()
            os.fsync(self._f.fileno())  # the bytes are in the file: a kill leaves them there
            print(f"writing {self._written}", flush=True)
            sys.stdin.readline()  # never answered: killed here
        return n

    def __enter__(self) -> Stalling:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def main(mode: str, path: str) -> None:
    first = {"step": 1, "weights": torch.arange(10.0)}
    save = save_checkpoint if mode == "atomic" else torch.save
    save(first, path)
    print("saved 1", flush=True)
    if mode == "atomic":  # the temporary file save_checkpoint writes through
        fdopen = os.fdopen
        os.fdopen = lambda *a, **k: Stalling(fdopen(*a, **k))  # type: ignore[assignment]
        save_checkpoint({"step": 2, "weights": torch.ones(16 * 2**20)}, path)
    else:  # the final path written in place, as torch.save(state, "ckpt.pt") writes it
        with Stalling(open(path, "wb")) as f:
            torch.save({"step": 2, "weights": torch.ones(16 * 2**20)}, f)
    print("saved 2", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
