"""The fx graphs a rewritten module's segments run, copied from the captured graph: a
segment's ops, what makes its rematerialized inputs again (:mod:`passes.remat`), and for a
segment run by hooks, its body with each value reported as it is made and the recipes that
make its dropped values again (:mod:`passes.hooked`), and for an exact schedule, its body and
steps (:mod:`passes.exact`). :mod:`graphckpt.codegen` wires them
into the rewritten module.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from graphckpt.dropout import draw, dropout_call, redraw
from graphckpt.dropping import DropModule
from graphckpt.exact import ScheduledModule, made, needing_grad, with_autograd_for_saved_extras
from graphckpt.hooked import STATES, HookedSegmentModule, keep, mark
from passes.remat import remat_sources
from passes.schedule import ScheduleStep
from passes.segments import RecomputeFacts
from passes.segments import Segment as PlannedSegment


def resolve(root: nn.Module, target: str) -> Any:
    """The attribute a dotted ``target`` names under ``root`` (a submodule, parameter,
    buffer or constant)."""
    value = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def attribute_table(graph: fx.Graph, owner: nn.Module, skip: Mapping[str, Any] = {}) -> dict[str, Any]:
    """Every module and attribute the graph names (but those in ``skip``), looked up on ``owner``."""
    return {n.target: resolve(owner, n.target) for n in graph.nodes
            if n.op in ("call_module", "get_attr") and n.target not in skip}


@dataclass(frozen=True)
class Source:
    """The captured module every segment is copied from, with its nodes by name (found once:
    built again for each segment, the map made codegen grow as n^1.5, 2.3 of 3.8 s at 50k nodes)."""

    module: fx.GraphModule
    nodes: Mapping[str, fx.Node]

    @classmethod
    def of(cls, module: fx.GraphModule) -> Source:
        return cls(module, {n.name: n for n in module.graph.nodes})


def facts_of(planned: PlannedSegment) -> RecomputeFacts:
    """What the plan says of a recomputed segment's cost graph (every plan made by
    :func:`passes.plan.plan_of_segments` says it)."""
    if planned.facts is None:
        raise ValueError(f"segment {planned.nodes[0]} .. {planned.nodes[-1]} has no RecomputeFacts: "
                         "make plans with passes.plan.plan_of_segments (or a strategy)")
    return planned.facts


def return_values(graph: fx.Graph, values: list[fx.Node]) -> None:
    """End ``graph`` returning ``values``: one value as itself, more as a tuple."""
    graph.output(values[0] if len(values) == 1 else tuple(values))


def lifted_reads(source: Source, planned: PlannedSegment) -> tuple[str, ...]:
    """The graph inputs a segment's rematerialization chains read that the plan counts as
    always there: parameters ``torch.compile`` passes as inputs (``param`` values of the cost
    graph, placeholders here, not attributes), which the segment's call must pass on."""
    chains = {name for r in planned.remat for name in r.nodes}
    sources = {name for r in planned.remat for name in r.sources}
    return tuple(dict.fromkeys(
        node.name for name in chains for node in source.nodes[name].all_input_nodes
        if node.op == "placeholder" and node.name not in chains and node.name not in sources))


def remat_arguments(source: Source, planned: PlannedSegment) -> tuple[str, ...]:
    """What a segment's call passes beyond its inputs: the sources of its rematerialized
    inputs (:func:`passes.remat.remat_sources`), then the graph inputs its chains read
    (:func:`lifted_reads`)."""
    extra = remat_sources(planned)
    return (*extra, *(name for name in lifted_reads(source, planned) if name not in extra and name not in planned.inputs))


def remat_module(source: Source, planned: PlannedSegment) -> tuple[fx.GraphModule | None, dict[str, Any]]:
    """The module computing ``planned``'s rematerialized inputs from their sources (one
    placeholder per source, the inputs' values returned in order: :mod:`passes.remat`), and
    the :class:`SegmentModule` arguments that wire it; ``None`` when it rematerializes nothing."""
    if not planned.remat:
        return None, {}
    originals = source.nodes
    sources = [*dict.fromkeys(s for r in planned.remat for s in r.sources), *lifted_reads(source, planned)]
    graph = fx.Graph()
    env = {name: graph.placeholder(name) for name in sources}

    def read(node: fx.Node) -> fx.Node:  # a parameter or constant the chain reads: got where read
        if node.name not in env:
            env[node.name] = graph.node_copy(node, read)
        return env[node.name]

    for name in dict.fromkeys(n for r in planned.remat for n in r.nodes):
        env[name] = graph.node_copy(originals[name], read)
    return_values(graph, [env[r.value] for r in planned.remat])
    arguments = [*planned.inputs, *remat_arguments(source, planned)]
    return fx.GraphModule(attribute_table(graph, source.module), graph, "RematBody"), {
        "remat_inputs": tuple(planned.inputs.index(r.value) for r in planned.remat),
        "remat_sources": tuple(arguments.index(name) for name in sources), "remat_names": tuple(sources)}


def drop_module(source: Source, planned: PlannedSegment) -> DropModule:
    """The runtime module of a segment run by hooks: its one op, and what makes its
    rematerialized inputs again."""
    originals = source.nodes
    body = fx.Graph()
    env = {name: body.placeholder(name) for name in planned.inputs}
    for name in planned.nodes:
        env[name] = body.node_copy(originals[name], lambda n: env[n.name])
    return_values(body, [env[name] for name in planned.outputs])
    remat, wiring = remat_module(source, planned)
    return DropModule(fx.GraphModule(attribute_table(body, source.module), body, "DropBody"), remat,
                      nodes=planned.nodes, inputs=planned.inputs, outputs=planned.outputs, **wiring)


def hooked_module(source: Source, planned: PlannedSegment) -> HookedSegmentModule:
    """The runtime module of a selective segment run by saved-tensor hooks: its ops, each
    marked or kept value reported as it is made, and for each remake group what makes its
    values again from the inputs and kept values (the ops of the segment they need)."""
    originals, groups, drawn = source.nodes, facts_of(planned).remakes, set(facts_of(planned).redrawn)
    marked = {name for group in groups for name in group}
    body = fx.Graph()
    env = {name: body.placeholder(name) for name in planned.inputs}
    hooks = body.placeholder("hooks")
    for name in planned.nodes:
        if name in drawn:  # its output and noise, marked together
            pair = _dropout(body, source, originals[name], draw, hooks, env)
            reported = body.call_function(mark, (hooks, pair, name), name=f"mark_{name}")
            env[name] = body.call_function(operator.getitem, (reported, 0), name=f"{name}_output")
            continue
        env[name] = body.node_copy(originals[name], lambda n: env[n.name])
        if name in marked or name in planned.saved_inside:
            report = keep if name in planned.saved_inside else mark
            env[name] = body.call_function(report, (hooks, env[name], name), name=f"{report.__name__}_{name}")
    return_values(body, [env[name] for name in planned.outputs])
    return HookedSegmentModule(fx.GraphModule(attribute_table(body, source.module), body, "HookedBody"),
                               [_remake_module(source, planned, index) for index in range(len(groups))],
                               nodes=planned.nodes, inputs=planned.inputs, outputs=planned.outputs,
                               groups=groups, kept=planned.saved_inside,
                               each_use=facts_of(planned).remake_each_use, held=facts_of(planned).remake_held,
                               closures=facts_of(planned).remake_closures)


def _remake_module(source: Source, planned: PlannedSegment, index: int) -> fx.GraphModule:
    """What makes the values of a hooked segment's remake ``index`` again
    (:func:`passes.hooked.remake_units`: its ops, ``remake_ops``, and the values it returns,
    ``remakes``) from the inputs, kept values and other held values it reads (its
    placeholders, nothing unread: the call holds for each group only what its remake reads)."""
    facts = facts_of(planned)
    originals, graph, values = source.nodes, fx.Graph(), facts.remakes[index]
    needed = set(facts.remake_ops[index])
    read = {node.name for name in needed for node in originals[name].all_input_nodes if node.name not in needed}
    sources = (*planned.inputs, *planned.saved_inside, *facts.remake_held)
    made = {name: graph.placeholder(name) for name in sources if name in read}
    drawn = needed.intersection(facts.redrawn)
    states = graph.placeholder(STATES) if drawn else None
    returned = {}  # a dropout's value is its (output, noise) pair
    for name in planned.nodes:
        if name in drawn:
            returned[name] = _dropout(graph, source, originals[name], redraw, states, made)
            made[name] = graph.call_function(operator.getitem, (returned[name], 0), name=f"{name}_output")
        elif name in needed:
            made[name] = graph.node_copy(originals[name], lambda n: made[n.name])
    graph.output(tuple(returned.get(name, made.get(name)) for name in values))
    return fx.GraphModule(attribute_table(graph, source.module), graph, "RemakeBody")


def _dropout(graph: fx.Graph, source: Source, original: fx.Node, function: Any, first: fx.Node,
             env: Mapping[str, fx.Node]) -> fx.Node:
    """``function(first, name, x, p, training)``: a dropout of a hooked segment as
    :func:`graphckpt.dropout.draw` (forward) or ``redraw`` (a remake) runs it, returning its
    output and noise; an ``nn.Dropout``'s ``p`` and ``training`` read from the module."""
    call = dropout_call(source.module, original)
    if call is None:
        raise ValueError(f"node {original.name!r} ({original.format_node()}) is planned as a dropout drawn again "
                         "but is none graphckpt can draw again: plan with the cost graph of this module")
    p, training = call.p, call.training
    if call.module is not None:
        module = graph.get_attr(call.module)
        p, training = (graph.call_function(getattr, (module, field)) for field in ("p", "training"))
    return graph.call_function(function, (first, original.name, env[call.input.name], p, training),
                               name=f"{function.__name__}_{original.name}")



def scheduled_module(source: Source, planned: PlannedSegment) -> ScheduledModule:
    """The runtime module of a segment run by an exact schedule: every op, each value
    reported as it is made, and one module a step (:func:`_step_module`)."""
    schedule, originals = planned.schedule, source.nodes
    body = fx.Graph()
    env = {name: body.placeholder(name) for name in planned.inputs}
    hooks = body.placeholder("hooks")
    for name in planned.nodes:
        env[name] = body.node_copy(originals[name], lambda n: env[n.name])
        env[name] = body.call_function(made, (hooks, env[name], name), name=f"made_{name}")
    return_values(body, [env[name] for name in planned.outputs])
    return ScheduledModule(fx.GraphModule(attribute_table(body, source.module), body, "ScheduledBody"),
                           {step.op: _step_module(source, step, dict(schedule.grad_reads)) for step in schedule.steps},
                           nodes=planned.nodes, inputs=planned.inputs, outputs=planned.outputs, kept=schedule.kept,
                           storage_of=dict(schedule.storages), dropped_extras=schedule.dropped_extras,
                           kept_extras=schedule.kept_extras)


def _step_module(source: Source, step: ScheduleStep, grad_reads: Mapping[str, tuple[str, ...]]) -> fx.GraphModule:
    """What runs just before the backward of ``step.op``: let go of ``cache`` entries,
    make values again from what it holds (reads ``cache[...]``, writes them back), and let
    go of what is needed no more right after each is made. An op of ``step.extras`` runs
    with autograd on for its extra (:func:`_with_extras`), reading ``grad_reads[op]``
    requiring grad."""
    graph = fx.Graph()
    cache = graph.placeholder("cache")
    local: dict[str, fx.Node] = {}
    functions: dict[str, Any] = {}  # attributes of the step: the functions of ops run for their extras

    def read(node: fx.Node) -> fx.Node:
        if node.name not in local:
            local[node.name] = (graph.node_copy(node) if node.op == "get_attr"
                                else graph.call_function(operator.getitem, (cache, node.name), name=node.name))
        return local[node.name]

    for name in step.release:
        graph.create_node("call_method", "pop", (cache, name), name=f"let_go_{name}")
    for name, gone in zip(step.make, step.free, strict=True):
        if name in step.extras:
            local[name] = _with_extras(graph, cache, source.nodes[name], read, grad_reads.get(name, ()), functions)
        else:
            local[name] = graph.node_copy(source.nodes[name], read)
        graph.call_function(operator.setitem, (cache, name, local[name]), name=f"hold_{name}")
        for value in gone:
            graph.create_node("call_method", "pop", (cache, value), name=f"let_go_{value}")
    graph.output(None)
    return fx.GraphModule({**attribute_table(graph, source.module, skip=functions), **functions}, graph, "ScheduleStep")


def _with_extras(graph: fx.Graph, cache: fx.Node, original: fx.Node, read: Any, needing: tuple[str, ...],
                 functions: dict[str, Any]) -> fx.Node:
    """``original`` run again in a step with autograd on, for its extra
    (:func:`graphckpt.exact.with_autograd_for_saved_extras`): what it reads, from ``read``,
    each of ``needing`` as a leaf requiring grad; its function an attribute of the step
    (added to ``functions``), its module one of the model's, its method a name."""
    grads: dict[str, fx.Node] = {}

    def argument(node: fx.Node) -> fx.Node:
        if node.name not in needing:
            return read(node)
        if node.name not in grads:
            grads[node.name] = graph.call_function(needing_grad, (read(node),), name=f"{node.name}_needing_grad")
        return grads[node.name]

    args, kwargs = fx.map_arg(original.args, argument), fx.map_arg(original.kwargs, argument)
    if original.op == "call_function":
        target = f"{original.name}_function"
        functions[target] = original.target
        function: Any = graph.get_attr(target)
    elif original.op == "call_module":
        function = graph.create_node("get_attr", original.target, name=f"{original.name}_module")
    else:  # call_method: the method of args[0] by name
        function = original.target
    return graph.call_function(with_autograd_for_saved_extras, (cache, original.name, function, args, dict(kwargs)),
                               name=f"{original.name}_with_its_extra")
