"""The progress bar of a run: a `runner.ProgressSink` drawn with rich on the terminal.

The runner pushes its counters a few times a second rather than on every response, so the
bar costs nothing measurable at 1,000 requests/s. It is only drawn on a terminal and not with
``--quiet``; otherwise `progress_for` gives no sink at all.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

_COUNTS = "sent {task.fields[sent]} · in flight {task.fields[in_flight]} · errors {task.fields[errors]}"


class RichProgress:
    """A bar of completed requests over planned ones, with the sent, in-flight and error counts."""

    def __init__(self, description: str, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(_COUNTS),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
        )
        self._task: TaskID = self._progress.add_task(description, total=None, sent=0, in_flight=0, errors=0)

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def update(self, *, planned: int, sent: int, done: int, errors: int) -> None:
        self._progress.update(
            self._task, total=planned, completed=done, sent=sent, in_flight=sent - done, errors=errors
        )


@contextmanager
def progress_for(description: str, *, quiet: bool) -> Iterator[RichProgress | None]:
    """A bar on an interactive terminal, else None (the runner then reports nothing)."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    with RichProgress(description) as bar:
        yield bar
