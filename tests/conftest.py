"""Test-run set-up. The suite runs on pytest-xdist workers (``-n auto`` in pyproject's
``addopts``): each worker gets its share of the CPU's threads for torch's intra-op pool, so
workers do not oversubscribe the cores (on 2 cores, two workers with two threads each ran
24 min of CPU for 12.5 min of wall time). Tests not marked ``full_solver_time`` get the exact
solver's solves capped (:data:`QUICK_SOLVE_SECONDS`)."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


QUICK_SOLVE_SECONDS = 1.0
"""The most seconds one HiGHS solve, or one guided solve of the recompute MILP (its LP
relaxation and sub-MIPs together: :func:`passes.guided_solve.guided_solve`), may take in a
test not marked ``full_solver_time``.

A budget plan of a graph of up to 40 ops asks the exact solver for up to 5 s a solve, and a
refused budget solves twice more for its floors; most tests check what any plan must do
(fit, train like eager, hold its simulated peak), whatever schedule the solver found in its
time. Capping their solves keeps every solver path running in less of the suite's time
(about 600 of its 2000 test-seconds were HiGHS's, stop 65; capped one solve at a time, a
guided solve, six solves, still took about 6 s on the zoo ResNet, stop 66); tests of what
the solver finds (a schedule it proves least, a floor it names) carry the marker and get
the product's limits."""


@pytest.fixture(autouse=True)
def quick_solver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every solve capped at :data:`QUICK_SOLVE_SECONDS` unless the test is marked."""
    if request.node.get_closest_marker("full_solver_time") is not None:
        return
    import passes.checkmate
    from passes.highs import Milp

    solve, guided = Milp.solve, passes.checkmate.guided_solve

    def capped(self: Milp, cost, time_limit: float, *args, **kwargs):
        return solve(self, cost, min(time_limit, QUICK_SOLVE_SECONDS), *args, **kwargs)

    def guided_capped(model: Milp, cost, time_limit: float, *args, **kwargs):
        return guided(model, cost, min(time_limit, QUICK_SOLVE_SECONDS), *args, **kwargs)

    monkeypatch.setattr(Milp, "solve", capped)
    monkeypatch.setattr(passes.checkmate, "guided_solve", guided_capped)
