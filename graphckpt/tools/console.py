"""Terminal plumbing shared by the ``graphckpt`` commands: consoles, errors, quiet profiling.

Commands print results to stdout and everything else (progress, notes, errors) to stderr,
so ``graphckpt inspect --json ... | jq`` always gets clean JSON.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape

_PROFILER_CHATTER = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\] "
                               r"|^\[W\d+ .*allocated before the profiling started")


def out() -> Console:
    """A console on the current ``sys.stdout`` (tests swap it; so look it up each time)."""
    return Console(file=sys.stdout, highlight=False)


def err() -> Console:
    """A console on the current ``sys.stderr``."""
    return Console(file=sys.stderr, highlight=False)


def error_line(message: str) -> None:
    """``error: message`` in red on stderr, as one line however long."""
    flat = " ".join(str(message).split())
    err().print(f"[bold red]error:[/] [red]{escape(flat)}[/]", soft_wrap=True)


def note_line(message: str) -> None:
    """A dim ``note: message`` on stderr."""
    err().print(f"[dim]note: {escape(message)}[/]", soft_wrap=True)


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Drop the ``USDT: ... profiler_start`` lines torch's C++ profiler writes straight to
    file descriptor 2 on every run (no setting turns them off) and its warning about blocks
    allocated before profiling (expected: parameters exist before a measured step); anything
    else written to stderr meanwhile is passed on once the block ends."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (embedded interpreters): nothing to filter
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().decode(errors="replace").splitlines(keepends=True)
                    if not _PROFILER_CHATTER.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
