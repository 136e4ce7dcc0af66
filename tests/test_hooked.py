"""Selective segments run by saved-tensor hooks (passes.hooked, graphckpt.hooked): which
segments qualify, and that they train like eager and peak where simulated."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from graphckpt.api import analyze
from graphckpt.codegen import generate
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from passes.graph_facts import op_nodes
from passes.hooked import keeps_by_hooks, marked_values, remake_groups
from passes.plan import Candidate, Plan, plan_of_segments, selective, simulated
from passes.segments import make_segments
from tests.equivalence import assert_backpropagates_twice, assert_trains_like_twice, zoo_pair

SIZES = {"mlp": {"batch": 256}, "densenet": {"batch": 16}, "resnet": {"batch": 16}, "unet": {"batch": 8}}


def _selective_plan(model: torch.nn.Module, inputs: tuple) -> tuple[object, Plan]:
    analysis = analyze(model, inputs, strategy="mincut")
    flat = Candidate(analysis.plan.strategy, analysis.plan.segments)
    return analysis, simulated(analysis.cost_graph, selective(analysis.cost_graph, flat))


def test_which_segments_run_by_hooks() -> None:
    """A selective, pure segment qualifies; one keeping nothing, one drawing random numbers,
    or one whose ops save much that is no value of the graph does not."""
    model, inputs = zoo.make("mlp", depth=6, width=32, batch=8)
    analysis, plan = _selective_plan(model, inputs)
    graph = analysis.cost_graph
    segment = next(s for s in plan.segments if s.recompute)
    assert keeps_by_hooks(graph, segment)
    assert set(marked_values(graph, segment)) <= set(segment.nodes) - set(segment.saved_inside)
    assert marked_values(graph, segment)
    assert not keeps_by_hooks(graph, replace(segment, saved_inside=()))
    name = segment.nodes[-1]
    drawing = graph.copy()  # a graph of its own: the passes read a cost graph's attributes once
    drawing.nodes[name]["random"] = True
    assert not keeps_by_hooks(drawing, segment)
    saving = graph.copy()
    saving.nodes[name]["saved_extra_bytes"] = sum(graph.nodes[n]["bytes"] for n in segment.nodes)
    assert not keeps_by_hooks(saving, segment)


def test_a_hooked_segment_is_priced_for_each_of_its_ops() -> None:
    """A hooked segment's forward packs what its ops save and reports each value backward
    saves, whether or not it is dropped: ``hooked_op_cost`` is paid once per op of it
    (HF LLaMA's hooked plans ran 6-15 ms of forward their price per dropped value missed)."""
    from passes.recompute import overhead_cost

    model, inputs = zoo.make("mlp", depth=6, width=32, batch=8)
    analysis, plan = _selective_plan(model, inputs)
    graph = analysis.cost_graph.copy()  # a graph of its own to price
    hooked = [s for s in plan.segments if s.recompute and keeps_by_hooks(graph, s)]
    assert hooked
    graph.graph.update(checkpoint_call_cost=0, selective_op_cost=0, dropped_value_cost=0, hooked_op_cost=0)
    assert overhead_cost(graph, plan.segments) == 0
    graph.graph["hooked_op_cost"] = 7
    assert overhead_cost(graph, plan.segments) == 7 * sum(len(s.nodes) for s in hooked)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_hooked_segments_peak_where_simulated(name: str) -> None:
    model, inputs = zoo.make(name, **SIZES[name])
    analysis, plan = _selective_plan(model, inputs)
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert rewritten.hooked, "no segment runs by hooks"
    measured = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.03, (plan.peak_bytes, measured)


def test_hooked_segments_train_like_eager_and_read_plainly() -> None:
    """Outputs, gradients and BatchNorm buffers equal eager's over two steps; the code names
    each hooked segment and its remake; eval and no_grad make nothing again."""
    reference, model, inputs = zoo_pair("densenet")
    analysis, plan = _selective_plan(model, inputs)
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert rewritten.hooked
    assert_trains_like_twice(reference, model, rewritten, inputs)
    made = sum(module.recomputations for _, module in rewritten.hooked)
    assert made > 0
    with torch.no_grad():
        rewritten(*inputs)
    assert sum(module.recomputations for _, module in rewritten.hooked) == made


def test_print_code_shows_what_is_dropped_and_remade() -> None:
    model, inputs = zoo.make("mlp", depth=6, width=32, batch=8)
    analysis, plan = _selective_plan(model, inputs)
    code = generate(analysis.captured.graph_module, model, plan).code
    assert "selective ones run by saved-tensor hooks (hooked_i)" in code
    assert "self.hooked_0(" in code and "def hooked_0_remake_0(" in code and "mark(hooks, " in code


@pytest.mark.parametrize("name", ["mlp", "unet", "densenet"])
def test_remake_groups_split_the_marked_values_into_parts_made_on_their_own(name: str) -> None:
    """Every marked value is in one group; a group's ops read only the segment's inputs,
    kept values and ops of the same group; each op computed is needed for a value of it."""
    model, inputs = zoo.make(name)
    analysis, plan = _selective_plan(model, inputs)
    graph = analysis.cost_graph
    hooked = [s for s in plan.segments if s.recompute and keeps_by_hooks(graph, s)]
    assert hooked
    for segment in hooked:
        groups = remake_groups(graph, segment)
        marked = [name for group in groups for name in group.marked]
        assert sorted(marked) == sorted(marked_values(graph, segment))
        computed = [name for group in groups for name in group.nodes]
        assert len(computed) == len(set(computed)) and not set(computed) & set(segment.saved_inside)
        for group in groups:
            own = set(group.nodes)
            for name in group.nodes:
                sources = set(graph.predecessors(name)) & set(segment.nodes)
                assert sources <= own | set(segment.saved_inside), (name, sources - own)
                assert name in group.marked or set(graph.successors(name)) & own, name


def test_each_remake_group_is_made_once_a_backward() -> None:
    """The MLP chain keeps its matmul outputs: each activation between two of them is a group
    of its own, made when backward reaches it."""
    model, inputs = zoo.make("mlp", depth=6, width=32, batch=8)
    analysis = analyze(model, inputs, strategy="sqrt")  # its cost graph; the plan is made here
    graph, ops = analysis.cost_graph, op_nodes(analysis.cost_graph)
    segments = make_segments(graph, [(ops[:-2], True), (ops[-2:], False)])
    segments = tuple(replace(s, saved_inside=tuple(n for n in s.nodes if graph.nodes[n]["expensive"]))
                     if s.recompute else s for s in segments)
    rewritten = generate(analysis.captured.graph_module, model, plan_of_segments(graph, "test", segments))
    groups = sum(len(module.groups) for _, module in rewritten.hooked)
    assert len(rewritten.hooked) == 1 and groups >= 4
    zoo.scalar_loss(rewritten(*inputs)).backward()
    assert sum(module.recomputations for _, module in rewritten.hooked) == groups


def test_a_retained_graph_backpropagates_twice() -> None:
    """Each handle's value is let go after its unpack; a second backward of a retained graph
    makes the values again and gets the same gradients."""
    model, inputs = zoo.make("mlp", depth=6, width=32, batch=8)
    analysis, plan = _selective_plan(model, inputs)
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert rewritten.hooked
    assert_backpropagates_twice(rewritten, model, inputs)


def test_what_hooked_ops_save_beyond_values_is_held_from_forward() -> None:
    """A hooked segment's ops keep what they save that is no value of the graph (norm
    statistics, copies of transposed views) from forward, not only from the remake: LLaMA's
    rotary copies, 2 MiB a layer, measured 14 MiB over a simulator that held them late. The
    MLP chain peaks as backward starts, with every hooked segment's forward done."""
    model, inputs = zoo.make("mlp", depth=8, width=64, batch=64)
    analysis, plan = _selective_plan(model, inputs)
    graph = analysis.cost_graph.copy()  # a graph of its own: the simulator indexes each graph once
    hooked = [s for s in plan.segments if s.recompute and keeps_by_hooks(graph, s)]
    assert len(hooked) >= 2
    extra = 0
    for segment in hooked:
        name = segment.nodes[0]
        graph.nodes[name]["saved_extra_bytes"] = share = int(0.01 * sum(graph.nodes[n]["bytes"] for n in segment.nodes))
        extra += share
    assert all(keeps_by_hooks(graph, s) for s in hooked)
    assert simulated(graph, Candidate(plan.strategy, plan.segments)).peak_bytes == plan.peak_bytes + extra


def _wide_then_deep() -> tuple[torch.nn.Module, tuple]:
    """A pointwise chain at the input (a remake group made last in backward) under a deep
    stack of wide linears (kept values whose backward is over by then)."""
    torch.manual_seed(0)
    wide = 1024
    model = torch.nn.Sequential(
        torch.nn.Linear(32, wide), torch.nn.GELU(), torch.nn.Tanh(), torch.nn.Sigmoid(), torch.nn.Tanh(), torch.nn.Sigmoid(),
        torch.nn.Linear(wide, 16),
        torch.nn.Linear(16, wide), torch.nn.Linear(wide, wide), torch.nn.Linear(wide, wide), torch.nn.Linear(wide, 8))
    return model, (torch.randn(2048, 32),)


def test_inputs_and_kept_values_go_after_the_last_backward_needing_them() -> None:
    """One hooked segment over the whole model, keeping its linears' outputs: each kept value
    goes once the ops that saved it and the remakes reading it are done, not when the
    segment's backward ends. The pointwise group at the input is made again after the deep
    linears' backward: holding every kept value then, with the group's values and the
    gradient reaching them, would peak above all of those values' bytes; the measured peak
    stays under them, where the simulator puts it."""
    model, inputs = _wide_then_deep()
    analysis = analyze(model, inputs, strategy="sqrt")
    graph, ops = analysis.cost_graph, op_nodes(analysis.cost_graph)
    (segment, last) = make_segments(graph, [(ops[:-1], True), (ops[-1:], False)])
    segment = replace(segment, saved_inside=tuple(n for n in segment.nodes if graph.nodes[n]["expensive"]))
    assert keeps_by_hooks(graph, segment)
    plan = plan_of_segments(graph, "test", (segment, last))
    group = max(remake_groups(graph, segment), key=lambda g: sum(graph.nodes[n]["bytes"] for n in g.marked))
    held_to_the_end = sum(graph.nodes[n]["bytes"] for n in (*segment.saved_inside, *group.marked))
    rewritten = generate(analysis.captured.graph_module, model, plan)
    measured = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert measured < held_to_the_end, (measured, held_to_the_end)
    assert abs(plan.peak_bytes / measured - 1) < 0.03, (plan.peak_bytes, measured)
