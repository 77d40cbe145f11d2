"""A progress bar for long commands (bench, replay, purge): redrawn in place on a
terminal, a line every few seconds otherwise (CI logs, pipes)."""

from __future__ import annotations

import sys
import time


class Progress:
    """One progress bar on stderr: redrawn in place on a terminal, a line every 5 s otherwise."""

    WIDTH = 30

    def __init__(self, label: str, total: float, unit: str = "") -> None:
        self.label = label
        self.total = max(total, 1e-9)
        self.unit = unit
        self.tty = sys.stderr.isatty()
        self._last_line = 0.0
        self._started = time.monotonic()

    def update(self, done: float, extra: str = "") -> None:
        now = time.monotonic()
        if not self.tty and now - self._last_line < 5.0:
            return
        self._last_line = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(frac * self.WIDTH)
        line = (
            f"{self.label:<28} [{bar:<{self.WIDTH}}] {frac * 100:5.1f}% "
            f"{done:,.0f}/{self.total:,.0f}{self.unit} {now - self._started:6.1f}s {extra}"
        )
        sys.stderr.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self, extra: str = "") -> None:
        self._last_line = 0.0
        self.update(self.total, extra)
        if self.tty:
            sys.stderr.write("\n")
