"""A progress line for long CLI runs, drawn only on a terminal."""

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """
    Call L{update} with running totals; it redraws at most 10 times a second
    and only when C{stream} is a TTY.  L{finish} prints the final totals.
    """

    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.clock = clock
        self.start = clock()
        self._last_draw = 0.0
        self.count = 0
        self.nbytes = 0
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, count: int, nbytes: int = 0) -> None:
        self.count = count
        self.nbytes = nbytes
        now = self.clock()
        if self.enabled and now - self._last_draw >= 0.1:
            self._last_draw = now
            self.stream.write("\r" + self.line(now) + "\x1b[K")
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        rate = self.count / elapsed
        mb = self.nbytes / elapsed / 1e6
        if self.total:
            pct = min(100.0, 100.0 * self.count / self.total)
            width = 30
            filled = int(width * pct / 100)
            bar = "[" + "#" * filled + "." * (width - filled) + f"] {pct:5.1f}% "
        else:
            bar = ""
        size = f" ({self.nbytes / 1e6:,.1f} MB)" if self.nbytes else ""
        return (f"{self.label}: {bar}{self.count} records{size}, {rate:,.0f}/s, "
                f"{mb:,.1f} MB/s")

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\r" + self.line() + "\x1b[K\n")
            self.stream.flush()
