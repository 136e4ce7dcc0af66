"""The optimal pass: nested plans that fit a budget with the least recompute.

Three layers of checks: the dynamic program equals a brute force over its own plan space
(every tree of nested segments over the chain's stages, priced by the same model); the
plans it builds fit the budget by the simulator and recompute no more than the heuristics
that fit too; and nested plans run in torch exactly like eager.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphckpt.api import analyze
from graphckpt.codegen import generate
from graphckpt.tools import zoo
from passes.budget import BudgetError
from passes.budget_search import fit_budget
from passes.chain import Chain, build_chain
from passes.dp_table import KEPT, RECOMPUTED, SELECTIVE, SLOTS, Table, recompute_cost, selective_cost, slots, solve
from passes.graph_facts import op_nodes
from passes.optimal import DynamicProgram, children, memory_unit, plan_for_budget
from passes.simulate import eager_peak
from passes.strategies import choose_plan
from tests.cost_graph_draws import SETTINGS, cost_graphs
from tests.equivalence import assert_trains_like, assert_trains_like_twice, fresh_pair, zoo_pair
from tests.thorough import examples

BRUTE_FORCE_SLOTS = 40


@st.composite
def graphs_with_matmuls(draw, max_ops: int = 20):
    """Random cost graphs where some ops are matmul/convolution outputs (``expensive``)."""
    graph = draw(cost_graphs(max_ops=max_ops))
    for name in op_nodes(graph):
        graph.nodes[name]["expensive"] = draw(st.integers(0, 3)) == 0
    return graph


# --- the program against a brute force over the same plan space ----------------------------

def sequences(chain: Chain, i: int, j: int) -> Iterator[list]:
    """Every way to run stages ``[i, j)`` as children: a first child ``[i, k)`` kept,
    recomputed (with any children of its own) or selective, then the rest; or one kept child."""
    yield [(KEPT, i, j, [])]
    for k in range(i + 1, j):
        firsts = [(KEPT, i, k, [])]
        if chain.recomputable(i, k):
            firsts += [(RECOMPUTED, i, k, inner) for inner in sequences(chain, i, k)]
            if chain.expensive_bytes(i, k):
                firsts.append((SELECTIVE, i, k, []))
        for first in firsts:
            for rest in sequences(chain, k, j):
                yield [first, *rest]


def price(chain: Chain, unit: float, children: list, finish: float = 0.0) -> tuple[int, float]:
    """(slots needed, recompute) of running ``children`` in order then backward in reverse:
    while a child's backward runs, the children before it hold what they keep and it holds
    its own work plus the gradient of its output; the last child also holds ``finish``."""
    need, held, cost = 0, 0, 0.0
    for index, (kind, i, k, inner) in enumerate(children):
        if index == len(children) - 1:
            need = max(need, held + slots(chain.stored(i, k) + max(chain.working(i, k), finish), unit))
            break
        boundary = slots(chain.boundaries[k - 1], unit)
        own = slots(chain.stored(i, k) + chain.working(i, k), unit) + boundary
        if kind == KEPT:
            need, held = max(need, held + own), held + slots(chain.stored(i, k), unit)
        elif kind == RECOMPUTED:
            inner_need, inner_cost = price(chain, unit, inner)
            need, held = max(need, held + boundary + inner_need), held + boundary
            cost += recompute_cost(chain, i, k) + inner_cost
        else:
            need, held = max(need, held + own), held + boundary + slots(chain.expensive_bytes(i, k), unit)
            cost += selective_cost(chain, i, k)
    return need, cost


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs_with_matmuls(max_ops=5))
def test_program_equals_brute_force_over_its_plan_space(graph) -> None:
    chain = build_chain(graph)
    unit = memory_unit(chain, eager_peak(graph), BRUTE_FORCE_SLOTS)
    table = solve(chain, unit, BRUTE_FORCE_SLOTS)
    priced = [price(chain, unit, tree, chain.finish) for tree in sequences(chain, 0, chain.stages)]
    top = table.top[0]
    for m in range(BRUTE_FORCE_SLOTS + 1):
        expected = min((cost for need, cost in priced if need <= m), default=math.inf)
        assert top[m] == pytest.approx(expected, rel=1e-9, abs=1e-6), f"{m} free slots"
        if math.isfinite(top[m]):
            need, cost = price(chain, unit, children(table, 0, chain.stages, m, top=True), chain.finish)
            assert need <= m and cost == pytest.approx(top[m], rel=1e-9, abs=1e-6), "rebuilt plan differs from its price"



@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs_with_matmuls(max_ops=12), st.lists(st.integers(0, BRUTE_FORCE_SLOTS), max_size=4))
def test_a_table_grown_in_steps_is_the_table_solved_at_once(graph, steps: list[int]) -> None:
    """A budget's program solves its table only up to the memory its plans ask for
    (:meth:`Table.extend`); an answer at ``m`` reads only answers at ``m`` or less, so growing
    the table in any steps gives every answer and choice of the whole table."""
    chain = build_chain(graph)
    unit = memory_unit(chain, eager_peak(graph), BRUTE_FORCE_SLOTS)
    whole, grown = solve(chain, unit, BRUTE_FORCE_SLOTS), Table(chain, unit, BRUTE_FORCE_SLOTS)
    for index, m in enumerate(steps):
        grown.extend(m)
        assert grown.solved == max(steps[: index + 1]) + 1
        np.testing.assert_array_equal(grown.top[:, :m + 1], whole.top[:, :m + 1])
    grown.extend(BRUTE_FORCE_SLOTS)
    for name in ("least", "choice", "top", "top_choice"):
        np.testing.assert_array_equal(getattr(grown, name), getattr(whole, name), err_msg=name)


def test_a_budget_plans_from_part_of_the_table() -> None:
    """At a third of eager's memory on a 64-op chain, the program asked for that budget
    solves less than the whole table and returns the plan the whole table gives."""
    from tests.test_budget import chain as chain_graph

    graph = chain_graph(64, [100])
    budget = eager_peak(graph) / 3
    whole, within = DynamicProgram(graph), DynamicProgram(graph, within_bytes=budget)
    assert within.table.solved < whole.table.solved == whole.slot_count + 1
    assert plan_for_budget(within, budget).segments == plan_for_budget(whole, budget).segments

# --- plans judged by the simulator ---------------------------------------------------------

FEWER = settings(SETTINGS, max_examples=examples(30))  # fit_budget: ~1.4 s an example


@FEWER
@given(graphs_with_matmuls(), st.floats(0.05, 1.0))
def test_optimal_fits_the_budget_and_recomputes_no_more_than_heuristics(graph, fraction: float) -> None:
    budget = int(fraction * eager_peak(graph))
    heuristics = [choose_plan(graph, name) for name in ("sqrt", "articulation", "mincut")]
    fitting = [p for p in heuristics if p.peak_bytes <= budget]
    try:
        plan = fit_budget(graph, budget)
    except BudgetError as error:
        assert not fitting, f"{[p.strategy for p in fitting]} fit but optimal says: {error}"
        return
    assert plan.peak_bytes <= budget
    for other in fitting:
        assert (plan.recompute_flops, plan.recompute_bytes) <= (other.recompute_flops, other.recompute_bytes), other.strategy


@FEWER
@given(graphs_with_matmuls())
def test_optimal_without_budget_matches_auto_memory_with_no_more_recompute(graph) -> None:
    auto, optimal = choose_plan(graph, "auto"), choose_plan(graph, "optimal")
    assert optimal.peak_bytes <= auto.peak_bytes
    assert (optimal.recompute_flops, optimal.recompute_bytes) <= (auto.recompute_flops, auto.recompute_bytes)


def test_deep_chain_nests_below_the_flat_minimum() -> None:
    """Chen et al.'s recursive regime: on a long chain the program's smallest plan nests
    segments and goes well below the best flat (√n) plan."""
    from tests.test_budget import chain as chain_graph

    graph = chain_graph(64, [100])
    smallest = DynamicProgram(graph).smallest()
    flat = min((choose_plan(graph, s, count) for s in ("sqrt", "mincut") for count in range(2, 17)),
               key=lambda p: p.peak_bytes)
    assert max(s.depth for s in smallest.segments) >= 3
    assert smallest.peak_bytes <= 0.75 * flat.peak_bytes


@pytest.mark.parametrize("size", [100, 4 * 2**20, 3 * 2**20 + 7])
def test_a_chain_of_equal_values_fills_whole_slots(size: int) -> None:
    """Slots round each value up; when most activation bytes are values of one size, the
    unit divides that size, so the program does not pay for more than a value holds."""
    from tests.test_budget import chain as chain_graph

    program = DynamicProgram(chain_graph(32, [size]))
    unit = program.table.unit
    assert size / unit == pytest.approx(round(size / unit), abs=1e-6)
    assert SLOTS <= program.slot_count <= 2 * SLOTS + 1
    assert program.slot_count * unit >= eager_peak(program.graph) - 1e-6


# --- nested plans in torch -------------------------------------------------------------------

@pytest.mark.parametrize("name", zoo.names())
def test_nested_plans_train_like_eager(name: str) -> None:
    """The program's smallest plan (the deepest nesting it builds) on every zoo model:
    outputs, gradients, BatchNorm buffers and dropout equal to eager over two steps."""
    reference, model, inputs = zoo_pair(name)
    analysis = analyze(model, inputs, strategy="sqrt")
    plan = DynamicProgram(analysis.cost_graph).smallest()
    rewritten = generate(analysis.captured.graph_module, model, plan)
    if name in ("mlp", "gpt", "densenet"):
        assert max(s.depth for s in plan.segments) >= 2, "expected nesting"
        assert "self.segment_0_0(" in rewritten.code or "segment_1_0(" in rewritten.code
    assert_trains_like_twice(reference, model, rewritten, inputs)


def test_slow_planning_shows_a_progress_bar_on_a_terminal() -> None:
    import io

    from rich.console import Console

    from graphckpt.progress import planning_progress
    from tests.test_budget import chain as chain_graph

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    with planning_progress("planning 130 nodes", show_after=0.0, console=console) as progress:
        DynamicProgram(chain_graph(128, [100]), progress=progress)
    assert "planning 130 nodes" in screen.getvalue()
    quiet = io.StringIO()
    with planning_progress("fast", show_after=60.0, console=Console(file=quiet, force_terminal=True)) as progress:
        DynamicProgram(chain_graph(8, [100]), progress=progress)
    assert quiet.getvalue() == ""


def test_measured_op_times_as_the_recompute_cost() -> None:
    """cost="time": every op costs its measured forward time (pointwise ops too), the plan
    says so, the model's buffers are not touched by the timing runs, and it trains like eager."""
    reference, model = fresh_pair(zoo.make("resnet")[0])
    inputs = zoo.make("resnet")[1]
    analysis = analyze(model, inputs, budget=0.9, cost="time")
    graph, plan = analysis.cost_graph, analysis.plan
    assert graph.graph["cost_unit"] == "ns" and plan.cost_unit == "ns" and "of forward ns" in str(plan)
    assert all(graph.nodes[n]["flops"] > 0 for n in op_nodes(graph) if graph.nodes[n]["label"].startswith("relu"))
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, dict(reference.named_buffers())[name]), f"timing changed {name}"
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert_trains_like(reference, model, rewritten, inputs)
    with pytest.raises(ValueError, match="unknown cost"):
        analyze(model, inputs, cost="joules")
