"""In-place operations, made safe for recomputation.

A recomputed segment starts again from the values kept at its boundary; if an in-place op
later wrote into one of them, the recompute would read the wrong data. Two defences:

1. :func:`isolate_inplace` gives each in-place op on an activation a private copy to
   write into (``clone`` right before it) whenever nothing else reads the old value
   afterwards, so the written storage never needs to be a boundary.
2. :func:`mutation_constraints` marks what is left: values written in place later may not
   be kept at a boundary (``cuttable=False``), and anything reading an input, parameter or
   buffer that is written in place may not be recomputed (``recomputable=False``).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
from torch import fx

from graphckpt.profile import NodeCost

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.setitem}


def _schema_written_argument(node: fx.Node) -> fx.Node | None:
    schema = node.target._schema
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            return value if isinstance(value, fx.Node) else None
    return None


def mutated_argument(module: torch.nn.Module, node: fx.Node) -> fx.Node | None:
    """The value ``node`` writes into in place, or ``None`` if it writes nothing."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if node.op == "call_module":
        return first if getattr(module.get_submodule(node.target), "inplace", False) is True else None
    if node.op == "call_method":
        name = node.target
        return first if name.endswith("_") and not name.endswith("__") else None
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        return _schema_written_argument(node)
    if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
        return first
    name = getattr(node.target, "__name__", "")
    return first if name.endswith("_") and not name.startswith("_") else None


def _alias_group(node: fx.Node, costs: Mapping[str, NodeCost], nodes: list[fx.Node]) -> list[fx.Node]:
    root = costs[node.name].alias_of or node.name
    return [n for n in nodes if n.name == root or costs[n.name].alias_of == root]


def isolate_inplace(graph_module: fx.GraphModule, costs: Mapping[str, NodeCost]) -> int:
    """Insert a ``clone`` before each in-place op on an activation that can take one.

    Safe when no other alias of the written value is read after the op: readers of the
    written value itself after the op are pointed at the copy. Returns how many clones
    were inserted; the graph is recompiled when any were.
    """
    nodes = list(graph_module.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    inserted = 0
    for node in nodes:
        target = mutated_argument(graph_module, node)
        if target is None or target.op in ("placeholder", "get_attr") or target.name not in costs:
            continue
        group = _alias_group(target, costs, nodes)
        if any(n.op in ("placeholder", "get_attr") for n in group):
            continue
        others_read_later = any(position[r] > position[node] for n in group if n is not target
                                and position[n] < position[node] for r in n.users)
        if others_read_later:
            continue
        with graph_module.graph.inserting_before(node):
            copy = graph_module.graph.call_method("clone", (target,))
        for reader in list(target.users):
            if reader is node or position.get(reader, -1) > position[node]:
                reader.replace_input_with(target, copy)
        inserted += 1
    if inserted:
        graph_module.recompile()
    return inserted


def mutation_constraints(graph_module: fx.GraphModule,
                         costs: Mapping[str, NodeCost]) -> tuple[set[str], set[str]]:
    """``(not_recomputable, not_cuttable)`` node names implied by the in-place writes left."""
    nodes = list(graph_module.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    not_recomputable: set[str] = set()
    not_cuttable: set[str] = set()
    for node in nodes:
        target = mutated_argument(graph_module, node)
        if target is None:
            continue
        group = [n for n in _alias_group(target, costs, nodes) if position[n] < position[node]] \
            if target.name in costs else [target]
        if any(n.op in ("placeholder", "get_attr") for n in group):
            not_recomputable.add(node.name)
            not_recomputable.update(r.name for n in group for r in n.users
                                    if position[r] <= position[node])
        else:
            not_cuttable.update(n.name for n in group)
    return not_recomputable, not_cuttable
