"""Properties of the Checkmate MILP (:mod:`passes.checkmate`) on random small cost graphs:
its schedules are valid, least and monotone in the budget, and no strategy's plan beats it at
the plan's own peak. Pure networkx, no torch."""

from __future__ import annotations

from itertools import pairwise

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passes.checkmate import checkmate_schedule
from passes.costgraph import add_value, check_cost_graph
from passes.graph_facts import op_nodes
from passes.plan import Plan
from passes.simulate import eager_segments, simulate
from passes.strategies import STRATEGIES, choose_plan
from passes.training_graph import no_recompute_peak
from tests.milp_graphs import assert_valid_schedule, small_cost_graphs
from tests.thorough import examples

pytestmark = pytest.mark.full_solver_time  # the MILP's answers: proofs of least recompute, monotone in the budget


def least_budget(graph: nx.DiGraph) -> int:
    """The least integer budget with a schedule, by bisection (feasibility grows with the budget)."""
    low, high = 0, int(no_recompute_peak(graph))
    while low < high:
        middle = (low + high) // 2
        if checkmate_schedule(graph, middle) is None:
            low = middle + 1
        else:
            high = middle
    return low


def check_monotone(graph: nx.DiGraph, fractions: list[float]) -> None:
    """From the least budget that fits up to the no-recompute peak, each schedule is valid
    and optimal, and recompute never grows with the budget."""
    peak, least = int(no_recompute_peak(graph)), least_budget(graph)
    budgets = sorted({least + round(f * (peak - least)) for f in fractions} | {least, peak})
    results = [checkmate_schedule(graph, budget, time_limit=20) for budget in budgets]
    assert results[-1] is not None and results[-1].recompute_flops == 0
    if least > 0:
        assert checkmate_schedule(graph, least - 1) is None
    for budget, result in zip(budgets, results, strict=True):
        assert result is not None and result.status == "optimal"
        assert_valid_schedule(graph, result, budget)
    for smaller, larger in pairwise(results):
        assert larger.recompute_flops <= smaller.recompute_flops


def in_run_order(graph: nx.DiGraph, plan: Plan) -> nx.DiGraph:
    """A copy of ``graph`` whose ops' ``order`` is the order ``plan`` runs them in (its
    segments one after another). The MILP schedules ops in ``order``; a plan may run an op
    later than eager does (an op reading only a weight, put in a later segment), and its peak
    may then be below every schedule in eager order."""
    ordered = graph.copy()
    slots = sorted(graph.nodes[name]["order"] for name in op_nodes(graph))
    run = [name for segment in plan.segments for name in segment.nodes]
    for name, slot in zip(run, slots, strict=True):
        ordered.nodes[name]["order"] = slot
    return ordered


def check_strategies(graph: nx.DiGraph, segments: int | None) -> None:
    """Each plan's run (its simulated peak, its recompute) is one of the schedules the MILP
    searches over the ops in the plan's order, so the MILP at that peak fits and recomputes
    no more."""
    for strategy in sorted(STRATEGIES):
        plan = choose_plan(graph, strategy, segments)
        result = checkmate_schedule(in_run_order(graph, plan), plan.peak_bytes, time_limit=20)
        assert result is not None and result.status == "optimal", strategy
        assert result.recompute_flops <= plan.recompute_flops, strategy


def test_a_plan_running_an_op_later_than_eager_is_checked_in_its_own_order() -> None:
    """Found by hypothesis: op2 reads only a weight and saves a 5-byte extra; the mincut plan
    runs it after op3, so its extra is gone before op3's backward, at a peak (140 B) no
    schedule in eager order reaches."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=28)
    add_value(graph, "w", kind="param", order=1, bytes=0)
    add_value(graph, "op0", kind="op", order=2, bytes=1, reads=["w"])
    add_value(graph, "op1", kind="op", order=3, bytes=29, reads=["op0"])
    add_value(graph, "op2", kind="op", order=4, bytes=1, reads=["w"], saved_extra_bytes=5, flops=1)
    add_value(graph, "op3", kind="op", order=5, bytes=15, reads=["op1", "x"], saved=("op1",), param_grad_bytes=30)
    add_value(graph, "op4", kind="op", order=6, bytes=1, reads=["op3"], saved=("op3",), grad_views=True)
    add_value(graph, "op5", kind="op", order=7, bytes=22, reads=["op4"])
    add_value(graph, "output", kind="output", order=8, bytes=0, reads=["op2", "op5"])
    check_cost_graph(graph)
    plan = choose_plan(graph, "mincut", None)
    run = [name for segment in plan.segments for name in segment.nodes]
    assert run.index("op2") > run.index("op3")
    assert checkmate_schedule(graph, plan.peak_bytes, time_limit=20) is None
    check_strategies(graph, None)


FEW = settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
FRACTIONS = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3)
SEGMENTS = st.sampled_from([None, 2, 3])


@FEW
@given(graph=small_cost_graphs(), fractions=FRACTIONS)
def test_recompute_is_monotone_in_the_budget(graph: nx.DiGraph, fractions: list[float]) -> None:
    check_monotone(graph, fractions)


@FEW
@given(graph=small_cost_graphs(), segments=SEGMENTS)
def test_no_strategy_beats_checkmate_at_its_own_peak(graph: nx.DiGraph, segments: int | None) -> None:
    check_strategies(graph, segments)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_cost_graphs(autocast=True))
def test_no_recompute_peak_is_the_simulators_eager_peak(graph: nx.DiGraph) -> None:
    assert no_recompute_peak(graph) == simulate(graph, eager_segments(graph)).eager_peak_bytes


@pytest.mark.slow
@MANY
@given(graph=small_cost_graphs(), fractions=FRACTIONS)
def test_recompute_is_monotone_in_the_budget_many(graph: nx.DiGraph, fractions: list[float]) -> None:
    check_monotone(graph, fractions)


@pytest.mark.slow
@MANY
@given(graph=small_cost_graphs(), segments=SEGMENTS)
def test_no_strategy_beats_checkmate_at_its_own_peak_many(graph: nx.DiGraph, segments: int | None) -> None:
    check_strategies(graph, segments)
