"""Terminal plumbing shared by the ``graphckpt`` commands: consoles, errors, quiet profiling.

Commands print results to stdout and everything else (progress, notes, errors) to stderr,
so ``graphckpt inspect --json ... | jq`` always gets clean JSON.
"""

from __future__ import annotations

import contextlib
import re
import sys

from rich.console import Console
from rich.markup import escape

from graphckpt.torch_compat.profiler import stderr_without

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


def quiet_profiler() -> contextlib.AbstractContextManager[None]:
    """Drop the ``USDT: ... profiler_start`` lines torch's C++ profiler writes straight to
    file descriptor 2 on every run (:data:`graphckpt.torch_compat.profiler.KINETO_MARKER`) and its warning about blocks
    allocated before profiling (expected: parameters exist before a measured step); anything
    else written to stderr meanwhile is passed on once the block ends."""
    return stderr_without(_PROFILER_CHATTER)
