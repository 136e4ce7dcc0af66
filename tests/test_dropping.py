"""Values dropped by saved-tensor hooks (:mod:`graphckpt.dropping`): an op that saves a
dropped value runs as eager code, and backward makes the value again when it unpacks it.
Trains like eager, peaks where the simulator says, costs less than a checkpoint call, and
the planner drops values on top of any plan (:func:`passes.drop_scan.drops_on_top`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import networkx as nx
import pytest
import torch
from torch import nn

from graphckpt.api import analyze
from graphckpt.codegen import generate
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from passes.drop_scan import drops_on_top
from passes.drops import dropped_segments
from passes.graph_facts import op_nodes
from passes.plan import build_plan, plan_of_segments
from passes.remat import runs_by_hooks
from passes.segments import PlanError, make_segments
from passes.simulate import eager_peak
from tests.equivalence import assert_trains_like_twice, fresh_pair


class Tokens(nn.Module):
    """Linear -> GELU on [batch, tokens, width]: a Linear flattens its 3-d input, so what it
    saves is a view of the GELU's output, not the output itself."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return x


def _gelus_dropped(model: nn.Module, inputs: tuple) -> tuple[object, object]:
    """The analysis of ``model`` and the plan dropping every GELU output it can (the values of
    its ops that are not matmuls)."""
    analysis = analyze(model, inputs, strategy="mincut")
    graph = analysis.cost_graph
    gelus = [n for n in op_nodes(graph) if not graph.nodes[n]["expensive"]]
    chosen: list[str] = []
    for value in gelus:
        try:
            dropped_segments(graph, [*chosen, value])
        except PlanError:
            continue
        chosen.append(value)
    return analysis, plan_of_segments(graph, "dropped", dropped_segments(graph, chosen))


CASES = {"mlp": lambda: zoo.make("mlp", depth=8, width=128, batch=256),
         "tokens": lambda: (Tokens(), (torch.randn(8, 32, 64),))}


@pytest.mark.parametrize("name", CASES)
def test_ops_run_by_hooks_train_like_eager(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    reference, model = fresh_pair(model)
    analysis, plan = _gelus_dropped(model, inputs)
    hooked = [s for s in plan.recomputed_segments if s.facts.by_hooks]
    assert hooked and len(hooked) == len(plan.recomputed_segments)
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert len(rewritten.drops) == len(hooked) and not rewritten.segments
    assert "# drop_0: runs" in rewritten.code and "drop_0_remat" in rewritten.code
    assert_trains_like_twice(reference, model, rewritten, inputs)
    assert all(drop.remakes == 2 for _, drop in rewritten.drops)  # once a backward, each


@pytest.mark.parametrize("name", CASES)
def test_ops_run_by_hooks_peak_where_simulated(name: str) -> None:
    """The dropped values, views included, are held by nothing after forward: the measured
    peak is the simulated one (within 3%), and at most 0.8 of eager's measured peak."""
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    analysis, plan = _gelus_dropped(model, inputs)
    rewritten = generate(analysis.captured.graph_module, model, plan)
    measured = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    eager = measure_step(model, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.03, (plan.peak_bytes, measured)
    assert measured <= 0.8 * eager, (measured, eager)


def test_ops_run_by_hooks_replay_autocast() -> None:
    """Under autocast the dropped value is made again in forward's precision: the step equals
    the model's own under the same autocast."""
    torch.manual_seed(0)
    model, inputs = zoo.make("mlp", depth=4, width=64, batch=32)
    reference, model = fresh_pair(model)
    analysis, plan = _gelus_dropped(model, inputs)
    rewritten = generate(analysis.captured.graph_module, model, plan)
    for module in (reference, rewritten):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module(*inputs).float().pow(2).mean().backward()
    for expected, actual in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=0, atol=0)


def test_a_segment_that_reruns_its_op_is_not_run_by_hooks() -> None:
    """A one-op segment whose op saves its own output (not kept) needs its recompute: it stays a
    checkpoint call. Keeping that output from forward makes it one of hooks."""
    model, inputs = zoo.make("mlp", depth=4, width=32, batch=8)
    graph = analyze(model, inputs, strategy="mincut").cost_graph
    plan = plan_of_segments(graph, "dropped", dropped_segments(graph, [op_nodes(graph)[0]]))
    for segment in plan.recomputed_segments:
        (name,) = segment.nodes
        own = graph.nodes[name]["saves_from"] == "outputs" and name not in segment.saved_inside
        assert runs_by_hooks(graph, segment) == (bool(segment.remat) and not own)


def test_drops_on_top_of_a_plan_meet_a_budget_it_misses() -> None:
    """On top of a plan recomputing the first half of an MLP, dropping values of the kept
    half reaches a budget below the plan's peak, without touching its recomputed segment."""
    model, inputs = zoo.make("mlp", depth=12, width=64, batch=64)
    graph = analyze(model, inputs, strategy="mincut").cost_graph
    ops = op_nodes(graph)
    base = build_plan(graph, "half", [(ops[:len(ops) // 2], True), (ops[len(ops) // 2:], False)])
    budget = int(base.peak_bytes - 0.1 * (base.peak_bytes - 0.3 * eager_peak(graph)))
    plan = drops_on_top(graph, [base], budget)
    assert plan is not None and plan.peak_bytes <= budget < base.peak_bytes
    assert plan.segments[0].nodes == base.segments[0].nodes and plan.segments[0].recompute
    assert any(runs_by_hooks(graph, s) for s in plan.segments)
    assert drops_on_top(graph, [base], int(0.05 * eager_peak(graph))) is None


def test_a_value_only_remade_through_a_random_op_is_never_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping other values only lengthens a value's chain, so one whose chain back to all
    the plan could hold already runs a random op (a dropout: not :func:`passes.graph_facts.pure`)
    is refused before the scan builds a plan for it (each build is a rebuild of the whole
    plan: on GPT-2 such refusals were 99 rebuilds a base)."""
    import networkx as nx

    import passes.drop_scan as drops
    from passes.costgraph import add_value

    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=64, requires_grad=False)
    add_value(graph, "lin", kind="op", order=1, bytes=64, reads=["x"], flops=100, saved=("x",))
    add_value(graph, "drop", kind="op", order=2, bytes=64, reads=["lin"], flops=1, random=True, saved=())
    add_value(graph, "view", kind="op", order=3, bytes=64, reads=["drop"], flops=1, saved=())
    add_value(graph, "mul", kind="op", order=4, bytes=64, reads=["view", "lin"], flops=1, saved=("view", "lin"))
    add_value(graph, "output", kind="output", order=5, bytes=0, reads=["mul"])
    base = plan_of_segments(graph, "eager", make_segments(graph, [(op_nodes(graph), False)]))
    built: list[list[str]] = []
    trial = drops.dropped_or_none

    def recording(graph: nx.DiGraph, dropped: list[str], segments: object) -> object:
        built.append(list(dropped))
        return trial(graph, dropped, segments)

    monkeypatch.setattr(drops, "dropped_or_none", recording)
    assert "view" in drops.drop_order(graph)
    with pytest.raises(PlanError, match="may not run again"):
        dropped_segments(graph, ["view"], base.segments)
    found = list(drops.droppable_values(graph, base.segments))
    assert "view" not in found and "lin" in found
    assert not any("view" in dropped for dropped in built)


class _ScanOfADag(NamedTuple):
    """The drop scan's setting on a 200-op random DAG at 0.7 of eager: the everything-kept
    base, the runs of values its validity scan takes, and a plan builder that records the
    count of values of every plan asked of it."""

    graph: nx.DiGraph
    base: tuple
    runs: list[list[str]]
    values: list[str]
    budget: int
    asked: list[int]
    trial: Callable[[list[str]], object]


def _scan_of_a_dag() -> _ScanOfADag:
    import random

    import passes.drop_scan as drops
    from graphckpt.tools.random_dags import random_cost_graph
    from passes.simulate import eager_segments

    graph = random_cost_graph(random.Random(4), 200)
    base = eager_segments(graph)
    runs = list(drops.droppable_runs(graph, base))
    asked: list[int] = []
    built = drops._memo_trials(graph, base)

    def trial(dropped: list[str]) -> object:
        asked.append(len(dropped))
        return built(dropped)

    return _ScanOfADag(graph, base, runs, [value for run in runs for value in run], int(0.7 * eager_peak(graph)),
                       asked, trial)


def test_the_drop_scan_finds_the_shortest_fitting_prefix_asking_fit_of_plans_it_built() -> None:
    """On a 200-op random DAG the scan's answer is the shortest prefix of the droppable values
    whose plan fits (found here value by value), and on its way up it asks whether a plan
    fits only at the end of a checked run, whose plan the validity scan has just built: a fit
    test at a count of its own was a rebuild of the whole plan."""
    from itertools import accumulate

    import passes.drop_scan as drops
    from passes.drops import dropped_or_none
    from passes.peak_queries import peak_within

    scan = _scan_of_a_dag()
    ends = set(accumulate(len(run) for run in scan.runs))
    assert len(scan.runs) >= 3

    def fits(count: int) -> bool:
        segments = dropped_or_none(scan.graph, scan.values[:count], scan.base)
        return segments is not None and peak_within(scan.graph, segments, scan.budget) is not None

    shortest = next(count for count in range(1, len(scan.values) + 1) if fits(count))
    assert shortest > drops.FIRST_FIT_TEST
    found = drops._shortest_fitting_prefix(scan.graph, scan.trial, iter(scan.runs), scan.budget)
    assert found is not None and len(found[0]) == shortest
    upward = scan.asked[:next(i for i, count in enumerate(scan.asked) if count >= shortest) + 1]
    assert upward and set(upward) <= ends


def test_a_prefix_too_dear_that_does_not_fit_ends_the_drop_scan() -> None:
    """With a bound on the cost, the scan simulates a prefix that costs too much: when it
    does not fit, no shorter prefix fits either, so the answer is no plan, without the
    bisection below it that could only confirm that."""
    import passes.drop_scan as drops
    from passes.drops import dropped_or_none
    from passes.peak_queries import peak_within
    from passes.recompute import cost_key

    scan = _scan_of_a_dag()
    first_end = len(scan.runs[0]) + len(scan.runs[1])  # the second fit test's count
    plan = dropped_or_none(scan.graph, scan.values[:first_end], scan.base)
    bound = cost_key(scan.graph, plan)
    assert peak_within(scan.graph, plan, scan.budget) is None
    assert drops._shortest_fitting_prefix(scan.graph, scan.trial, iter(scan.runs), scan.budget, bound) is None
    assert max(scan.asked) == first_end and len(scan.asked) == 2  # the two fit tests, no bisection


@pytest.mark.parametrize("refused_at", [0, 1, 5, 37, 63])
def test_a_block_bisected_or_galloped_takes_the_values_before_the_refused_one(refused_at: int) -> None:
    """The longest droppable prefix of a block is the same found either way (a plan dropping a
    refused value is no plan, whatever else it drops); bisecting a grown block, where the
    refused value is anywhere, builds at most 1 + log2(size) plans."""
    import passes.drop_scan as drops

    block = [f"v{i}" for i in range(64)]
    for gallop in (True, False):
        built: list[int] = []

        def trial(dropped: list[str], built: list[int] = built) -> tuple | None:
            built.append(len(dropped))
            return None if block[refused_at] in dropped else ()

        taken, _ = drops._longest_valid_prefix(trial, [], block, lambda plan: False, gallop=gallop)
        assert taken == refused_at
        if not gallop:
            assert len(built) <= 1 + 6


def test_the_drop_scan_narrows_to_the_shortest_fitting_prefix_in_fewer_fit_tests_than_bisection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the longest prefix known not to fit and the shortest known to, the scan tries
    where the peaks it has seen say the plan meets the budget (:func:`passes.drop_scan._next_probe`),
    not the middle: the same answer (the previous test's), in fewer fit tests on this DAG."""
    import passes.drop_scan as drops
    from passes.peak_queries import peak_within

    def fit_tests(probe: Callable) -> tuple[int, int]:
        monkeypatch.setattr(drops, "_next_probe", probe)
        scan = _scan_of_a_dag()
        counted: list[int] = []

        def counting(graph: nx.DiGraph, segments: object, limit: float) -> int | None:
            counted.append(1)
            return peak_within(graph, segments, limit)

        monkeypatch.setattr(drops, "peak_within", counting)
        found = drops._shortest_fitting_prefix(scan.graph, scan.trial, iter(scan.runs), scan.budget)
        assert found is not None
        return len(found[0]), len(counted)

    estimated = fit_tests(drops._next_probe)
    bisected = fit_tests(lambda graph, chosen, low, high, peaks, budget: (low + high) // 2)
    assert estimated[0] == bisected[0]
    assert estimated[1] < bisected[1]


def test_the_next_prefix_tried_is_where_the_peaks_seen_meet_the_budget() -> None:
    """With one fitting prefix known, values are given back from its end while their bytes
    fit in what the budget leaves; with two, at the rate the peak rose between them; a
    guess at or below a prefix known not to fit is replaced by the middle."""
    from passes.costgraph import add_value
    from passes.drop_scan import _next_probe

    graph = nx.DiGraph()
    chosen = [f"v{i}" for i in range(20)]
    for order, name in enumerate(chosen):
        add_value(graph, name, kind="input", order=order, bytes=10, requires_grad=False)
    assert _next_probe(graph, chosen, 0, 20, {20: 70}, 100) == 17  # 30 bytes spare: three values back
    assert _next_probe(graph, chosen, 0, 20, {20: 95}, 100) == 19  # none fits back: the one just below
    assert _next_probe(graph, chosen, 0, 16, {20: 60, 16: 80}, 100) == 12  # 5 bytes a value: 20 spare, 4 values
    assert _next_probe(graph, chosen, 14, 16, {20: 60, 16: 80}, 100) == 15  # the guess is known not to fit
    assert _next_probe(graph, chosen, 4, 16, {20: 80, 16: 80}, 100) == 10  # peaks equal: no rate, the middle
