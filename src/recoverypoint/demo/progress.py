"""A progress bar on stderr: redrawn in place on a terminal, a line per tenth elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .harness import Progress

_WIDTH = 30
# What the stages without a bar are doing, for the line that says they began.
_STEPS = {
    "prepare": "creating recoverypoint's and Rocket Rides' tables",
    "start": "starting the provider, the API processes, the completer and the enqueuer",
    "check": "every process stopped; checking the database",
}


class ProgressBar:
    """Reports a demo run's :class:`Progress`. ``steps``: how many lines a stage's bar
    takes where the bar cannot be redrawn (not a terminal)."""

    def __init__(self, out: TextIO | None = None, *, steps: int = 10) -> None:
        self.out = sys.stderr if out is None else out
        self.interactive = self.out.isatty()
        self.steps = steps
        self.began = time.monotonic()
        self._last_line = ""
        self._reported: tuple[str, int] = ("", -1)

    def __call__(self, progress: Progress) -> None:
        elapsed = f"{time.monotonic() - self.began:.0f}s"
        if progress.stage in _STEPS:
            self._end_bar()
            self.out.write(f"{progress.stage:<10} {_STEPS[progress.stage]}  {elapsed}\n")
            self.out.flush()
            return
        fraction = progress.done / progress.total if progress.total else 0.0
        if progress.stage == "load":
            detail = (
                f"{progress.done}/{progress.total} rides  {progress.retries} retries  "
                f"{progress.api_restarts} API restarts"
            )
        else:
            detail = f"completer and enqueuer: {progress.unfinished} keys and jobs left"
        bar = "#" * int(fraction * _WIDTH)
        line = f"{progress.stage:<10} [{bar:<{_WIDTH}}] {detail}  {elapsed}"
        if self.interactive:
            self.out.write("\r" + line.ljust(len(self._last_line)))
            self._last_line = line
        else:
            step = (progress.stage, int(fraction * self.steps))
            if step == self._reported:
                return
            self._reported = step
            self.out.write(line + "\n")
        self.out.flush()

    def _end_bar(self) -> None:
        """Move past a bar redrawn in place, so that the next line does not overwrite it."""
        if self.interactive and self._last_line:
            self.out.write("\n")
            self._last_line = ""

    def close(self) -> None:
        self._end_bar()
        self.out.flush()
