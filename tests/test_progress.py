"""Stage spinners (graphckpt.progress.stage_progress): shown on long stages, quiet on short ones."""

from __future__ import annotations

import io
import threading

from rich.console import Console

from graphckpt.progress import stage_progress


def test_stage_spinner_shows_on_a_long_stage_and_not_on_a_short_one() -> None:
    screen = io.StringIO()
    shown = threading.Event()
    with stage_progress("graphckpt: costing 10 nodes", show_after=0.0, console=Console(file=screen, force_terminal=True)):
        shown.wait(0.5)  # the timer thread starts the spinner; no wall-clock assertion on how soon
        for _ in range(50):
            if "costing" in screen.getvalue():
                break
            shown.wait(0.05)
    assert "graphckpt: costing 10 nodes" in screen.getvalue()
    quiet = io.StringIO()
    with stage_progress("fast", show_after=60.0, console=Console(file=quiet, force_terminal=True)):
        pass
    assert quiet.getvalue() == ""


def test_stage_spinner_is_silent_off_a_terminal() -> None:
    screen = io.StringIO()
    with stage_progress("piped", show_after=0.0, console=Console(file=screen, force_terminal=False)):
        pass
    assert screen.getvalue() == ""
