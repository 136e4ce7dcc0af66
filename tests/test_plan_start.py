"""Tests of reading a plan as the exact solver's start (:mod:`passes.plan_start`): pure
networkx and HiGHS, no torch."""

from __future__ import annotations

import math

import networkx as nx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from passes.budget import BudgetError
from passes.budget_search import fit_budget
from passes.checkmate import build_milp, pin_executable, recompute_objective, remakeable_extras
from passes.costgraph import add_value, check_cost_graph
from passes.exact import schedule_of
from passes.plan_start import plan_makes, start_columns, start_schedule
from passes.simulate import eager_peak, simulate
from passes.strategies import choose_plan
from passes.training_graph import stage_peaks, training_graph
from tests.cost_graph_draws import SETTINGS, CostGraph, cost_graphs
from tests.milp_graphs import UNIT, chain


def _recompute(training, R) -> int:
    """Forward FLOPs a schedule runs beyond one forward."""
    first = training.n_forward
    return sum(training.flops[i] * R[t][i] for t in range(training.size) for i in range(first)) - sum(
        training.flops[:first])


def _read_plan(graph, plan, extras: bool = True):
    """The plan read as a schedule: (training graph, R, S), or ``None``."""
    training = training_graph(graph)
    with_extra = remakeable_extras(graph) if extras else frozenset()
    read = start_schedule(graph, training, plan_makes(graph, plan.segments), with_extra)
    return None if read is None else (training, *read)


@pytest.mark.parametrize("strategy", ["sqrt", "articulation", "mincut", "blocks", "auto"])
def test_a_chain_plan_reads_as_the_schedule_it_runs(strategy: str) -> None:
    """On a chain each strategy's plan reads as a schedule recomputing what the plan does,
    peaking where the simulator says the plan peaks, and the runtime can run it."""
    graph = chain(12)
    plan = choose_plan(graph, strategy)
    training, R, S = _read_plan(graph, plan)
    simulated = simulate(graph, plan.segments)
    assert _recompute(training, R) == simulated.recompute_flops
    assert max(stage_peaks(training, R, S)) == simulated.peak_bytes
    schedule_of(graph, training, R, S)  # raises ScheduleError where it could not run


def no_grad_op_saving_a_recomputed_value() -> CostGraph:
    """Found by the property test below in CI: ``op10`` takes no gradient but saves ``op8``,
    which the plan at 0.8 of eager recomputes before ``op10``'s backward; read as made before
    the next op taking a gradient (``op9``), the reading made ``op8`` twice (2074 FLOPs for
    the plan's 1454)."""
    graph = CostGraph(measured=True)
    add_value(graph, "x0", kind="input", order=0, bytes=0, saves_from="nothing")
    add_value(graph, "x1", kind="input", order=1, bytes=19, saves_from="nothing")
    x0, x1, outputs, inputs = ["x0"], ["x0", "x1"], "outputs", "inputs"
    for order, name, reads, attributes in (
            (2, "op0", x1, dict(alias_of="x0", flops=256, saved=("x0",), saves_from=inputs)),
            (3, "op1", x0, dict(alias_of="x0", saved=("op1",), saves_from=outputs)),
            (4, "op2", x1, dict(alias_of="x0", saves_from="nothing")),
            (5, "op3", x0, dict(alias_of="x0", saves_from="nothing")),
            (6, "op4", x0, dict(alias_of="x0", saved=("op4",), saves_from=outputs)),
            (7, "op5", x0, dict(alias_of="x0", flops=903, saved=("x0",), saves_from=inputs)),
            (8, "op6", [*x1, "op0"], dict(flops=938, saved=("x0", "x1", "op0"), saves_from=inputs)),
            (9, "op7", x0, dict(flops=640, saved=("x0", "op7"), saves_from=outputs)),
            (10, "op8", x1, dict(bytes=51, flops=620, saved=("op8",), saves_from=outputs)),
            (11, "op9", x0, dict(alias_of="x0", flops=699, saved=("x0", "op9"), saved_extra_bytes=41,
                                 saves_from=outputs)),
            (12, "op10", ["x0", "op8"], dict(flops=510, saved=("op8",), requires_grad=False, saves_from=inputs)),
            (13, "op11", x0, dict(bytes=80, flops=135, saved=("x0",), saved_extra_bytes=44, saves_from=outputs))):
        add_value(graph, name, kind="op", order=order, reads=reads, **{"bytes": 0, **attributes})
    add_value(graph, "output", kind="output", order=14, bytes=0, saves_from="nothing",
              reads=["op1", "op2", "op3", "op4", "op5", "op6", "op7", "op9", "op10", "op11"])
    return graph


@given(graph=cost_graphs(max_ops=14), fraction=st.sampled_from([0.4, 0.6, 0.8]))
@example(graph=no_grad_op_saving_a_recomputed_value(), fraction=0.8)
@SETTINGS
def test_a_budget_plan_reads_as_a_schedule_no_dearer_and_no_higher(graph, fraction: float) -> None:
    """A budget plan on a random cost graph, read as a schedule, recomputes at most what the
    plan does and peaks at most where the simulator says the plan does, and the solver's
    rows hold it: the start is a schedule the solve may answer with, at the plan's cost or
    less."""
    budget = int(fraction * eager_peak(graph))
    try:
        plan = fit_budget(graph, budget, exact_seconds=0)
    except BudgetError:
        return
    read = _read_plan(graph, plan)
    if read is None:  # (a random op made again, or one needed before any hook)
        return
    training, R, S = read
    assert _recompute(training, R) <= plan.recompute_flops
    assert max(stage_peaks(training, R, S), default=0) <= plan.peak_bytes
    model = build_milp(training, plan.peak_bytes)
    pin_executable(model, training, graph)
    fixed = start_columns(model, R, S)
    assert fixed is not None
    solved = model.fixed(fixed).solve(recompute_objective(model, training), 10)
    assert solved.x is not None
    divisor = math.gcd(*training.flops) or 1
    assert round(solved.objective * divisor) - sum(training.flops[:training.n_forward]) == _recompute(training, R)


def _chain_with_an_extra() -> nx.DiGraph:
    """A chain of 8 ops whose third saves an extra (as max-pool saves its indices)."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=UNIT, requires_grad=False)
    previous = "x"
    for index in range(8):
        add_value(graph, f"a{index}", kind="op", order=index + 1, bytes=UNIT, reads=[previous], flops=1,
                  saved=(previous,), saved_extra_bytes=UNIT // 2 if index == 2 else 0)
        previous = f"a{index}"
    add_value(graph, "loss", kind="op", order=9, bytes=0, reads=[previous])
    add_value(graph, "output", kind="output", order=10, bytes=0, reads=["loss"])
    check_cost_graph(graph)
    return graph


def test_an_extra_made_again_only_where_the_solve_may_make_it() -> None:
    """A plan recomputing the op with the extra reads as a schedule making the extra again
    with its op, which the solve that may make extras takes; the one holding every extra
    gets no start (none is read for it, and its columns refuse one read for the other)."""
    graph = _chain_with_an_extra()
    plan = choose_plan(graph, "sqrt")
    assert any(s.recompute and "a2" in s.nodes for s in plan.segments)
    assert _read_plan(graph, plan, extras=False) is None
    training, R, S = _read_plan(graph, plan)
    extra = training.extra_node(training.names.index("a2"))
    assert any(R[t][extra] for t in range(training.n_forward, training.size))
    for extras, accepted in ((True, True), (False, False)):
        model = build_milp(training, plan.peak_bytes)
        pin_executable(model, training, graph, extras=extras)
        assert (start_columns(model, R, S) is not None) == accepted


def test_a_plan_running_ops_out_of_the_graphs_order_is_not_read() -> None:
    """A plan may run first an op that reads nothing computed before it (here a view of an
    input with an extra, recomputed, ahead of a 57-byte op); a schedule runs forward in the
    graph's order, where that op's extra is made beside the other op's value: read as one,
    the plan would peak at 83 bytes where it peaks at 57 (found by the property test below
    in CI). Such a plan gives no start."""
    graph = nx.DiGraph(measured=True)
    add_value(graph, "x0", kind="input", order=0, bytes=0, requires_grad=False)
    add_value(graph, "p0", kind="param", order=1, bytes=0)
    add_value(graph, "op0", kind="op", order=2, bytes=57, reads=["p0"])
    add_value(graph, "op1", kind="op", order=3, bytes=0, reads=["x0"], alias_of="x0", saved_extra_bytes=26,
              saves_from="outputs")
    add_value(graph, "op2", kind="op", order=4, bytes=0, reads=["p0", "op0", "op1"])
    add_value(graph, "output", kind="output", order=5, bytes=0, reads=["op2"])
    check_cost_graph(graph)
    plan = fit_budget(graph, int(0.8 * eager_peak(graph)), exact_seconds=0)
    assert plan.segments[0].nodes == ("op1",)  # moved ahead of op0
    assert plan_makes(graph, plan.segments).in_order is False
    assert _read_plan(graph, plan) is None


def test_a_reading_peaking_above_its_plan_is_no_start() -> None:
    """Views of one input with extras (found by the property test below in CI): the reading
    of the budget plan peaked at 226 bytes in the solver's memory model where the plan peaks
    at 220; such a reading is no start (the solve would only find its rows refuse it)."""
    graph = nx.DiGraph(measured=True)
    add_value(graph, "x0", kind="input", order=0, bytes=39, requires_grad=False)
    add_value(graph, "x1", kind="input", order=1, bytes=0, requires_grad=False)
    add_value(graph, "p0", kind="param", order=2, bytes=0)
    add_value(graph, "op0", kind="op", order=3, bytes=0, reads=["x0"], alias_of="x0", requires_grad=False)
    add_value(graph, "op1", kind="op", order=4, bytes=0, reads=["x0"], alias_of="x0")
    add_value(graph, "op2", kind="op", order=5, bytes=44, reads=["x0"], saved_extra_bytes=13, saves_from="outputs")
    add_value(graph, "op3", kind="op", order=6, bytes=0, reads=["p0", "op1"], saved_extra_bytes=42,
              saves_from="outputs")
    add_value(graph, "output", kind="output", order=7, bytes=0, reads=["op0", "op2", "op3"])
    check_cost_graph(graph)
    plan = fit_budget(graph, int(0.8 * eager_peak(graph)), exact_seconds=0)
    read = _read_plan(graph, plan)
    assert read is None or max(stage_peaks(*read)) <= plan.peak_bytes
