"""Local search over plans of small graphs (:mod:`passes.search`): what it returns is a valid
plan, no worse than where it started, the same on every run, and fit_budget uses it to meet
budgets below the dynamic program's floor."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphckpt.tools.random_dags import random_cost_graph
from passes.budget import BudgetError
from passes.budget_search import fit_budget
from passes.optimal import DynamicProgram
from passes.search import SEARCH_MAX_OPS, PlanLayout, build, layout_of, search, unread
from passes.segments import PlanError, validate_plan
from passes.simulate import eager_peak


@pytest.mark.parametrize("seed", range(4))
def test_layout_of_a_two_level_plan_builds_it_again(seed: int) -> None:
    graph = random_cost_graph(random.Random(seed), 16)
    plan = DynamicProgram(graph).smallest()
    if max(s.depth for s in plan.segments) > 2:
        pytest.skip("deeper nesting is read as one child")
    segments = build(graph, layout_of(graph, plan.segments))
    validate_plan(graph, segments)
    assert segments == plan.segments


@pytest.mark.parametrize("seed", range(4))
def test_search_is_no_worse_than_its_start_and_repeatable(seed: int) -> None:
    graph = random_cost_graph(random.Random(seed), 16)
    start = DynamicProgram(graph).smallest()
    budget = start.peak_bytes
    found = search(graph, [start], budget)
    assert found is not None and found.peak_bytes <= budget and found.cost_key <= start.cost_key
    assert search(graph, [start], budget) == found


def test_search_meets_a_budget_below_the_programs_floor() -> None:
    """Random DAG 11 of seed 0 (planner_gap's family): the MILP meets half of eager's peak; the
    dynamic program's floor is 0.53x and the flat plans' above it; a plan below it fits (now the
    plan dropping values, :mod:`passes.drops`, which the search starts from)."""
    rng = random.Random(0)
    graph = [random_cost_graph(rng, 16) for _ in range(12)][11]
    budget = int(0.5 * eager_peak(graph))
    assert DynamicProgram(graph).smallest().peak_bytes > budget
    plan = fit_budget(graph, budget)
    assert plan.peak_bytes <= budget and ("searched plan" in plan.notes[0] or "dropping values" in plan.notes[0])


def test_no_search_on_large_graphs() -> None:
    graph = random_cost_graph(random.Random(0), SEARCH_MAX_OPS + 1)
    plan = DynamicProgram(graph).smallest()
    assert search(graph, [plan], plan.peak_bytes) is None
    with pytest.raises(BudgetError):
        fit_budget(graph, int(0.05 * eager_peak(graph)))


@pytest.mark.parametrize("seed", range(3))
def test_climbs_going_on_never_end_worse(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """After its first climbs the search goes on from where each ended (FURTHER_PLANS plans
    scored) taking only plans no worse: its plan is never worse than the first climbs' alone."""
    import passes.search as searching

    graph = random_cost_graph(random.Random(seed), 40)
    starts = [DynamicProgram(graph).smallest()]
    budget = int(0.3 * eager_peak(graph))
    found = {}
    for further in (0, searching.FURTHER_PLANS):
        monkeypatch.setattr(searching, "FURTHER_PLANS", further)
        plan = search(graph, starts, budget)
        found[further] = (max(0, plan.peak_bytes - budget), *plan.cost_key)
    assert found[searching.FURTHER_PLANS] <= found[0]


def _built(graph, layout: PlanLayout) -> tuple | None:
    try:
        return build(graph, layout)
    except PlanError:
        return None


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), data=st.data())
def test_a_flag_called_unread_changes_no_plan(seed: int, data: st.DataObject) -> None:
    """The search skips building a flip :func:`passes.search.unread` calls unread, as if the
    build had given the current plan: on random layouts of random DAGs, the flip builds the
    same segments (or is no plan either way)."""
    graph = random_cost_graph(random.Random(seed), 12)
    n = 12
    flags = data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=6, max_size=6))
    flags[0][0] = True
    layout = PlanLayout(*flags)
    before = _built(graph, layout)
    for kind in range(6):
        for position in range(1 if kind in (0, 2) else 0, n):
            if not unread(graph, layout, kind, position):
                continue
            flipped = layout.flags()[kind]
            flipped[position] = not flipped[position]
            assert _built(graph, layout) == before, (kind, position)
            flipped[position] = not flipped[position]


def test_search_seeds_stops_at_the_first_seed_that_fits_and_else_keeps_the_lowest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeds are climbed in turn: the first plan fitting the budget ends it; where none fits
    the answer is the one least over, then cheapest."""
    from dataclasses import replace

    import passes.search
    from passes.search import search_seeds

    graph = random_cost_graph(random.Random(0), 16)
    plan = DynamicProgram(graph).smallest()
    peaks = {0: 120, 1: 110, 2: 100, 3: 90}
    climbed: list[int] = []

    def climb(graph, starts, budget_bytes, seed=0, remat=True):
        climbed.append(seed)
        return replace(plan, peak_bytes=peaks[seed])

    monkeypatch.setattr(passes.search, "search", climb)
    assert search_seeds(graph, [plan], 100, 4).peak_bytes == 100 and climbed == [0, 1, 2]
    climbed.clear()
    assert search_seeds(graph, [plan], 50, 3).peak_bytes == 100 and climbed == [0, 1, 2]
    climbed.clear()
    assert search_seeds(graph, [plan], 50, 1).peak_bytes == 120 and climbed == [0]


def test_a_budget_below_every_plan_in_hand_tries_more_seeds_where_no_floor_is_solved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fit_budget climbs from :data:`passes.search.SEEDS_BELOW_FLOOR` seeds where the exact
    solver gives no floor (``exact_seconds=0``, or more than 40 ops), one seed where it does."""
    import passes.budget_search
    from passes.search import SEEDS_BELOW_FLOOR

    asked: list[int] = []
    real = passes.budget_search.search_seeds

    def counted(graph, starts, budget_bytes, seeds):
        asked.append(seeds)
        return real(graph, starts, budget_bytes, seeds)

    monkeypatch.setattr(passes.budget_search, "search_seeds", counted)
    graph = random_cost_graph(random.Random(1), 16)
    below = DynamicProgram(graph).smallest().peak_bytes // 4
    for exact_seconds, seeds in ((0, SEEDS_BELOW_FLOOR), (0.5, 1)):
        asked.clear()
        with pytest.raises(BudgetError):
            fit_budget(graph, below, exact_seconds=exact_seconds)
        assert asked[0] == seeds  # the plans for the budget; a refusal then plans for budgets above it
        # without the exact solver (passes.refusal.lower_refusal), each with SEEDS_BELOW_FLOOR
