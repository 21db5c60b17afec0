"""Whether a process id still runs (Linux ``/proc`` where there is one)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not count: it has ended, its parent has not reaped it).

    Example:
        >>> pid_alive(os.getpid())
        True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return True  # no /proc: os.kill said it exists
    return state not in (b"Z", b"X")
