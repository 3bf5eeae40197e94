"""A one-line progress bar for tuning runs (which take seconds to minutes).

    >>> import io
    >>> out = io.StringIO()
    >>> bar = ProgressBar(2, "M=8", stream=out)
    >>> bar.step("a: 1.0 us"); bar.step("b: excluded")
    >>> out.getvalue().splitlines()[-1]
    'nvgemm autotune M=8 [########################] 2/2 b: excluded'
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["ProgressBar"]


class ProgressBar:
    """A one-line stderr progress bar (no dependency). On a terminal it redraws
    in place; elsewhere it prints one line per step, so logs stay readable."""

    def __init__(self, total: int, label: str, *, stream: Any = None, enabled: bool = True, width: int = 24) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, note: str) -> None:
        """Advance by one and show ``note`` (the candidate just handled)."""
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"nvgemm autotune {self.label} [{bar}] {self.done}/{self.total} {note}"
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if self.done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
