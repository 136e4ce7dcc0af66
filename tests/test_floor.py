"""The true floor (:mod:`passes.floor`): the least peak any recompute schedule reaches, named by
BudgetError beside the floor of graphckpt's own plans when it is lower."""

from __future__ import annotations

import math
import random

import pytest

from passes.budget import BudgetError
from passes.budget_search import fit_budget
from passes.checkmate import checkmate_schedule
from passes.floor import FLOOR_MAX_OPS, true_floor
from passes.optimal import DynamicProgram
from passes.simulate import eager_peak
from scripts.planner_gap import random_cost_graph


@pytest.mark.parametrize("seed", range(3))
def test_true_floor_is_below_every_plan_and_reachable(seed: int) -> None:
    graph = random_cost_graph(random.Random(seed), 10)
    floor = true_floor(graph, time_limit=20)
    assert floor is not None and floor.proven
    assert floor.peak_bytes <= DynamicProgram(graph).smallest().peak_bytes
    assert checkmate_schedule(graph, floor.peak_bytes + 1, time_limit=20) is not None  # a schedule meets it
    assert checkmate_schedule(graph, floor.peak_bytes * 0.98, time_limit=20) is None  # and nothing below


def test_budget_error_names_both_floors() -> None:
    # Seed 1's graph had a gap until plans could rematerialize inputs: its plans now reach
    # the true floor (test_plans_reach_the_true_floor_of_a_graph_they_missed); seed 2's has one.
    graph = random_cost_graph(random.Random(2), 10)
    smallest = DynamicProgram(graph).smallest().peak_bytes
    floor = true_floor(graph, time_limit=20)
    assert floor is not None and floor.peak_bytes < smallest  # this graph has a gap to show
    with pytest.raises(BudgetError) as raised:
        fit_budget(graph, int(floor.peak_bytes) - 1)
    error = raised.value
    assert error.true_floor_bytes is not None and error.true_floor_bytes < error.smallest_peak_bytes
    assert "true floor" in str(error) and "does not meet" in str(error)


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


def test_no_true_floor_on_large_graphs() -> None:
    graph = random_cost_graph(random.Random(0), FLOOR_MAX_OPS + 1)
    assert true_floor(graph) is None
    with pytest.raises(BudgetError) as raised:
        fit_budget(graph, int(0.05 * eager_peak(graph)))
    assert raised.value.true_floor_bytes is None and "true floor" not in str(raised.value)
