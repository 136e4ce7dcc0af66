"""Long rewrites: a bar for planning and a spinner for the other stages, each appearing only
when its stage runs over a second, and the garbage collector paused while a stage runs."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

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


@contextlib.contextmanager
def stage_progress(description: str, show_after: float = SHOW_AFTER_SECONDS,
                   console: Console | None = None) -> Iterator[None]:
    """A transient spinner with elapsed time for a pipeline stage (capture, costs, codegen)
    that has no count to report: it appears on ``console`` (stderr by default, only a
    terminal) once the stage has run ``show_after`` seconds, and goes away when it ends."""
    console = console or Console(stderr=True)
    lock = threading.Lock()
    state: dict[str, Progress | bool | None] = {"bar": None, "done": False}

    def show() -> None:
        with lock:
            if state["done"]:
                return
            bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                           console=console, transient=True)
            bar.start()
            bar.add_task(description, total=None)
            state["bar"] = bar

    timer = threading.Timer(show_after, show) if console.is_terminal else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        with lock:
            state["done"] = True
            if timer is not None:
                timer.cancel()
            if isinstance(state["bar"], Progress):
                state["bar"].stop()


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for a while (back on after, as it was).

    Capture, costs, planning and codegen make millions of small objects and few cycles, so the collector
    finds next to nothing, but each of its full passes scans the whole heap (the fx graph,
    the module, the cost graph): about 1.4 s at 50k fx nodes, landing in a stage or not by
    chance (a 50k-node plan auto took 4.5 s or 5.9 s). Reference counting still frees what
    they drop; the few cycles (networkx graphs of the min-cut windows, fx nodes) wait for the
    next collection. Also a decorator: ``@paused_gc()``.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
