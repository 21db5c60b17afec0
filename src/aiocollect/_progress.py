"""Progress bars over ``total_frames``: tqdm or rich objects, or a built-in one-line bar."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress"]


class _LineBar:
    """A one-line bar on a stream, redrawn at most 10 times a second (no dependency)."""

    def __init__(self, total: int | None, stream: TextIO) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.frames = 0
        self._last = 0.0

    def draw(self, frames: int, fps: float, mean_return: float | None, final: bool = False) -> None:
        self.frames = frames
        now = time.monotonic()
        if not final and now - self._last < (0.1 if self.tty else 5.0):
            return
        self._last = now
        ret = "" if mean_return is None else f"  return {mean_return:.1f}"
        if self.total:
            done = min(frames / self.total, 1.0)
            bar = "#" * int(done * 30)
            text = f"[{bar:<30}] {frames}/{self.total} frames  {fps:,.0f} frames/s{ret}"
        else:
            text = f"{frames} frames  {fps:,.0f} frames/s{ret}"
        self.stream.write(("\r" + text + " " * 4) if self.tty else text + "\n")
        if final and self.tty:
            self.stream.write("\n")
        self.stream.flush()


class Progress:
    """Reports delivered frames to a progress display.

    ``option``: ``None`` (a bar when stderr is a terminal), ``True`` (always: on a terminal a redrawn
    line, otherwise a line every 5 s), ``False``, a tqdm-like object (``update(n)``, ``set_postfix``), or a
    ``rich.progress.Progress`` (a task is added to it).
    """

    def __init__(self, option: Any, total_frames: int) -> None:
        self._custom = None
        self._rich_task = None
        self._line: _LineBar | None = None
        total = total_frames if total_frames > 0 else None
        if option is None:
            option = sys.stderr.isatty()
        if option is True:
            self._line = _LineBar(total, sys.stderr)
        elif option is False:
            pass
        elif callable(getattr(option, "add_task", None)):  # rich.progress.Progress
            self._custom = option
            self._rich_task = option.add_task("collecting", total=total)
        elif callable(getattr(option, "update", None)):  # tqdm and friends
            self._custom = option
        else:
            raise TypeError(
                f"progress must be None, True, False, a tqdm bar or a rich Progress, got {option!r}"
            )

    def update(self, frames: int, total_frames: int, fps: float, mean_return: float | None) -> None:
        if self._line is not None:
            self._line.draw(total_frames, fps, mean_return)
        elif self._rich_task is not None:
            self._custom.update(self._rich_task, advance=frames)  # type: ignore[union-attr]
        elif self._custom is not None:
            self._custom.update(frames)
            set_postfix = getattr(self._custom, "set_postfix", None)
            if callable(set_postfix):
                postfix = {"frames/s": f"{fps:,.0f}"}
                if mean_return is not None:
                    postfix["return"] = f"{mean_return:.1f}"
                set_postfix(postfix, refresh=False)

    def close(self, total_frames: int, fps: float, mean_return: float | None) -> None:
        if self._line is not None and self._line.frames:
            self._line.draw(total_frames, fps, mean_return, final=True)
        self._line = None
