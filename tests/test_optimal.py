"""The optimal pass: nested plans that fit a budget with the least recompute.

Three layers of checks: the dynamic program equals a brute force over its own plan space
(every tree of nested segments over the chain's stages, priced by the same model); the
plans it builds fit the budget by the simulator and recompute no more than the heuristics
that fit too; and nested plans run in torch exactly like eager.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphckpt.api import analyze
from graphckpt.codegen import generate
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from passes.budget import BudgetError
from passes.budget_search import fit_budget
from passes.chain import Chain, build_chain
from passes.costgraph import add_value
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

def sequences(chain: Chain, i: int, j: int, top: bool = False) -> Iterator[list]:
    """Every way to run stages ``[i, j)`` as children: a first child ``[i, k)`` kept,
    recomputed (with any children of its own) or selective, then the rest; or one kept child;
    at the end of the forward (``top``, a tight table's) also one recomputed or selective child."""
    yield [(KEPT, i, j, [])]
    if top and j == chain.stages and math.isfinite(chain.boundaries[-1]) and chain.recomputable(i, j):
        yield from ([(RECOMPUTED, i, j, inner)] for inner in sequences(chain, i, j))
        if chain.expensive_bytes(i, j):
            yield [(SELECTIVE, i, j, [])]
    for k in range(i + 1, j):
        firsts = [(KEPT, i, k, [])]
        if chain.recomputable(i, k):
            firsts += [(RECOMPUTED, i, k, inner) for inner in sequences(chain, i, k)]
            if chain.expensive_bytes(i, k):
                firsts.append((SELECTIVE, i, k, []))
        for first in firsts:
            for rest in sequences(chain, k, j, top):
                yield [first, *rest]


def price(chain: Chain, unit: float, children: list, finish: float | None = None,
          tight: bool = True) -> tuple[int, float]:
    """(slots needed, recompute) of running ``children`` in order then backward in reverse:
    while a child's backward runs, the children before it hold what they keep and it holds
    its own work plus the gradient of its output. In a ``tight`` table a recomputed child's
    backward comes after the rest's, which consumed the gradient of the children's output:
    that memory is its again, up to its own output's gradient. The whole forward's children
    (``finish`` given) have the loss's ``finish`` on top of the last child, which may be
    recomputed or selective (keeping only the forward's output through the loss)."""
    need, held, cost = 0, 0, 0.0
    end = children[-1][2]
    last = chain.boundaries[end - 1]  # the output of the forward may be no cut: nothing freed counted
    freed = 0 if finish is not None or not tight or not math.isfinite(last) else slots(last, unit)
    for index, (kind, i, k, inner) in enumerate(children):
        if index == len(children) - 1 and kind == KEPT:
            need = max(need, held + slots(chain.stored(i, k) + max(chain.working(i, k), finish or 0.0), unit))
            break
        boundary = slots(chain.boundaries[k - 1], unit)
        if index == len(children) - 1:  # the end of the forward, recomputed or selective
            loss = slots(finish, unit)
            if kind == RECOMPUTED:
                inner_need, inner_cost = price(chain, unit, inner, tight=tight)
                need = max(need, held + boundary + loss, held + boundary + inner_need)
                cost += recompute_cost(chain, i, k) + inner_cost
            else:
                own = slots(chain.stored(i, k) + chain.working(i, k), unit) + boundary
                need = max(need, held + own, held + boundary + slots(chain.expensive_bytes(i, k), unit) + loss)
                cost += selective_cost(chain, i, k)
            break
        own = slots(chain.stored(i, k) + chain.working(i, k), unit) + boundary
        if kind == KEPT:
            need, held = max(need, held + own), held + slots(chain.stored(i, k), unit)
        elif kind == RECOMPUTED:
            inner_need, inner_cost = price(chain, unit, inner, tight=tight)
            need = max(need, held + boundary - min(boundary, freed) + inner_need)
            held += boundary
            cost += recompute_cost(chain, i, k) + inner_cost
        else:
            need, held = max(need, held + own), held + boundary + slots(chain.expensive_bytes(i, k), unit)
            cost += selective_cost(chain, i, k)
    return need, cost


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs_with_matmuls(max_ops=5), st.booleans())
def test_program_equals_brute_force_over_its_plan_space(graph, tight: bool) -> None:
    chain = build_chain(graph)
    unit = memory_unit(chain, eager_peak(graph), BRUTE_FORCE_SLOTS)
    table = solve(chain, unit, BRUTE_FORCE_SLOTS, tight=tight)
    priced = [price(chain, unit, tree, chain.finish, tight)
              for tree in sequences(chain, 0, chain.stages, top=tight)]
    top = table.top[0]
    for m in range(BRUTE_FORCE_SLOTS + 1):
        expected = min((cost for need, cost in priced if need <= m), default=math.inf)
        assert top[m] == pytest.approx(expected, rel=1e-9, abs=1e-6), f"{m} free slots"
        if math.isfinite(top[m]):
            need, cost = price(chain, unit, children(table, 0, chain.stages, m, top=True), chain.finish, tight)
            assert need <= m and cost == pytest.approx(top[m], rel=1e-9, abs=1e-6), "rebuilt plan differs from its price"



@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs_with_matmuls(max_ops=12), st.lists(st.integers(0, BRUTE_FORCE_SLOTS), max_size=4), st.booleans())
def test_a_table_grown_in_steps_is_the_table_solved_at_once(graph, steps: list[int], tight: bool) -> None:
    """A budget's program solves its table only up to the memory its plans ask for
    (:meth:`Table.extend`); an answer at ``m`` reads only answers at ``m`` or less, so growing
    the table in any steps gives every answer and choice of the whole table."""
    chain = build_chain(graph)
    unit = memory_unit(chain, eager_peak(graph), BRUTE_FORCE_SLOTS)
    whole, grown = solve(chain, unit, BRUTE_FORCE_SLOTS, tight=tight), Table(chain, unit, BRUTE_FORCE_SLOTS, tight=tight)
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

def mlp_chain(layers: int, size: int = 64, matmul_flops: int = 100) -> nx.DiGraph:
    """Linear + GELU layers as the zoo MLP's cost graph has them: values of one size, each op
    saving its input, the matmuls ``expensive``, the GELUs free by FLOPs."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=size, requires_grad=False)
    previous = "x"
    for index in range(2 * layers):
        name = f"linear{index // 2}" if index % 2 == 0 else f"gelu{index // 2}"
        add_value(graph, name, kind="op", order=index + 1, bytes=size, reads=[previous],
                  flops=matmul_flops if index % 2 == 0 else 0, expensive=index % 2 == 0, saved=(previous,))
        previous = name
    add_value(graph, "output", kind="output", order=2 * layers + 1, bytes=0, reads=[previous])
    return graph


def test_a_tight_table_nests_a_chain_where_the_held_accounting_cannot() -> None:
    """At 0.3 of eager on a 10-layer MLP chain only a tight table has a plan: counting each
    enclosing range's output gradient held through its children's backward, the other pays
    one boundary per level of nesting and its floor is a third of eager. The tight plan
    reruns 12 matmuls (by simulation, within the budget); the exact solver's least is 9
    (its proven optimum on this graph, 60 s), and fit_budget's searches get 10 from it."""
    graph = mlp_chain(10)
    budget = 0.3 * eager_peak(graph)
    held, tight = DynamicProgram(graph, tight=False), DynamicProgram(graph)
    assert plan_for_budget(held, budget) is None
    plan = plan_for_budget(tight, budget)
    assert plan is not None and plan.peak_bytes <= budget
    assert plan.recompute_flops <= 12 * 100
    assert tight.smallest().peak_bytes <= 0.65 * held.smallest().peak_bytes
    top = plan.segments[-1]
    assert top.recompute and "gelu9" in top.nodes, "the end of the forward recomputed"
    assert fit_budget(graph, int(budget)).recompute_flops <= plan.recompute_flops


def test_the_tight_floor_plan_measures_what_it_simulates() -> None:
    """The tight table's smallest plan on the zoo MLP (nested 23 deep, each level's recompute
    in the memory its parent's output gradient left) peaks in torch where the simulator
    says, within 3%."""
    model, inputs = zoo.make("mlp")
    analysis = analyze(model, inputs, strategy="sqrt")
    plan = DynamicProgram(analysis.cost_graph).smallest()
    assert max(s.depth for s in plan.segments) >= 3
    rewritten = generate(analysis.captured.graph_module, model, plan)
    measured = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert measured <= plan.peak_bytes <= 1.03 * measured, f"simulated/measured {plan.peak_bytes / measured:.3f}"


# --- plans judged by the simulator ---------------------------------------------------------

FEWER = settings(SETTINGS, max_examples=examples(30))  # fit_budget: ~1.4 s an example


@FEWER
@given(graphs_with_matmuls(), st.floats(0.05, 1.0))
def test_optimal_fits_the_budget_and_recomputes_no_more_than_heuristics(graph, fraction: float) -> None:
    """A budget plan fits, and recomputes no more than any heuristic's plan that fits or either
    dynamic-program table's plan for the budget (tight and held: the budget search starts from
    the cheaper and only ever replaces it by a cheaper plan; these graphs name no blocks, so
    per-block's margin, :func:`passes.budget_search.blocks_within_margin`, never applies)."""
    budget = int(fraction * eager_peak(graph))
    heuristics = [choose_plan(graph, name) for name in ("sqrt", "articulation", "mincut")]
    tables = [plan_for_budget(DynamicProgram(graph, within_bytes=budget, tight=tight), budget) for tight in (False, True)]
    fitting = [p for p in [*heuristics, *tables] if p is not None and p.peak_bytes <= budget]
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
