"""Tests of polishing a schedule window by window (:func:`passes.polish.polish`): pure
networkx and HiGHS, no torch."""

from __future__ import annotations

import time
from itertools import pairwise

import numpy as np
import pytest

from passes.checkmate import build_milp, recompute_objective
from passes.highs import Milp, Solved
from passes.polish import (
    POLISH_OVERTIME,
    POLISH_SECONDS,
    POLISH_STALL,
    Incumbent,
    PolishClock,
    polish,
    value_columns,
    value_windows,
)
from passes.training_graph import training_graph
from tests.milp_graphs import UNIT, chain

pytestmark = pytest.mark.full_solver_time  # what the solves find, not only that they end


def test_value_windows_cover_every_forward_value_half_a_window_apart() -> None:
    """Each window frees the R and S columns of ``width`` consecutive forward values, the
    next starts half a window later, and together they free every such column."""
    training = training_graph(chain(12))
    model = build_milp(training, 6 * UNIT)
    cost = recompute_objective(model, training)
    windows = value_windows(value_columns(model, cost), 4)
    value_of = {column: key[2] for key, column in model.columns.items() if key[0] in ("R", "S")}
    values = [sorted({value_of[column] for column in window}) for window in windows]
    assert all(len(v) <= 4 and v == list(range(v[0], v[0] + len(v))) for v in values)  # consecutive
    assert all(later[0] - earlier[0] == 2 for earlier, later in pairwise(values))
    forward = {key[2] for key, column in model.columns.items() if key[0] == "R" and cost[column] > 0}
    freed = {column for window in windows for column in window}
    assert freed == {column for column, value in value_of.items() if value <= max(forward)}
    assert value_windows(value_columns(model, cost), 4, offset=1)[0] != windows[0]  # the second lane's start elsewhere


def _poorer_start(ops: int) -> tuple[Milp, np.ndarray, Solved, float]:
    """A chain's model, its cost and a schedule recomputing more than the optimum (values the
    optimum holds into backward forced out), with the optimum's objective."""
    training = training_graph(chain(ops))
    model = build_milp(training, 6 * UNIT)
    cost = recompute_objective(model, training)
    best = model.solve(cost, 20)
    assert best.status == "optimal" and best.x is not None
    held = {column: 0.0 for key, column in model.columns.items()
            if key[0] == "S" and key[1] == training.n_forward and best.x[column] > 0.5 and not training.kept[key[2]]}
    poorer = model.fixed(held).solve(cost, 20)
    assert poorer.x is not None and poorer.objective > best.objective + 0.5  # a start worth polishing
    return model, cost, poorer, best.objective


def test_polishing_a_poorer_schedule_finds_the_least_recompute() -> None:
    """From a schedule recomputing more than the optimum (values the optimum holds into
    backward forced out), the windows find the optimum's recompute, and the schedule they
    end at is a solution of the whole model (its objective read back from its columns)."""
    model, cost, poorer, least = _poorer_start(12)
    found = Incumbent(None)
    found.offer(poorer)
    deadline = time.perf_counter() + 20
    polish(model, cost, found, PolishClock(deadline, deadline))
    assert found.best is not None and found.best.x is not None
    assert found.best.objective == pytest.approx(least)
    assert float(cost @ found.best.x) == pytest.approx(found.best.objective)
    assert model.solve(cost, 20, cutoff=found.best.objective - 0.5).status == "infeasible"  # none better


def test_past_its_deadline_a_polish_goes_on_only_while_it_betters_the_schedule() -> None:
    """With overtime left, a polish whose deadline has passed still polishes while its windows
    better the schedule, and stops soon after they stop bettering it (here at the optimum,
    long before the overtime ends; :class:`PolishClock`'s doctest: once :data:`POLISH_STALL`
    seconds bring nothing better); without overtime it solves no window."""
    model, cost, poorer, least = _poorer_start(12)
    found = Incumbent(None)
    found.offer(poorer)
    now = time.perf_counter()
    polish(model, cost, found, PolishClock(now, now))  # no overtime: nothing more
    assert found.best is poorer
    polish(model, cost, found, PolishClock(now, now + 60))
    ended = time.perf_counter()
    assert found.best is not None and found.best.objective == pytest.approx(least)  # bettered after the deadline
    assert found.bettered_at > now
    assert ended - found.bettered_at < POLISH_STALL + POLISH_SECONDS + 1.0  # stopped once it bettered nothing
    assert ended - now < 30  # long before the overtime's end


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_guided_solve_stopped_unproven_polishes_in_each_lane(lanes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the guided solves end without proving their schedule least, every lane polishes
    it until the time limit, and what comes back is a schedule of the whole model."""
    import passes.guided_solve
    from passes.guided_solve import guided_solve

    polished: list[bool] = []
    real = passes.guided_solve.polish

    def watched(model, cost, found, clock, shifted=False, own=False):
        polished.append(shifted)
        return real(model, cost, found, clock, shifted, own)

    monkeypatch.setattr(passes.guided_solve, "lanes", lambda: lanes)
    monkeypatch.setattr(passes.guided_solve, "polish", watched)
    training = training_graph(chain(30))
    model = build_milp(training, 6 * UNIT)  # not proven in seconds: a chain this long is symmetric
    cost = recompute_objective(model, training)
    started = time.perf_counter()
    found = guided_solve(model, cost, 6.0, None)  # its first schedule comes after 0.6-1 s here, the polish at 4.2
    assert time.perf_counter() - started < 6.0 * (1.3 + POLISH_OVERTIME) + 1  # one lane: the freed sub-MIPs may
    # run over; either: a polish still bettering the schedule may go on past the limit
    assert found.status == "time_limit" and found.x is not None
    assert float(cost @ found.x) == pytest.approx(found.objective)
    assert sorted(polished) == ([False, True] if lanes == 2 else [False])


def test_the_incumbent_bars_below_the_callers_cutoff_or_below_its_own_best() -> None:
    """``bar()`` asks a solve to beat both the best found and the caller's cutoff (the plan in
    hand); ``bar(own=True)`` only the best found, so that a schedule recomputing more than
    the plan in hand can be found and then polished down below it."""
    found = Incumbent(10.0)
    assert found.bar() == 10.0 and found.bar(own=True) is None
    found.offer(Solved("time_limit", object(), 20.0, 3.0))  # above the cutoff: a start for the polish
    assert found.bar() == 10.0 and found.bar(own=True) == 19.5
    found.offer(Solved("time_limit", object(), 6.0, 3.0))
    assert found.bar() == found.bar(own=True) == 5.5


@pytest.mark.parametrize("lanes", [1, 2])
def test_where_no_solve_beats_the_cutoff_the_polish_starts_from_a_schedule_found_without_it(
        lanes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a cutoff (a plan in hand's cost) that no solve beats in the time before the
    polish, one freed sub-MIP is asked for any schedule, and the polish betters it asking
    each window to beat the best found, not the cutoff (which no window reaches at once).
    Before, nothing was polished: a 40-op DAG at 0.3 of eager kept a plan of 1489 FLOPs
    where the solve without a cutoff found 1227. With ``polish_start=False`` (a wider search
    follows, :func:`passes.exact.exact_plan`) the solve ends there, as before."""
    import passes.guided_solve
    from passes.guided_solve import guided_solve

    solve, asked = Milp.solve, []
    training = training_graph(chain(30))
    model = build_milp(training, 6 * UNIT)
    cost = recompute_objective(model, training)
    cutoff = solve(model, cost, 30, relaxed=True).objective + 0.25  # the LP's bound

    def nothing_beats_the_cutoff(self: Milp, cost, time_limit: float, relaxed: bool = False, cutoff=None,
                                 enough=0.0):
        if relaxed:
            return solve(self, cost, time_limit, relaxed)
        asked.append(cutoff)
        if cutoff == cutoff_given:  # a tight budget: nothing found, nothing proven in the time
            return Solved("time_limit", None, float("inf"), 0.0)
        return solve(self, cost, time_limit, relaxed, cutoff=cutoff, enough=enough)

    cutoff_given = cutoff
    monkeypatch.setattr(Milp, "solve", nothing_beats_the_cutoff)
    monkeypatch.setattr(passes.guided_solve, "lanes", lambda: lanes)
    monkeypatch.setattr(passes.guided_solve, "START_SHARE", 0.4)  # time for the start on a loaded machine (0.15:
    # 0.45 s, which found none twice in 4 runs beside other solves)
    assert guided_solve(model, cost, 3.0, cutoff, polish_start=False).x is None
    asked.clear()
    found = guided_solve(model, cost, 3.0, cutoff)
    start = asked.index(None)  # the start, after every solve asked to beat the cutoff
    assert start > 0 and set(asked[:start]) == {cutoff}
    polished = asked[start + 1:]
    assert polished and all(bar is not None and bar != cutoff for bar in polished)  # below the best found
    assert found.x is not None and found.status == "time_limit"
    assert float(cost @ found.x) == pytest.approx(found.objective)


def test_where_no_solve_beats_the_plan_in_hand_two_lanes_polish_two_basins(monkeypatch: pytest.MonkeyPatch) -> None:
    """On two CPUs, where no solve beats the plan in hand (the start), one lane polishes the
    plan and the other a schedule found without the cutoff, each bettering a best of its own
    (a polish stays in the basin it starts from: one 40-op DAG at 0.3 of eager recomputed
    1176-1186 FLOPs polished from the plan in both lanes, 1012-1186 in two basins); the better
    of the two comes back, a schedule of the whole model no dearer than the plan."""
    import passes.guided_solve
    from passes.guided_solve import guided_solve

    model, cost, plan, least = _poorer_start(12)
    start = {column: float(round(plan.x[column])) for key, column in model.columns.items() if key[0] in ("R", "S")}
    cutoff = plan.objective - 0.25  # asked to beat the plan in hand
    solve, before_polish, polished = Milp.solve, [True], []

    def nothing_beats_the_plan(self: Milp, cost, time_limit: float, relaxed: bool = False, cutoff=None, enough=0.0):
        if before_polish[0] and not relaxed and cutoff is not None:  # the guided solves find nothing in the time
            return Solved("time_limit", None, float("inf"), 0.0)
        return solve(self, cost, time_limit, relaxed, cutoff=cutoff, enough=enough)

    real = passes.guided_solve.polish

    def watched(model, cost, found, clock, shifted=False, own=False):
        before_polish[0] = False
        polished.append((found, shifted, own, None if found.best is None else found.best.objective))
        return real(model, cost, found, clock, shifted, own)

    monkeypatch.setattr(Milp, "solve", nothing_beats_the_plan)
    monkeypatch.setattr(passes.guided_solve, "lanes", lambda: 2)
    monkeypatch.setattr(passes.guided_solve, "polish", watched)
    monkeypatch.setattr(passes.guided_solve, "START_SHARE", 0.4)  # time for the other start on a loaded machine
    found = guided_solve(model, cost, 3.0, cutoff, start=start)
    assert len(polished) == 2 and polished[0][0] is not polished[1][0]  # a best of its own each
    assert all(own for _, _, own, _ in polished)
    from_plan = [first for _, shifted, _, first in polished if shifted]  # the plan's lane: the shifted windows
    assert from_plan == [plan.objective]  # (the other lane's start is found in that lane)
    assert found.x is not None and found.objective <= plan.objective
    assert float(cost @ found.x) == pytest.approx(found.objective)
    assert found.objective >= least - 1e-6


def test_where_the_whole_model_proves_nothing_beats_the_cutoff_no_start_is_sought(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cutoff proven unbeatable (the whole MILP infeasible under it) ends the solve: no
    schedule is sought for a polish whose result could not be kept. Sought anyway, it cost
    three of planner_gap's 40-op DAGs at 0.5 of eager 4.5 s each for the same plans."""
    import passes.guided_solve
    from passes.guided_solve import guided_solve

    solve, asked = Milp.solve, []
    training = training_graph(chain(30))
    model = build_milp(training, 6 * UNIT)
    cost = recompute_objective(model, training)
    cutoff = solve(model, cost, 30, relaxed=True).objective + 0.25

    def proven_unbeatable(self: Milp, cost, time_limit: float, relaxed: bool = False, cutoff=None, enough=0.0):
        if relaxed:
            return solve(self, cost, time_limit, relaxed)
        asked.append(cutoff)
        return Solved("infeasible", None, float("inf"), float("inf"))

    monkeypatch.setattr(Milp, "solve", proven_unbeatable)
    monkeypatch.setattr(passes.guided_solve, "lanes", lambda: 1)
    found = guided_solve(model, cost, 3.0, cutoff)
    assert found.status == "infeasible" and found.x is None
    assert None not in asked
