"""Progress of a long command (``kalos export``, ``kalos import``): a rich bar when the stream is
a terminal, plain lines every few seconds when it is not (a log file, a CI job, a pipe)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

#: Seconds between two progress lines on a stream that is not a terminal.
REPORT_S = 2.0


class RowProgress:
    """Rows done out of ``total`` (None: unknown), under the label ``what``.

    Not on a terminal it writes a line when it starts, then at most one every ``every_s``
    seconds, and a last one when the block ends without an error; ``clock`` is injectable so
    tests decide when time passes."""

    def __init__(
        self,
        what: str,
        total: int | None,
        *,
        stream: TextIO | None = None,
        every_s: float = REPORT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self._stream = sys.stderr if stream is None else stream
        self._every_s = every_s
        self._clock = clock
        self._last = 0.0
        self._bar: Progress | None = None  # on a terminal
        self._task: TaskID | None = None

    def __enter__(self) -> RowProgress:
        if self._stream.isatty():
            bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("rows"),
                TimeRemainingColumn(),
                console=Console(file=self._stream),
            )
            bar.start()
            self._task = bar.add_task(self.what, total=self.total)
            self._bar = bar
        else:
            self._line()
            self._last = self._clock()
        return self

    def advance(self, rows: int) -> None:
        self.done += rows
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.done)
            return
        now = self._clock()
        if now - self._last >= self._every_s:
            self._last = now
            self._line()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif et is None:
            self._line()

    def _line(self) -> None:
        if self.total is None:
            text = f"{self.what}: {self.done:,} rows"
        else:
            pct = 100.0 * self.done / self.total if self.total else 100.0
            text = f"{self.what}: {self.done:,} of {self.total:,} rows ({pct:.0f}%)"
        print(text, file=self._stream, flush=True)


__all__ = ["RowProgress", "REPORT_S"]
