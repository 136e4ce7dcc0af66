"""Per-value keeps (:mod:`passes.keeps`, :mod:`passes.kept_values`): a recomputed segment keeps exactly the values its plan
names, pointwise ones as well as matmuls, trains like eager and peaks where the simulator says.

Before, a selective segment kept every matmul/convolution output it ran (a policy by op kind)
and nothing else; the planner could not keep a cheap-to-hold, dear-to-recompute pointwise
value, nor leave out one matmul of a segment.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import networkx as nx
import pytest

import passes.budget_search
import passes.keeps
from graphckpt.api import analyze
from graphckpt.codegen import generate
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from graphckpt.tools.random_dags import random_cost_graph
from passes.budget_search import fit_budget
from passes.graph_facts import op_nodes
from passes.keeps import REFILL_SLACK, filled_again, with_keeps, without_keeps
from passes.kept_values import (
    add_keeps,
    keepable,
    leaf_segments,
    ranked_keeps,
    ranked_removals,
    remove_keeps,
    selective_whole,
)
from passes.plan import Plan, plan_of_segments
from passes.relaxed import relaxed_plans
from passes.segments import make_segments, validate_plan
from passes.simulate import eager_peak, simulate
from passes.strategies import choose_plan
from tests.equivalence import assert_trains_like_twice, zoo_pair


def _every_other_keep(graph: nx.DiGraph, plan: Plan) -> Plan:
    """``plan`` keeping every other value its recomputed segments could keep, pointwise ones
    included: a plan no op-kind policy expresses."""
    keeps = ranked_keeps(graph, plan.segments)
    ordered = sorted(keeps, key=lambda k: graph.nodes[k[1]]["order"])
    pointwise = [k for k in ordered if not graph.nodes[k[1]]["expensive"]]
    chosen = [*ordered[::2], *pointwise[:1]]
    return plan_of_segments(graph, "test", add_keeps(graph, plan.segments, chosen))


@pytest.mark.parametrize("strategy", ["mincut", "optimal"])
@pytest.mark.parametrize("name", zoo.names())
def test_per_value_keeps_train_like_eager(name: str, strategy: str) -> None:
    reference, model, inputs = zoo_pair(name)
    analysis = analyze(model, inputs, strategy=strategy, exact=False)  # an exact schedule keeps its own
    graph = analysis.cost_graph
    plan = _every_other_keep(graph, analysis.plan)
    kept = [n for _, s in leaf_segments(plan.segments) for n in s.saved_inside]
    assert kept and all(keepable(graph, n) for n in kept)
    if any(not graph.nodes[n]["expensive"] for _, n in ranked_keeps(graph, analysis.plan.segments)):
        assert any(not graph.nodes[n]["expensive"] for n in kept), "no pointwise value kept"
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert "keep_begin" in rewritten.code or "keep(hooks" in rewritten.code  # selective mode or hooks
    assert_trains_like_twice(reference, model, rewritten, inputs)


SIZES = {"mlp": {"depth": 12, "width": 256, "batch": 64}, "resnet": {"batch": 4}, "gpt": {"layers": 2, "batch": 8},
         "unet": {"batch": 4}, "densenet": {"batch": 4}}


@pytest.mark.parametrize("strategy", ["mincut", "optimal"])
@pytest.mark.parametrize("name", list(SIZES))
def test_per_value_keeps_peak_is_the_simulated_one(name: str, strategy: str) -> None:
    model, inputs = zoo.make(name, **SIZES[name])
    analysis = analyze(model, inputs, strategy=strategy, exact=False)  # an exact schedule keeps its own
    plan = _every_other_keep(analysis.cost_graph, analysis.plan)
    measured = measure_step(generate(analysis.captured.graph_module, model, plan), inputs, zoo.scalar_loss,
                            repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.03, (plan.peak_bytes, measured)


@pytest.mark.parametrize("seed", range(6))
def test_with_keeps_fits_and_recomputes_no_more(seed: int) -> None:
    graph = random_cost_graph(random.Random(seed), 16)
    budget = int(0.7 * eager_peak(graph))
    plan = fit_budget(graph, budget)
    again = with_keeps(graph, plan, budget)
    assert again.peak_bytes <= budget
    assert again.cost_key <= plan.cost_key
    roomier = with_keeps(graph, plan, eager_peak(graph))  # room for more keeps: a new plan
    assert roomier.peak_bytes == simulate(graph, roomier.segments).peak_bytes  # the search's own replay, not redone


def test_keeps_never_name_random_views_or_state() -> None:
    graph = random_cost_graph(random.Random(0), 12)
    graph.nodes["op3"]["random"] = True
    graph.nodes["op5"]["alias_of"] = "op4"
    graph.nodes["op7"]["state"] = True
    graph.nodes["op8"]["saved_extra_bytes"], graph.nodes["op8"]["expensive"] = 64, False  # a max-pool's indices
    assert not any(keepable(graph, n) for n in ("op3", "op5", "op7", "op8", "x", "output"))
    assert keepable(graph, "op6")


def test_a_value_held_once_made_again_and_then_kept_is_no_longer_held() -> None:
    """Keeping a value from forward that a hooked segment held once made again (the plan
    ``fit_budget`` makes of this graph at 0.7 of eager: one segment holding op0) leaves a
    valid plan: the value is kept, not made again, so not held (with_keeps raised PlanError).
    (``fit_budget`` now takes the exact solver's schedule there: the rounded plan is asked for.)"""
    graph = random_cost_graph(random.Random(3), 16)
    plan = relaxed_plans(graph, int(0.7 * eager_peak(graph))).plan
    held = [(path, n) for path, s in leaf_segments(plan.segments) for n in s.remake_held]
    assert held, "the plan this test is about holds a value once made again"
    segments = add_keeps(graph, plan.segments, held)
    validate_plan(graph, segments)
    assert not any(s.remake_held for _, s in leaf_segments(segments))


@pytest.mark.parametrize("seed", range(6))
def test_remove_keeps_undoes_add_keeps(seed: int) -> None:
    graph = random_cost_graph(random.Random(seed), 16)
    plan = fit_budget(graph, int(0.7 * eager_peak(graph)))
    held = {n for _, s in leaf_segments(plan.segments) for n in s.remake_held}  # kept, no longer held: not undone
    keeps = [(path, n) for path, n in ranked_keeps(graph, plan.segments)[::2] if n not in held]
    assert remove_keeps(add_keeps(graph, plan.segments, keeps), keeps) == plan.segments


@pytest.mark.parametrize("seed", range(8))
def test_without_keeps_fits_by_giving_up_keeps_that_lower_the_peak(seed: int) -> None:
    graph = random_cost_graph(random.Random(seed), 16)
    start = plan_of_segments(graph, "selective", selective_whole(graph))
    budget = start.peak_bytes - 1
    trimmed = without_keeps(graph, start, budget, max_simulations=64)
    if trimmed is None:  # nothing it keeps is alive at the peak
        assert all(simulate(graph, remove_keeps(start.segments, [k])).peak_bytes >= start.peak_bytes
                   for k in ranked_removals(graph, start.segments))
        return
    assert trimmed.peak_bytes <= budget
    assert trimmed.peak_bytes == simulate(graph, trimmed.segments).peak_bytes
    kept = {(path, n) for path, s in leaf_segments(trimmed.segments) for n in s.saved_inside}
    assert kept < set(ranked_removals(graph, start.segments))
    assert trimmed.cost_key >= start.cost_key


@pytest.mark.parametrize("seed", range(8))
def test_without_keeps_simulates_no_trial_that_cannot_beat_the_plan_in_hand(seed: int, monkeypatch) -> None:
    """Told the cost of a plan in hand (``beat``), the trim simulates only trials that
    recompute less; what it returns fits and recomputes less. With nothing to beat it finds
    what it finds without."""
    graph = random_cost_graph(random.Random(seed), 16)
    start = plan_of_segments(graph, "selective", selective_whole(graph))
    budget = start.peak_bytes - 1
    trimmed = without_keeps(graph, start, budget, max_simulations=64)
    assert without_keeps(graph, start, budget, max_simulations=64, beat=(float("inf"),)) == trimmed
    beat = (start.cost_key[0] + (0 if trimmed is None else (trimmed.recompute_flops - start.recompute_flops) // 2),)
    found = without_keeps(graph, start, budget, max_simulations=64, beat=beat)
    assert found is None or (found.peak_bytes <= budget and found.cost_key < beat)
    replays = []
    monkeypatch.setattr(passes.keeps, "peak_within", lambda *args: replays.append(args))
    assert without_keeps(graph, start, budget, max_simulations=64, beat=start.cost_key) is None  # none is cheaper
    assert not replays


def test_a_chain_at_torch_compiles_memory_gets_a_plan_as_cheap_as_torch_compiles() -> None:
    """torch.compile's min cut, at half of eager's memory on the benchmark's MLP, keeps every
    Linear output but the last and recomputes each GELU (docs/benchmarks.md). The dynamic
    program keeps all matmuls of a segment or none; at that memory the planner's plans
    recomputed 8% more than that one (here, with the benchmark's measured costs in round
    figures) and stepped 1.03x torch.compile's."""
    model, inputs = zoo.make("mlp", depth=32, width=64, batch=2048)
    graph = analyze(model, inputs).cost_graph.copy()  # planned already: a graph of its own to change
    ops = op_nodes(graph)
    for name in ops:  # a Linear 1.09 ms, a GELU 0.23 ms, as measured (FLOPs call the GELU free)
        graph.nodes[name]["flops"] = 100 if graph.nodes[name]["expensive"] else 21
    graph.graph.update(checkpoint_call_cost=11, selective_op_cost=10, dropped_value_cost=1)
    (segment,) = make_segments(graph, [(ops, True)])
    linears = [n for n in ops if graph.nodes[n]["expensive"]]
    compile_like = plan_of_segments(graph, "test", [replace(segment, saved_inside=tuple(linears[:-1]))])
    plan = fit_budget(graph, compile_like.peak_bytes)
    assert plan.peak_bytes <= compile_like.peak_bytes
    assert plan.cost_key <= compile_like.cost_key, plan.notes[0]


def test_a_flat_plan_the_search_never_simulated_is_filled_with_keeps_too(monkeypatch) -> None:
    """U-Net's stored zoo cost graph (FLOPs), planned ``optimal`` (at ``auto``'s peak): a
    min-cut plan rated dearer than the dynamic program's, which the flat search stops before
    simulating, recomputes least once its spare memory keeps values."""
    from graphckpt.api import plan_cost_graph
    from tests.plan_snapshot import SNAPSHOT, graph_from_data

    graph = graph_from_data(json.loads(SNAPSHOT.read_text())["unet"]["graph"])
    plan = plan_cost_graph(graph, "optimal")
    monkeypatch.setattr(passes.budget_search, "_unsimulated_filled", lambda *args: None)
    without = plan_cost_graph(graph, "optimal")
    assert plan.peak_bytes <= plan_cost_graph(graph, "auto").peak_bytes
    assert plan.recompute_flops < without.recompute_flops
    assert "a flat plan rated dearer before its keeps" in plan.notes[0]


@pytest.mark.parametrize("seed", range(3))
def test_a_plan_whose_fill_ran_out_of_simulations_is_filled_again_in_the_memory_left(seed: int) -> None:
    """filled_again keeps more where a fill stopped early (one simulation here, as a fill of a
    730-op graph stops after 10 at LLaMA's): less recompute, still under the budget, and a
    plan leaving at most REFILL_SLACK of the budget spare is handed back as it is."""
    graph = random_cost_graph(random.Random(seed), 60)
    plan = choose_plan(graph, "sqrt", None)
    budget = int(1.3 * plan.peak_bytes)
    stopped = with_keeps(graph, plan, budget, max_simulations=1)
    again = filled_again(graph, stopped, budget)
    assert again.cost_key < stopped.cost_key and again.peak_bytes <= budget
    assert again.peak_bytes == simulate(graph, again.segments).peak_bytes
    assert filled_again(graph, stopped, stopped.peak_bytes / (1 - REFILL_SLACK / 2)) is stopped


def test_flat_plans_not_simulated_are_filled_once_per_cut() -> None:
    """A flat plan and its selective variant (the same segments recomputed, keeping matmul
    outputs), or two strategies' equal cuts, end as one plan once filled with keeps: the
    fill of flat plans the search never simulated starts from the cheapest of each cut only."""
    from passes.budget_search import _cheapest_per_cut
    from passes.flat_plans import candidates
    from passes.recompute import cost_key

    graph = random_cost_graph(random.Random(0), 60)
    flat = candidates(graph)

    def cut(index: int) -> tuple:
        return tuple((segment.nodes, segment.recompute) for segment in flat[index].segments)

    picked = _cheapest_per_cut(graph, flat, range(len(flat)))
    assert len({cut(index) for index in picked}) == len(picked) < len(flat)
    assert {cut(index) for index in picked} == {cut(index) for index in range(len(flat))}
    for index in picked:
        twins = [other for other in range(len(flat)) if cut(other) == cut(index)]
        assert cost_key(graph, flat[index].segments) == min(cost_key(graph, flat[t].segments) for t in twins)
