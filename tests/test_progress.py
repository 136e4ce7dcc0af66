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


def test_auto_plan_reports_each_candidate_and_planning_leaves_the_collector_as_it_was() -> None:
    """``auto`` tells the planning bar how far it is (three candidates, seconds each at 50k
    nodes); planning pauses the cyclic collector and turns it back on after."""
    import gc

    from graphckpt.progress import paused_gc
    from passes.heuristics import auto_plan
    from tests.test_budget import chain as chain_graph

    heard: list[tuple[int, int]] = []
    auto_plan(chain_graph(16, [100]), progress=lambda done, total: heard.append((done, total)))
    assert heard == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
