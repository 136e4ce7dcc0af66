"""A progress bar for planning that only appears when planning is slow (over a second)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from passes.plan import Progress as ProgressCallback

SHOW_AFTER_SECONDS = 1.0


@contextlib.contextmanager
def planning_progress(description: str = "planning", show_after: float = SHOW_AFTER_SECONDS,
                      console: Console | None = None) -> Iterator[ProgressCallback]:
    """Yield a ``(done, total)`` callback for :mod:`passes`. Once ``show_after`` seconds
    have passed, a transient rich bar shows on ``console`` (stderr by default; nothing when
    it is not a terminal) and goes away when planning ends."""
    console = console or Console(stderr=True)
    started = time.perf_counter()
    bar: Progress | None = None
    task = None

    def report(done: int, total: int) -> None:
        nonlocal bar, task
        if bar is None:
            if time.perf_counter() - started < show_after or not console.is_terminal:
                return
            bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TimeElapsedColumn(), console=console, transient=True)
            bar.start()
            task = bar.add_task(description, total=total)
        bar.update(task, completed=done, total=total)

    try:
        yield report
    finally:
        if bar is not None:
            bar.stop()
