"""The true floor (:mod:`passes.floor`): the least peak any recompute schedule reaches, named by
BudgetError beside the floor of graphckpt's own plans when it is lower."""

from __future__ import annotations

import math
import random

import pytest

from graphckpt.tools.random_dags import random_cost_graph
from passes.budget import BudgetError, unreachable
from passes.budget_search import fit_budget
from passes.checkmate import checkmate_schedule
from passes.exact import floor_plan, floors_below
from passes.floor import FLOOR_MAX_OPS, Floor, true_floor
from passes.optimal import DynamicProgram
from passes.relaxed import lowest_relaxed
from passes.simulate import eager_peak
from passes.units import format_bytes, unit_of
from tests.test_exact_extras import _small_unet

pytestmark = pytest.mark.full_solver_time  # floors are what the solver finds in its time


@pytest.mark.parametrize("seed", range(3))
def test_true_floor_is_below_every_plan_and_reachable(seed: int) -> None:
    graph = random_cost_graph(random.Random(seed), 10)
    floor = true_floor(graph, time_limit=20)
    assert floor is not None and floor.proven
    assert floor.peak_bytes <= DynamicProgram(graph).smallest().peak_bytes
    assert checkmate_schedule(graph, floor.peak_bytes + 1, time_limit=20) is not None  # a schedule meets it
    assert checkmate_schedule(graph, floor.peak_bytes * 0.98, time_limit=20) is None  # and nothing below


def test_budget_error_names_both_floors(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seed 1's graph had a gap until plans could rematerialize inputs: its plans now reach
    # the true floor (test_plans_reach_the_true_floor_of_a_graph_they_missed); seed 2's until a
    # refusal tried relaxed plans below the others (passes.relaxed.lowest_relaxed); seed 10's
    # has one to the plans of every strategy but the exact solver's for the refused budget
    # alone, whose schedules reach it (as do the plans for budgets just above it, which a
    # refusal plans for too, passes.refusal.lower_refusal: left out for the first part).
    import passes.budget_search as budget_search

    graph = random_cost_graph(random.Random(10), 10)
    smallest = DynamicProgram(graph).smallest().peak_bytes
    floor = true_floor(graph, time_limit=20)
    assert floor is not None and floor.peak_bytes < smallest  # this graph has a gap to show
    with monkeypatch.context() as patched, pytest.raises(BudgetError) as raised:
        patched.setattr(budget_search, "lower_refusal", lambda graph, refused, plan_for, **_: refused)
        fit_budget(graph, int(floor.peak_bytes) - 1, exact_seconds=0)
    error = raised.value
    assert error.true_floor_bytes is not None and error.true_floor_bytes < error.smallest_peak_bytes
    assert "true floor" in str(error) and "does not meet" in str(error)
    with pytest.raises(BudgetError) as lowered:
        fit_budget(graph, int(floor.peak_bytes) - 1, exact_seconds=0)
    assert lowered.value.smallest_peak_bytes < error.smallest_peak_bytes  # the budgets above reach lower
    with pytest.raises(BudgetError) as exact:
        fit_budget(graph, int(floor.peak_bytes) - 1)
    assert exact.value.strategy == "exact" and exact.value.smallest_peak_bytes <= math.ceil(floor.peak_bytes)
    assert "true floor" not in str(exact.value)  # the floor named is the true one


def test_plans_reach_the_true_floor_of_a_graph_they_missed() -> None:
    """Random DAG of seed 1: the dynamic program's floor is above the true floor; plans that
    rematerialize segment inputs (passes.remat) reach it, so the error names no lower floor."""
    graph = random_cost_graph(random.Random(1), 10)
    floor = true_floor(graph, time_limit=20)
    assert floor is not None and floor.peak_bytes < DynamicProgram(graph).smallest().peak_bytes
    assert fit_budget(graph, math.ceil(floor.peak_bytes)).peak_bytes <= floor.peak_bytes
    with pytest.raises(BudgetError) as raised:
        fit_budget(graph, int(floor.peak_bytes) - 1)
    assert raised.value.smallest_peak_bytes == raised.value.true_floor_bytes
    assert "true floor" not in str(raised.value)
    assert raised.value.floor_proven, "a 10-op graph's floor is proven in well under its 5 s"
    assert "No recompute schedule meets this budget: the exact solver proved none peaks below" in str(raised.value)


NONE_MEETS = "No recompute schedule meets this budget: the exact solver proved none peaks below"
MAY_MEET = "stopped at its time limit having proved only that no schedule peaks below"


@pytest.mark.parametrize(("bound", "budget", "says"), [
    (900, 800, NONE_MEETS),
    (700, 800, MAY_MEET),
    (1000, 800, NONE_MEETS),  # proven: the bound is the floor
    (None, 800, None),
    (0, 800, None),  # a bound of nothing proves nothing
    (700, 1000, None),  # the floor named meets the budget already (graphckpt's plans do not)
])
def test_a_refusal_says_what_the_solver_proved_of_the_floor(bound: int | None, budget: int, says: str | None) -> None:
    """The floor named (a schedule found at 1000 B) comes with what its solve proved: the
    budget out of reach of every schedule, or a longer solve might still meet it."""
    graph = random_cost_graph(random.Random(0), 8)
    plan = fit_budget(graph, eager_peak(graph), exact_seconds=0)
    error = unreachable(graph, budget, [plan], 1000.0, bound)
    assert error.floor_proven == (bound == 1000)
    assert error.floor_bound_bytes == bound
    if says is None:
        assert "exact solver" not in str(error)
    else:
        written = format_bytes(bound, unit_of(plan.eager_peak_bytes))  # every size in eager's unit
        assert f"{says} {written} ({bound / plan.eager_peak_bytes:.2f}x eager)" in str(error), str(error)
        assert (MAY_MEET in str(error)) == (says == MAY_MEET)


def test_no_true_floor_on_large_graphs() -> None:
    graph = random_cost_graph(random.Random(0), FLOOR_MAX_OPS + 1)
    assert true_floor(graph) is None
    with pytest.raises(BudgetError) as raised:
        fit_budget(graph, int(0.05 * eager_peak(graph)))
    assert raised.value.true_floor_bytes is None and "true floor" not in str(raised.value)


def test_a_refused_budget_names_the_exact_schedules_floor_and_that_budget_is_met() -> None:
    """Below every plan, BudgetError names the least peak of the widest plans, the exact
    solver's schedules (:func:`passes.exact.floor_plan`), not the other strategies' floor, and
    a budget at the peak it names is met. The small U-Net: mincut reaches 0.59x of eager, a
    schedule making pool's indices again 0.55x."""
    graph = _small_unet()
    lowest = floor_plan(graph, time_limit=20)
    assert lowest is not None and lowest.segments[0].schedule is not None
    assert floor_plan(graph, time_limit=0) is None  # exact=False: no such plan
    with pytest.raises(BudgetError) as others:
        fit_budget(graph, lowest.peak_bytes - 1, exact_seconds=0)
    with pytest.raises(BudgetError) as caught:
        fit_budget(graph, lowest.peak_bytes - 1)
    error = caught.value
    assert error.strategy == "exact" and error.smallest_peak_bytes < others.value.smallest_peak_bytes
    assert error.at_peak is not None and error.at_peak.peak_bytes == error.smallest_peak_bytes
    assert error.true_floor_bytes <= error.smallest_peak_bytes
    assert fit_budget(graph, error.smallest_peak_bytes).peak_bytes <= error.smallest_peak_bytes


def test_a_budget_the_least_recompute_solve_misses_is_met_by_the_least_peak_schedule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where only exact schedules fit and the solve for the least recompute finds none (its
    time ran out), the schedule of least peak that fits is the plan, not a refusal."""
    import passes.budget_search as budget_search

    graph = _small_unet()
    budget = int(0.57 * eager_peak(graph))  # only exact schedules fit (tests/test_exact_extras.py)
    monkeypatch.setattr(budget_search, "exact_plan", lambda *args, **kwargs: None)
    plan = fit_budget(graph, budget)
    assert plan.peak_bytes <= budget and "least peak" in plan.notes[0]
    assert plan.segments[0].schedule is not None


@pytest.mark.parametrize("seed", range(3))
def test_floor_solves_given_a_plan_in_hand_look_only_below_it(seed: int) -> None:
    """``below`` (the smallest peak of the plans a refused budget tried) makes both floor
    solves look only for schedules peaking less: where none does, the true floor named is
    ``below`` itself, proven (the caller's plan reaches it), and no floor plan is made;
    above the floor, each is found as without it."""
    graph = random_cost_graph(random.Random(seed), 10)
    floor = true_floor(graph, time_limit=20)
    lowest = floor_plan(graph, time_limit=20)
    assert floor is not None and floor.proven and lowest is not None
    under = floor.peak_bytes * (1 - 1e-3)  # below the proven floor: no schedule peaks less
    assert true_floor(graph, time_limit=20, below=under) == Floor(peak_bytes=under, lower_bound_bytes=under)
    above = true_floor(graph, time_limit=20, below=floor.peak_bytes * 1.2)
    assert above is not None and above.proven and above.peak_bytes == pytest.approx(floor.peak_bytes)
    assert floor_plan(graph, time_limit=20, below=under) is None
    assert floor_plan(graph, time_limit=20, below=lowest.peak_bytes * 1.2).peak_bytes == lowest.peak_bytes


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_refusals_two_floors_are_the_same_solved_at_once_or_one_after_the_other(
        lanes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a refused budget names (:func:`passes.exact.floors_below`): the exact schedules'
    floor plan and the true floor, solved side by side on two CPUs, or the true floor after
    the plan on one; the same floors either way, the true one never above the plan's."""
    import passes.exact

    monkeypatch.setattr(passes.exact, "lanes", lambda: lanes)
    graph = random_cost_graph(random.Random(2), 10)  # its true floor is below every other strategy's plans
    lowest, floor = floors_below(graph, 20, DynamicProgram(graph).smallest().peak_bytes)
    alone = true_floor(graph, time_limit=20)
    assert lowest is not None and floor is not None and alone is not None and floor.proven
    assert floor.peak_bytes == pytest.approx(alone.peak_bytes)
    assert floor.peak_bytes <= lowest.peak_bytes == floor_plan(graph, time_limit=20).peak_bytes


@pytest.mark.parametrize("seed", [0, 5, 8])
def test_a_refusal_whose_floor_solves_found_nothing_names_the_relaxed_plans_floor(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the floor solves find no schedule below the plans in hand (their time ran out, as
    on the zoo ResNet at 0.5 of eager), the refusal names the least peak a plan rounded from
    the relaxation reaches, when lower, and a budget at the peak named is met."""
    import passes.budget_search as budget_search

    graph = random_cost_graph(random.Random(seed), 10)
    dynamic_floor = DynamicProgram(graph).smallest().peak_bytes
    relaxed = lowest_relaxed(graph, 0, dynamic_floor)
    assert relaxed is not None and relaxed.peak_bytes < dynamic_floor  # seeds with a gap to show
    monkeypatch.setattr(budget_search, "floors_below", lambda *args, **kwargs: (None, None))
    with pytest.raises(BudgetError) as raised:
        fit_budget(graph, int(0.2 * eager_peak(graph)), exact_seconds=0)
    error = raised.value
    assert error.strategy == "relaxed" and error.smallest_peak_bytes < dynamic_floor
    assert fit_budget(graph, error.smallest_peak_bytes, exact_seconds=0).peak_bytes <= error.smallest_peak_bytes


@pytest.mark.parametrize("seed", range(4))
def test_the_lowest_relaxed_plan_lies_between_the_bounds_given(seed: int) -> None:
    """:func:`passes.relaxed.lowest_relaxed` looks only under ``high`` and never claims a peak
    under what is known unreachable (the proven floor); none when the bounds are within 1%."""
    graph = random_cost_graph(random.Random(seed), 10)
    floor = true_floor(graph, time_limit=20)
    high = DynamicProgram(graph).smallest().peak_bytes
    assert floor is not None and floor.proven
    found = lowest_relaxed(graph, floor.lower_bound_bytes, high)
    assert found is None or floor.peak_bytes - 1 <= found.peak_bytes <= high
    assert lowest_relaxed(graph, high * 0.995, high) is None


@pytest.mark.parametrize(("ops", "seed"), [(40, 0), (50, 1)])
def test_a_refused_dag_names_a_peak_below_the_programs_that_a_budget_there_meets(
        ops: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at 0.2 of eager, a graph names a peak below the dynamic program's floor, and a
    budget at it is met. The 40-op DAG of seed 0: the floor solves find nothing below the plans
    in hand in their 5 s (the refusal named 0.36x of eager); a relaxed plan reaches the proven
    floor (0.30x on the machine this was written on). Graphs of 41 to 60 ops get no floor
    solve; the relaxation's rounding and the plans for budgets above the refused one are their
    look below: on the 50-op DAG of seed 1 the refusal named the dynamic program's 0.29x
    before, 0.21-0.22x now. The relaxation gets ample time here: what is checked is what a
    refusal does with its solves, not this CPU's speed."""
    import passes.relaxed

    monkeypatch.setattr(passes.relaxed, "RELAXED_SECONDS", 30.0)
    graph = random_cost_graph(random.Random(seed), ops)
    with pytest.raises(BudgetError) as raised:
        fit_budget(graph.copy(), int(0.2 * eager_peak(graph)))
    named = raised.value.smallest_peak_bytes
    assert named < DynamicProgram(graph).smallest().peak_bytes
    assert fit_budget(graph.copy(), named).peak_bytes <= named


def test_the_bisection_stops_at_the_first_relaxation_not_solved_in_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relaxation that times out says nothing of the budget: :func:`lowest_relaxed` stops
    there instead of spending its other steps on the same time-out, and a refusal whose
    relaxation timed out at the budget does not bisect at all."""
    import passes.budget_search
    import passes.relaxed
    from passes.checkmate import Relaxation

    asked: list[float] = []

    def timed_out(graph, budget_bytes: float, *, time_limit: float) -> Relaxation:
        asked.append(budget_bytes)
        return Relaxation(None, "time_limit")

    monkeypatch.setattr(passes.relaxed, "relaxation", timed_out)
    graph = random_cost_graph(random.Random(1), 50)
    high = DynamicProgram(graph).smallest().peak_bytes
    assert lowest_relaxed(graph, 0, high) is None and len(asked) == 1
    bisected: list[float] = []
    monkeypatch.setattr(passes.budget_search, "lowest_relaxed", lambda *args: bisected.append(1))
    with pytest.raises(BudgetError) as raised:
        fit_budget(graph.copy(), int(0.2 * eager_peak(graph)))
    assert raised.value.strategy != "relaxed" and not bisected


@pytest.mark.parametrize("seed", range(2))
def test_a_refusal_names_the_least_peak_of_the_plans_for_budgets_above_it_too(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100-op random DAG refused at 0.1 of eager: the plans for that budget alone peaked
    above what plans for budgets between it and their peak reach (0.36 / 0.33x of eager
    against 0.29 / 0.25x on the machine this was written on), so the refusal plans for those
    too (passes.refusal.lower_refusal) and names the lower peak; a budget there is met."""
    import passes.budget_search as budget_search

    graph = random_cost_graph(random.Random(seed), 100)
    budget = int(0.1 * eager_peak(graph))
    with monkeypatch.context() as patched, pytest.raises(BudgetError) as alone:
        patched.setattr(budget_search, "lower_refusal", lambda graph, refused, plan_for, **_: refused)
        fit_budget(graph.copy(), budget)
    with pytest.raises(BudgetError) as raised:
        fit_budget(graph.copy(), budget)
    named = raised.value.smallest_peak_bytes
    assert named < alone.value.smallest_peak_bytes
    assert fit_budget(graph.copy(), named).peak_bytes <= named


def test_a_plan_found_below_a_refusal_that_fits_it_says_so() -> None:
    """Planning for a budget between the refused one and the least peak named may find a plan
    fitting the refused budget after all (what a plan family reaches depends on the budget
    it is asked for): it is the answer, and its first note says how it was found; the user's
    progress is told of each planning."""
    from passes.refusal import lower_refusal

    graph = random_cost_graph(random.Random(0), 30)
    roomy = fit_budget(graph.copy(), eager_peak(graph), exact_seconds=0)
    tight = fit_budget(graph.copy(), int(0.6 * eager_peak(graph)), exact_seconds=0)
    refused = unreachable(graph, tight.peak_bytes, [roomy])  # as if only the roomy plan had been found
    told: list[tuple[int, int]] = []
    answer = lower_refusal(graph, refused, lambda budget: tight, steps=2, progress=lambda *report: told.append(report))
    assert answer.segments == tight.segments
    assert told == [(0, 2), (1, 2)]  # each planning reported (the second bisection step is not needed)
    assert "looking below that refusal" in answer.notes[0] and answer.notes[1:] == tight.notes
