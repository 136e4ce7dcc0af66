"""What backward really recomputes and holds is what the plan says: nested segments that keep
their matmul outputs reuse them (they are kept from the enclosing segment's recompute), and
kept outputs the recompute never reaches are dropped when it ends.

Before, a nested child's kept matmul outputs were computed again (the 0.25 plan of a 32-layer
MLP ran 37 matmuls again where it planned 23), and a selective segment ending in a matmul
held that output until its whole backward finished: measured peaks one activation above the
simulated ones.
"""

from __future__ import annotations

import collections
import copy
import gc
import sys
from collections.abc import Sequence
from dataclasses import replace

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from graphckpt.api import Analysis, cost_model, generate_rewrite, plan_cost_graph
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from passes.budget import BudgetError
from passes.costgraph import add_value
from passes.graph_facts import op_nodes
from passes.plan import Plan, plan_of_segments
from passes.recompute import recompute_steps, recomputed_nodes
from passes.segments import Segment, make_segments, nested
from tests.device import DEVICE
from tests.equivalence import assert_trains_like
from tests.thorough import examples

DEPTH, WIDTH = 16, 128  # 16 x (Linear + GELU): ops layers_0 (Linear) .. layers_31 (GELU)


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _mlp(batch: int) -> tuple[torch.nn.Module, tuple, nx.DiGraph, object]:
    torch.manual_seed(0)
    model, inputs = zoo.make("mlp", depth=DEPTH, width=WIDTH, batch=batch)
    captured, graph = cost_model(model, inputs)
    return model, inputs, graph, captured


def _selective(graph: nx.DiGraph, segment: Segment) -> Segment:
    return replace(segment, saved_inside=tuple(n for n in segment.nodes if graph.nodes[n]["expensive"]))


def _nested_selective_plan(graph: nx.DiGraph, last_child_recomputed: bool = False) -> Plan:
    """Two nested segments whose first (or last) child is recomputed keeping its matmul
    outputs, then a selective flat segment ending in a matmul, then one kept op."""
    ops = op_nodes(graph)

    def parent(nodes: Sequence[str]) -> Segment:
        half = len(nodes) // 2
        groups = [(nodes[:half], False), (nodes[half:], True)] if last_child_recomputed else \
            [(nodes[:half], True), (nodes[half:], False)]
        children = list(make_segments(graph, groups))
        index = 1 if last_child_recomputed else 0
        children[index] = _selective(graph, children[index])
        return nested(graph, children)

    flat = _selective(graph, make_segments(graph, [(ops[20:31], True)])[0])  # ends on layers_30, a Linear
    assert graph.nodes[ops[30]]["expensive"]
    segments = [parent(ops[:10]), parent(ops[10:20]), flat, *make_segments(graph, [(ops[31:], False)])]
    return plan_of_segments(graph, "test", segments)


def _planned_matmuls(graph: nx.DiGraph, plan: Plan) -> int:
    """Matmuls of one step: forward's plus the recomputed ones the plan counts."""
    forward = sum(1 for n in op_nodes(graph) if graph.nodes[n]["expensive"])
    return forward + sum(1 for n in recomputed_nodes(graph, plan.segments) if graph.nodes[n]["expensive"])


def _step_ops(module: torch.nn.Module, inputs: tuple) -> collections.Counter:
    module(*inputs).pow(2).mean().backward()  # warm-up: .grad exists
    with _CountOps() as counter:
        module(*inputs).pow(2).mean().backward()
    return counter.counts


def _rewrite(model: torch.nn.Module, captured: object, graph: nx.DiGraph, plan: Plan) -> torch.nn.Module:
    return generate_rewrite(model, Analysis(captured, graph, plan))


@pytest.mark.parametrize("last_child_recomputed", [False, True], ids=["first-child", "last-child"])
def test_nested_selective_segments_train_like_eager(last_child_recomputed: bool) -> None:
    """The last-child case is the one where checkpoint's early stop ends the enclosing
    recompute before the child runs: the child then recomputes everything, still exactly."""
    model, inputs, graph, captured = _mlp(batch=8)
    reference = copy.deepcopy(model)
    rewritten = _rewrite(model, captured, graph, _nested_selective_plan(graph, last_child_recomputed))
    assert_trains_like(reference, model, rewritten, inputs)
    assert_trains_like(reference, model, rewritten, inputs, seed=1)  # a second step, fresh calls


@pytest.mark.parametrize("runtime", ["selective-mode", "hooks"])
def test_a_selective_call_is_freed_with_its_graph_without_the_garbage_collector(
        runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A selective call's policy referred back to the call, a cycle: when no backward came
    (a forward under grad whose output is dropped), the matmul outputs its cache keeps lived
    until the garbage collector ran, and a rematerialization's sources with them. The same
    holds for a segment run by saved-tensor hooks (graphckpt.hooked), whose handles refer to
    their call."""
    from graphckpt.hooked import _HookedCall
    from graphckpt.segment_calls import SegmentCall

    if runtime == "selective-mode":
        for module in ("passes.recompute", "passes.simulate"):  # modules, not passes' re-exported functions
            monkeypatch.setattr(sys.modules[module], "keeps_by_hooks", lambda graph, segment: False)
    kind = SegmentCall if runtime == "selective-mode" else _HookedCall

    def calls() -> int:
        return sum(isinstance(o, kind) for o in gc.get_objects())

    model, inputs, graph, captured = _mlp(batch=8)
    rewritten = _rewrite(model, captured, graph, _nested_selective_plan(graph))
    gc.collect()
    before = calls()  # calls other tests' live outputs still hold
    gc.disable()
    try:
        output = rewritten(*inputs)
        assert calls() > before
        del output
        assert calls() == before
    finally:
        gc.enable()


def test_nested_children_reuse_their_kept_matmul_outputs() -> None:
    model, inputs, graph, captured = _mlp(batch=8)
    plan = _nested_selective_plan(graph)
    assert any(child.saved_inside for s in plan.segments for child in s.children)
    counts = _step_ops(_rewrite(model, captured, graph, plan), inputs)
    assert counts["addmm"] == _planned_matmuls(graph, plan)


@pytest.mark.parametrize("budget", [0.5, 0.35, 0.27])
def test_budget_plans_recompute_what_they_plan(budget: float) -> None:
    model, inputs, graph, captured = _mlp(batch=256)  # activations, not weight gradients, set the peak
    plan = plan_cost_graph(graph, budget=budget)
    counts = _step_ops(_rewrite(model, captured, graph, plan), inputs)
    assert counts["addmm"] == _planned_matmuls(graph, plan), str(plan)


def test_nested_selective_plan_peak_is_the_simulated_one() -> None:
    """Batch 256: activations dwarf what the simulator leaves out (RNG state, scalars)."""
    model, inputs, graph, captured = _mlp(batch=256)
    plan = _nested_selective_plan(graph)
    measured = measure_step(_rewrite(model, captured, graph, plan), inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.01, (plan.peak_bytes, measured)


# --- where a recompute stops (pure) ----------------------------------------------------------


def _chain(saves: Sequence[str]) -> nx.DiGraph:
    """A chain x -> op0 -> op1 ... whose ops save ``saves[i]`` ("nothing", "inputs", "outputs")."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=0)
    previous = "x"
    for index, what in enumerate(saves):
        name = f"op{index}"
        saved = {"nothing": (), "inputs": (previous,), "outputs": (name,)}[what]
        add_value(graph, name, kind="op", order=index + 1, bytes=10, reads=[previous], saved=saved)
        previous = name
    add_value(graph, "out", kind="output", order=len(saves) + 1, bytes=0, reads=[previous])
    return graph


@pytest.mark.parametrize(("saves", "runs", "stop"), [
    (("inputs", "inputs", "inputs"), ["op0", "op1"], "op2"),  # Linear, Linear, Linear: the last is not run
    (("inputs", "outputs"), ["op0", "op1"], None),  # ... -> ReLU: it saves what it computes, so it runs
    (("inputs", "inputs", "nothing", "nothing"), ["op0"], "op1"),  # a tail saving nothing never runs
    (("nothing", "nothing"), [], None),  # nothing saved: nothing to recompute
])
def test_recompute_stops_once_backward_has_what_it_saved(saves: tuple, runs: list, stop: str | None) -> None:
    graph = _chain(saves)
    (segment,) = make_segments(graph, [(op_nodes(graph), True)])
    ran, stopped = recompute_steps(graph, segment)
    assert (ran, stopped) == (runs, stop)


def test_a_nested_child_saving_last_is_not_run_by_its_parent() -> None:
    graph = _chain(("inputs",) * 6)
    ops = op_nodes(graph)
    children = make_segments(graph, [(ops[:3], False), (ops[3:], True)])
    parent = nested(graph, children)
    ran, stop = recompute_steps(graph, parent)
    assert ran == ops[:3] and stop == children[1]
    # its recompute then runs everything it needs itself, from its own input
    assert recomputed_nodes(graph, [parent]) == ops[:3] + ops[3:5]


# --- random chains of ops that save different things: simulated = measured -------------------

OPS = {
    "linear": lambda: torch.nn.Linear(64, 64),  # saves its input
    "gelu": torch.nn.GELU,  # saves its input
    "relu": torch.nn.ReLU,  # saves its output
    "sigmoid": torch.nn.Sigmoid,  # saves its output
    "scale": lambda: _Scale(),  # saves nothing
    "residual": lambda: _Residual(),  # x + linear(x): the add saves nothing
}


class _Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


class _Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(sorted(OPS)), min_size=10, max_size=20), st.floats(0.45, 0.95))
# Draws that found rematerializing plans peaking above their simulation: a source kept inside
# a selective segment and not returned by it (1.27x), sources kept alive by a selective call (1.14x);
# a hooked segment keeping a value nothing saves, freed in forward, whose address a dropped value
# then took: saved whole, as if kept (1.09x, most runs).
@example(["gelu", "relu", "residual", "gelu", "gelu", "gelu", "gelu", "scale", "gelu", "gelu"], 0.875)
# A value a hooked segment keeps and its backward does not need, rematerialized from by a later
# segment as if alive until that segment's backward: the simulator let it go in forward (1.10x).
@example(["linear", "scale", "gelu", "sigmoid", "gelu", "sigmoid", "linear", "linear", "gelu", "sigmoid"], 0.921)
# A hooked segment keeping values no op saves and no remake reads: they go at their last use in
# forward, and the simulator held them to the end of the segment's forward (1.17x).
@example(["relu", "gelu", "gelu", "gelu", "relu", "residual", "scale", "relu", "residual", "relu"], 0.7)
@example(["relu", "gelu", "scale", "sigmoid", "sigmoid", "gelu", "linear", "gelu", "scale", "gelu", "sigmoid",
          "residual", "linear", "residual"], 0.82)
@example(["scale", "linear", "linear", "relu", "gelu", "gelu", "residual", "linear", "linear", "scale", "gelu"], 0.606)
def test_random_chains_simulated_peak_and_recompute_are_measured(kinds: list[str], fraction: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), *(OPS[kind]() for kind in kinds))
    inputs = (torch.randn(512, 64),)  # 128 KiB activations: scalars and RNG state are noise
    captured, graph = cost_model(model, inputs)
    try:
        plan = plan_cost_graph(graph, budget=fraction)
    except BudgetError:
        return  # below this chain's floor (most draws fit: 0.45 and up)
    rewritten = _rewrite(model, captured, graph, plan)
    measured = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.02, f"{plan}\nmeasured {measured}"
    assert _step_ops(rewritten, inputs)["addmm"] == _planned_matmuls(graph, plan), str(plan)


class _ReadPastTheStop(torch.nn.Module):
    """``copies`` scaled copies of an activation, without gradients (so nothing saves them
    and backward makes no gradients for them), read only by a sum after ``exp``, the last op
    that saves: a recompute of the block stops at ``exp`` with every copy still alive."""

    def __init__(self, width: int = 256, copies: int = 8) -> None:
        super().__init__()
        self.pre, self.head, self.copies = torch.nn.Linear(width, width), torch.nn.Linear(width, 1), copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        scaled = [h.detach() * (i + 2) for i in range(self.copies)]
        out = h.exp()
        total = scaled[0]
        for value in scaled[1:]:
            total = total + value
        return self.head(out + total)


def test_a_recompute_holds_what_its_body_reads_after_the_stop() -> None:
    """Values a recompute computes and only an op past its stop reads live until the stop:
    the body lets a value go after its last use in its code, run or not. The simulator let
    them go at once, under-counting the recompute's peak by the copies (T5's plan at the
    floor measured 1.045x its simulated peak: the decoder's mask and the encoder's output,
    read after the stop of the recompute that made them)."""
    torch.manual_seed(0)
    model = _ReadPastTheStop().to(DEVICE)
    inputs = (torch.randn(512, 256, device=DEVICE),)
    captured, graph = cost_model(model, inputs)
    ops = op_nodes(graph)
    body = [n for n in ops if "head" not in n and n != ops[-1]]
    plan = plan_of_segments(graph, "test", make_segments(graph, [(body, True), (ops[len(body):], False)]))
    (segment, *_) = plan.segments
    ran, _ = recompute_steps(graph, segment)
    assert ran[-1].startswith("exp") and sum(n.startswith("mul") for n in ran) == 8
    measured = measure_step(_rewrite(model, captured, graph, plan), inputs, zoo.scalar_loss, repeats=1).peak_bytes
    # Within 1% (the loss's few bytes); letting the copies go at once simulated 0.909x.
    assert 0.99 * measured <= plan.peak_bytes <= 1.01 * measured, f"simulated/measured {plan.peak_bytes / measured:.3f}"
