"""Turn a captured fx graph into the cost graph the passes read.

The node-attribute contract is :mod:`passes.costgraph`; this module only fills it in from
the torch side. With example inputs the costs are real (fake-tensor bytes and FLOPs);
without them every op costs one unit, so node-counting strategies still work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import networkx as nx
import torch
from torch import fx

from graphckpt.inplace import isolate_inplace, mutation_constraints
from graphckpt.profile import NodeCost, node_costs
from passes.costgraph import add_value, check_cost_graph

_KIND = {"placeholder": "input", "get_attr": "param", "output": "output"}


def node_label(node: fx.Node) -> str:
    """A short human name for what a node does (``layers.0``, ``relu``, ``add``)."""
    if node.op in ("call_module", "get_attr", "placeholder"):
        return str(node.target)
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        target = node.target
        return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    return node.op


def _unit_cost(node: fx.Node) -> NodeCost:
    is_op = node.op not in _KIND
    return NodeCost(bytes=int(is_op), alias_of=None, flops=int(is_op), saved=(),
                    saved_extra_bytes=0, requires_grad=True, shape="", dtype="")


def prepare(graph_module: fx.GraphModule, args: tuple | None,
            kwargs: Mapping[str, Any] | None = None) -> dict[str, NodeCost]:
    """Make in-place ops safe (:func:`graphckpt.inplace.isolate_inplace`) and return the
    costs of the final graph; unit costs when there are no example inputs."""
    if args is None:
        return {n.name: _unit_cost(n) for n in graph_module.graph.nodes}
    costs = node_costs(graph_module, args, kwargs)
    if isolate_inplace(graph_module, costs):
        costs = node_costs(graph_module, args, kwargs)
    return costs


def build_cost_graph(graph_module: fx.GraphModule, costs: Mapping[str, NodeCost]) -> nx.DiGraph:
    """The :mod:`passes.costgraph` graph of ``graph_module`` with the given node costs."""
    not_recomputable, not_cuttable = mutation_constraints(graph_module, costs)
    graph = nx.DiGraph(name=type(graph_module).__name__)
    for order, node in enumerate(graph_module.graph.nodes):
        cost = costs.get(node.name) or _unit_cost(node)
        add_value(
            graph, node.name,
            kind=_KIND.get(node.op, "op"),
            order=order,
            bytes=cost.bytes,
            reads=[n.name for n in node.all_input_nodes],
            label=node_label(node),
            alias_of=cost.alias_of,
            flops=cost.flops,
            recomputable=node.name not in not_recomputable,
            cuttable=node.name not in not_cuttable,
            saved=cost.saved,
            saved_extra_bytes=cost.saved_extra_bytes,
            requires_grad=cost.requires_grad,
            shape=cost.shape,
            dtype=cost.dtype,
        )
    check_cost_graph(graph)
    return graph
