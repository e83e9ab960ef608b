"""A progress bar on stderr: redrawn in place on a terminal, a line per tenth elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .harness import Progress

_WIDTH = 30


class ProgressBar:
    def __init__(self, out: TextIO = sys.stderr) -> None:
        self.out = out
        self.interactive = out.isatty()
        self.began = time.monotonic()
        self._last_line = ""
        self._reported: tuple[str, int] = ("", -1)

    def __call__(self, progress: Progress) -> None:
        fraction = progress.done / progress.total if progress.total else 0.0
        if progress.stage == "load":
            detail = (
                f"{progress.done}/{progress.total} rides  {progress.retries} retries  "
                f"{progress.api_restarts} API restarts"
            )
        else:
            detail = f"completer and enqueuer: {progress.unfinished} keys and jobs left"
        bar = "#" * int(fraction * _WIDTH)
        line = (
            f"{progress.stage:<10} [{bar:<{_WIDTH}}] {detail}  {time.monotonic() - self.began:.0f}s"
        )
        if self.interactive:
            self.out.write("\r" + line.ljust(len(self._last_line)))
            self._last_line = line
        else:
            tenth = (progress.stage, int(fraction * 10))
            if tenth == self._reported:
                return
            self._reported = tenth
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.interactive and self._last_line:
            self.out.write("\n")
            self.out.flush()
