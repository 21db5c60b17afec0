"""Progress bars over ``total_frames``: tqdm or rich objects, or a built-in one-line bar."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, TextIO

__all__ = ["Progress"]


class _LineBar:
    """A one-line bar on a stream, redrawn at most 10 times a second (no dependency).

    On a terminal, ``sys.stdout`` and ``sys.stderr`` are wrapped while the bar is shown (:class:`_Around`):
    a line printed by anyone clears the bar's line, is written, and the bar is drawn again below it, so
    prints and the bar never share a line; the final bar replaces the live one (printed once).
    """

    def __init__(self, total: int | None, stream: TextIO) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.frames = 0
        self._last = 0.0
        self._text = ""
        self._shown = False  # the bar is on the terminal's current line
        self._partial = False  # someone else's line is unfinished: no drawing until it ends
        self._closed = False
        self._lock = threading.RLock()  # prints may come from any thread
        self._wrapped: list[tuple[str, _Around, TextIO]] = []

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
        if not self.tty:
            self.stream.write(text + "\n")
            self.stream.flush()
            return
        with self._lock:
            if self._closed:
                return
            self._text = text[: max(20, shutil.get_terminal_size((100, 24)).columns - 1)]
            if final:
                if self._partial:  # end the unfinished line of someone else's output first
                    self.stream.write("\n")
                self._redraw()
                self.stream.write("\n")
                self.stream.flush()
                self._closed = True
                self._unwrap()
            elif not self._partial:
                if not self._wrapped:
                    self._wrap()
                self._redraw()

    def _redraw(self) -> None:
        self.stream.write("\r" + _CLEAR_LINE + self._text)
        self.stream.flush()
        self._shown = True

    # -- someone else's output (sys.stdout / sys.stderr while the bar is shown) --------------------------
    def write_around(self, target: TextIO, text: str) -> int:
        """Write ``text`` to ``target`` with the bar out of the way: cleared first, drawn again once the
        line is complete."""
        with self._lock:
            if self._closed or not text:
                return target.write(text)
            if self._shown:
                self.stream.write("\r" + _CLEAR_LINE)
                self.stream.flush()
                self._shown = False
            n = target.write(text)
            self._partial = not text.endswith("\n")
            if not self._partial:
                target.flush()
                self._redraw()
            return n

    def _wrap(self) -> None:
        for name in ("stdout", "stderr"):
            original = getattr(sys, name)
            if original is None or isinstance(original, _Around) or not _isatty(original):
                continue  # output to a file or a pipe never shares the bar's line
            around = _Around(original, self)
            setattr(sys, name, around)
            self._wrapped.append((name, around, original))

    def _unwrap(self) -> None:
        for name, around, original in reversed(self._wrapped):
            if getattr(sys, name) is around:  # else someone wrapped it since: ours passes through now
                setattr(sys, name, original)
        self._wrapped.clear()


_CLEAR_LINE = "\x1b[2K"  # ANSI: erase the whole line (the cursor stays)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class _Around:
    """``sys.stdout`` (or ``sys.stderr``) while a bar is shown: writes go through the bar's
    :meth:`_LineBar.write_around`; everything else is the original stream's."""

    def __init__(self, original: TextIO, bar: _LineBar) -> None:
        self._original = original
        self._bar = bar

    def write(self, text: str) -> int:
        return self._bar.write_around(self._original, text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


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

    @property
    def shown(self) -> bool:
        """Whether there is a display to update (callers skip working out its figures otherwise)."""
        return self._line is not None or self._custom is not None

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
        line, self._line = self._line, None
        if line is not None:
            if line.frames:
                line.draw(total_frames, fps, mean_return, final=True)  # once, in place of the live bar
            else:
                line._unwrap()
