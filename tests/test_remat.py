"""Rematerialized segment inputs (:mod:`passes.remat`): a recomputed segment drops an input
after forward and computes it again, without gradients, from kept values when backward
recomputes it. Trains like eager, peaks where the simulator says, and the validation names
what is wrong with a plan that may not do it.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import networkx as nx
import pytest
import torch
from torch import nn

from graphckpt.api import analyze
from graphckpt.codegen import generate
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from graphckpt.tools.random_dags import random_cost_graph
from passes.budget_search import fit_budget
from passes.drops import drop_plan
from passes.graph_facts import op_nodes
from passes.optimal import DynamicProgram
from passes.plan import Plan, plan_of_segments
from passes.remat import ChainTooLong, Remat, greedy_remat, remat_chain, with_remat
from passes.search import search
from passes.segments import PlanError, make_segments
from passes.simulate import eager_peak
from tests.equivalence import assert_trains_like, assert_trains_like_twice, fresh_pair, zoo_pair


def _rematerializing(graph: nx.DiGraph, plan: Plan, every: int = 1) -> Plan:
    """``plan`` rematerializing every input it can (every ``every``-th option)."""
    return plan_of_segments(graph, "remat", greedy_remat(graph, plan.segments, PlanError, every))


def _count(plan: Plan) -> int:
    return sum(len(s.remat) for s in plan.segments)


@pytest.mark.parametrize("strategy", ["mincut", "sqrt"])
@pytest.mark.parametrize("name", zoo.names())
def test_rematerialized_inputs_train_like_eager(name: str, strategy: str) -> None:
    reference, model, inputs = zoo_pair(name)
    analysis = analyze(model, inputs, strategy=strategy)
    plan = _rematerializing(analysis.cost_graph, analysis.plan)
    if not _count(plan):  # unet's mincut plan: every chain runs an in-place ReLU
        pytest.skip("no input of this plan has a pure chain to kept values")
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert "_remat(self" in rewritten.code and "rematerializes" in rewritten.code
    assert_trains_like_twice(reference, model, rewritten, inputs)


SIZES = {"mlp": {"depth": 12, "width": 256, "batch": 64}, "resnet": {"batch": 4}, "gpt": {"layers": 2, "batch": 8},
         "unet": {"batch": 4}, "densenet": {"batch": 4}}


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("name", list(SIZES))
def test_rematerialized_peak_is_the_simulated_one(name: str, every: int) -> None:
    model, inputs = zoo.make(name, **SIZES[name])
    analysis = analyze(model, inputs, strategy="mincut")
    plan = _rematerializing(analysis.cost_graph, analysis.plan, every)
    if not _count(plan):
        pytest.skip("nothing to rematerialize")
    measured = measure_step(generate(analysis.captured.graph_module, model, plan), inputs, zoo.scalar_loss,
                            repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.03, (plan.peak_bytes, measured)


class _Producer(nn.Module):
    """``v = linear_a(x)`` is read only by the recomputed segment ``relu(v) * w -> linear_b``:
    linear_a's weight gets its gradient only through the segment's gradient for ``v``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_a, self.linear_b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.linear_a(x)
        return self.linear_b(torch.relu(v) * self.w)


def test_gradient_of_a_rematerialized_input_reaches_its_producer() -> None:
    """The rule: the copy carries no gradient; the segment's gradient for ``v`` flows along
    forward's graph to ``v``'s producer (a kept op here). A runtime that gave the segment a
    detached ``v`` in forward, or that built the copy's graph instead, would leave
    ``linear_a`` without (or with a doubled) gradient; one that did not match the copy's
    ``requires_grad`` would save other tensors and fail checkpoint's check."""
    torch.manual_seed(0)
    reference, model = fresh_pair(_Producer())
    inputs = (torch.randn(8, 16),)
    analysis = analyze(model, inputs, strategy="sqrt")
    graph = analysis.cost_graph
    ops = op_nodes(graph)
    v = next(n for n in ops if graph.nodes[n]["label"].startswith("linear_a"))
    rest = ops[ops.index(v) + 1:]
    segments = make_segments(graph, [(ops[:ops.index(v) + 1], False), (rest, True)])
    segments = with_remat(graph, segments, [(1, v)], PlanError)
    assert segments[1].remat == (Remat(v, ("x",), (v,)),)
    plan = plan_of_segments(graph, "remat", segments)
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert "def segment_0_remat(self, x)" in rewritten.code
    assert_trains_like(reference, model, rewritten, inputs)
    assert model.linear_a.weight.grad is not None and model.linear_a.weight.grad.abs().sum() > 0


def _mlp_graph() -> tuple[nx.DiGraph, list[str]]:
    model, inputs = zoo.make("mlp", depth=6, width=32, batch=8)
    graph = analyze(model, inputs, strategy="mincut").cost_graph
    return graph, op_nodes(graph)


def test_a_chain_longer_than_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value is made again through at most ``MAX_REMAT_OPS`` ops: tracing is given up past
    it, and ``with_remat`` refuses the pick (on a 1000-op stack, tracing every long chain
    was most of a 22 s budget plan)."""
    graph, ops = _mlp_graph()
    segments = make_segments(graph, [(ops[:8], False), (ops[8:9], True), (ops[9:], False)])
    v = segments[1].inputs[0]
    assert len(remat_chain(graph, v, ["x"]).nodes) == 8
    with pytest.raises(ChainTooLong, match="more than 3 ops"):
        remat_chain(graph, v, ["x"], limit=3)
    kept_only_input = make_segments(graph, [(ops[:8], True), (ops[8:9], True), (ops[9:], False)])
    assert with_remat(graph, kept_only_input, [(1, kept_only_input[1].inputs[0])], PlanError)
    monkeypatch.setattr("passes.remat.MAX_REMAT_OPS", 3)
    with pytest.raises(PlanError, match="more than 3 ops"):
        with_remat(graph, kept_only_input, [(1, kept_only_input[1].inputs[0])], PlanError)


def test_validation_names_a_source_that_is_not_kept() -> None:
    graph, ops = _mlp_graph()
    segments = make_segments(graph, [(ops[:4], True), (ops[4:8], True), (ops[8:], False)])
    v = segments[1].inputs[0]
    bad = replace(segments[1], remat=(remat_chain(graph, v, [ops[1]]),))  # inside segment 0: died in forward
    with pytest.raises(PlanError, match=f"source '{ops[1]}' is not kept"):
        plan_of_segments(graph, "bad", (segments[0], bad, segments[2]))


def test_a_source_a_segment_keeps_but_does_not_return_is_not_kept_for_later_calls() -> None:
    """A matmul output a selective segment keeps inside lives in its cache, not in the forward
    code calling later segments: sourcing a later rematerialization from it made codegen run
    the segment's ops a second time in forward (found by the random-chain property test)."""
    graph, ops = _mlp_graph()
    segments = make_segments(graph, [(ops[:4], True), (ops[4:8], True), (ops[8:], False)])
    selective = replace(segments[0], saved_inside=(ops[2],))  # layers_2 (Linear): kept, not returned
    v = segments[1].inputs[0]
    bad = replace(segments[1], remat=(remat_chain(graph, v, [ops[2]]),))
    with pytest.raises(PlanError, match=f"source '{ops[2]}' is not kept"):
        plan_of_segments(graph, "bad", (selective, bad, segments[2]))
    remade = with_remat(graph, (selective, segments[1], segments[2]), [(1, v)], PlanError)
    assert ops[2] not in remade[1].remat[0].sources


def test_validation_names_an_impure_op_in_the_chain() -> None:
    graph, ops = _mlp_graph()
    graph = graph.copy()
    segments = make_segments(graph, [(ops[:4], False), (ops[4:8], True), (ops[8:], False)])
    v = segments[1].inputs[0]
    remat = remat_chain(graph, v, ["x"])
    graph.nodes[remat.nodes[1]]["random"] = True  # as if it were a dropout
    with pytest.raises(PlanError, match=f"'{remat.nodes[1]}' may not run again"):
        plan_of_segments(graph, "bad", (segments[0], replace(segments[1], remat=(remat,)), segments[2]))


def test_validation_names_a_value_that_is_no_input_and_a_kept_segment() -> None:
    graph, ops = _mlp_graph()
    segments = make_segments(graph, [(ops[:4], False), (ops[4:8], True), (ops[8:], False)])
    with pytest.raises(PlanError, match=f"'{ops[1]}' is not an input"):
        plan_of_segments(graph, "bad", (segments[0], replace(segments[1], remat=(remat_chain(graph, ops[1], ["x"]),)),
                                        segments[2]))
    with pytest.raises(PlanError, match="segment 2 is kept"):
        plan_of_segments(graph, "bad", (*segments[:2], replace(segments[2], remat=(
            remat_chain(graph, segments[2].inputs[0], ["x"]),))))


def test_a_rematerialized_input_is_not_a_checkpoint_and_lowers_the_peak() -> None:
    graph, ops = _mlp_graph()
    segments = make_segments(graph, [(ops[:4], True), (ops[4:8], True), (ops[8:], False)])
    plain = plan_of_segments(graph, "plain", segments)
    v = segments[1].inputs[0]
    remade = plan_of_segments(graph, "remat", with_remat(graph, segments, [(1, v)], PlanError))
    assert v in plain.checkpoints and v not in remade.checkpoints
    assert remade.peak_bytes < plain.peak_bytes
    assert remade.recompute_flops > plain.recompute_flops
    assert f"rematerializes {v} from x" in str(remade)


def _drop_plan(name: str, model: nn.Module, inputs: tuple) -> tuple[object, Plan | None]:
    """A plan dropping values (:mod:`passes.drops`) at the lowest of a few budgets it meets."""
    analysis = analyze(model, inputs, strategy="mincut")
    graph = analysis.cost_graph
    plans = (drop_plan(graph, int(fraction * eager_peak(graph))) for fraction in (0.8, 0.9, 0.97))
    return analysis, next((plan for plan in plans if plan is not None), None)


@pytest.mark.parametrize("name", zoo.names())
def test_plans_dropping_values_train_like_eager(name: str) -> None:
    reference, model, inputs = zoo_pair(name)
    analysis, plan = _drop_plan(name, model, inputs)
    if plan is None or not _count(plan):
        pytest.skip("no plan dropping values fits")
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert_trains_like_twice(reference, model, rewritten, inputs)


@pytest.mark.parametrize("name", ["mlp", "resnet", "densenet", "unet"])
def test_plans_dropping_values_peak_where_simulated(name: str) -> None:
    model, inputs = zoo.make(name, **SIZES[name])
    analysis, plan = _drop_plan(name, model, inputs)
    if plan is None or not _count(plan):
        pytest.skip("no plan dropping values fits")
    measured = measure_step(generate(analysis.captured.graph_module, model, plan), inputs, zoo.scalar_loss,
                            repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.03, (plan.peak_bytes, measured)


@pytest.mark.parametrize("index", [1, 3])
def test_the_planner_meets_budgets_it_refused(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random DAGs 1 and 3 of planner_gap's 16-op budget table (seed 0): the MILP meets half of
    eager's peak, and fit_budget refused it before plans could rematerialize inputs (every
    plan of segments alone peaks above it). On DAG 3 a plan holding values once made again
    (passes.relaxed.with_held) is cheaper still: without those, the plan rematerializes. The
    exact solver's schedule (passes.exact) is cheaper than both: asked for without it."""
    rng = random.Random(0)
    graph = [random_cost_graph(rng, 16) for _ in range(8)][index]
    budget = int(0.5 * eager_peak(graph))
    assert DynamicProgram(graph).smallest().peak_bytes > budget
    assert search(graph, [DynamicProgram(graph).smallest()], budget, remat=False).peak_bytes > budget
    assert fit_budget(graph, budget).peak_bytes <= budget
    monkeypatch.setattr("passes.budget_search.exact_plan", lambda *args, **kwargs: None)
    plan = fit_budget(graph, budget)
    assert plan.peak_bytes <= budget and (_count(plan) or any(s.remake_held for s in plan.segments))
    monkeypatch.setattr("passes.relaxed.with_held", lambda graph, plan, budget_bytes: plan)
    plan = fit_budget(graph, budget)
    assert plan.peak_bytes <= budget and _count(plan)


def test_a_chain_running_the_ops_a_segment_keeps_trains_like_eager() -> None:
    """The chain makes a GELU again and the segment keeps a GELU from forward: the copy is
    made before the selective policy's cache is entered, whose count of GELU calls a chain run
    inside it would shift ("gelu invocation index 2 ... not found in storage", found by
    test_recompute_matches_plan's random chains)."""
    torch.manual_seed(0)
    reference, model = fresh_pair(nn.Sequential(nn.Linear(32, 32), *(nn.GELU() for _ in range(6))))
    inputs = (torch.randn(16, 32),)
    analysis = analyze(model, inputs, strategy="sqrt")
    graph = analysis.cost_graph
    ops = op_nodes(graph)
    segments = make_segments(graph, [(ops[:3], False), (ops[3:], True)])
    segments = with_remat(graph, (segments[0], replace(segments[1], saved_inside=(ops[4],))), [(1, ops[2])], PlanError)
    plan = plan_of_segments(graph, "remat", segments)
    assert plan.segments[1].remat and plan.segments[1].saved_inside
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert_trains_like_twice(reference, model, rewritten, inputs)


def test_sources_are_let_go_with_the_checkpoint_keeping_them() -> None:
    """A selective call lived until the garbage collector took it (its policy referred back
    to it), and with it the sources of its rematerialized inputs: ``_8`` stayed alive through
    the next segment's recompute, measured 1.12x the simulated peak (found by the random-chain
    property test; the draw, with the plan's segments)."""
    from tests.test_recompute_matches_plan import OPS

    torch.manual_seed(0)
    kinds = ["scale", "linear", "linear", "relu", "gelu", "gelu", "residual", "linear", "linear", "scale", "gelu"]
    model = nn.Sequential(nn.Linear(64, 64), *(OPS[kind]() for kind in kinds))
    inputs = (torch.randn(512, 64),)
    analysis = analyze(model, inputs, strategy="mincut")
    graph, ops = analysis.cost_graph, op_nodes(analysis.cost_graph)
    bounds = [0, 2, 4, 6, 10, 12, len(ops)]  # kept, recomputed, kept, ...: _0 mul | _2 _3 | _4 _5 | ...
    segments = make_segments(graph, [(ops[i:j], k % 2 == 1) for k, (i, j) in enumerate(itertools.pairwise(bounds))])
    segments = (*segments[:5], replace(segments[5], saved_inside=("_11",)))  # the last one selective
    segments = with_remat(graph, segments, [(3, "_5"), (5, "mul_1")], PlanError)
    assert segments[5].remat[0].sources == ("_8",)  # the output of segment 3, recomputed again after
    plan = plan_of_segments(graph, "remat", segments)
    measured = measure_step(generate(analysis.captured.graph_module, model, plan), inputs, zoo.scalar_loss,
                            repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.02, (plan.peak_bytes, measured)


def test_dropping_values_gives_up_after_a_few_failed_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check of a set of dropped values rebuilds the whole plan, so the scan for values to
    drop stops after ``DROP_REFUSALS`` values were refused instead of trying every value,
    and finds each refused value of a chunk by galloping from its start."""
    import passes.drop_scan as drops

    graph, _ = _mlp_graph()
    base = plan_of_segments(graph, "eager", make_segments(graph, [(op_nodes(graph), False)]))
    checks: list[bool] = []

    def refuse(*args: object) -> None:
        checks.append(False)
        return None

    monkeypatch.setattr(drops, "dropped_or_none", refuse)
    monkeypatch.setattr(drops, "DROP_REFUSALS", 3)
    assert len(drops.drop_order(graph)) > 8
    assert list(drops.droppable_values(graph, base.segments, chunk=4)) == []
    # Three values refused, each found in a chunk of four by two checks: the chunk, its
    # first value (bisection took three: the chunk, its first two values, its first one).
    assert len(checks) == 3 * 2


def test_dropping_values_skips_exactly_the_values_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bisection in a chunk that fails takes what checking its values one by one takes:
    every value but the refused ones, in order."""
    import passes.drop_scan as drops

    graph, _ = _mlp_graph()
    base = plan_of_segments(graph, "eager", make_segments(graph, [(op_nodes(graph), False)]))
    options = list(drops.droppable_values(graph, base.segments))
    refused = set(options[1::3])
    monkeypatch.setattr(drops, "dropped_or_none", lambda graph, dropped, segments: None if refused & set(dropped) else ())
    assert len(refused) < drops.DROP_REFUSALS
    assert list(drops.droppable_values(graph, base.segments, chunk=4)) == [v for v in options if v not in refused]
