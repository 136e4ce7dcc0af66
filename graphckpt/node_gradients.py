"""The gradients a node's backward makes, as the profile (:mod:`graphckpt.profile`) records
them: its trained parameters' (``param_grad_bytes``, ``param_grads``), and the buffers of its
inputs' gradients, beyond which its ``backward_extra_bytes`` are measured."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
from torch import fx

from graphckpt.node_cost import NodeCost, trainable_bytes


def param_grad_bytes(module: fx.GraphModule, node: fx.Node) -> int:
    """Bytes of parameter gradients ``node``'s backward creates (before they are accumulated
    into ``.grad``): a ``call_module`` node's parameters, the parameter a ``get_attr`` node
    is, or those its ``get_attr`` inputs are."""
    params = _own_parameters(module, node)
    if params is None:
        params = [operator.attrgetter(n.target)(module) for n in node.all_input_nodes if n.op == "get_attr"]
    return trainable_bytes(params)


def param_grads(module: fx.GraphModule, node: fx.Node, names: Mapping[int, str]) -> tuple[tuple[str, int], ...]:
    """The cost graph's ``param_grads``: the trained parameters inside a ``call_module``
    node, or the one a ``get_attr`` node is, under the model's (first) name for each
    (``names``, by ``id``), so that a module called twice, or tied to another, is seen to
    share its gradients."""
    params = _own_parameters(module, node) or []
    return tuple((names[id(p)], trainable_bytes([p])) for p in params if id(p) in names and trainable_bytes([p]))


def _own_parameters(module: fx.GraphModule, node: fx.Node) -> list[torch.Tensor] | None:
    """The parameters inside a ``call_module`` node, or the one a ``get_attr`` node is;
    ``None`` for other nodes."""
    if node.op == "call_module":
        return list(module.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        return [operator.attrgetter(node.target)(module)]
    return None


def gradients_made(costs: Mapping[str, NodeCost], node: fx.Node) -> int:
    """Bytes of the gradients the simulator gives ``node``'s backward: one buffer for each
    input that takes part in backward (:func:`gradient_size`), none when they are views of
    its own (``grad_views``), and its parameter gradients (16-bit where autocast casts them
    up afterwards). What its backward holds beyond them is its ``backward_extra_bytes``."""
    own = costs[node.name]
    inputs = [] if own.grad_views else [n.name for n in node.all_input_nodes
                                        if n.op != "get_attr" and costs[n.name].requires_grad]
    made = own.param_grad_bytes - own.param_grad_cast_bytes + own.param_grad_narrow_bytes
    return sum(gradient_size(costs, name) for name in inputs) + made


def gradient_size(costs: Mapping[str, NodeCost], name: str) -> int:
    """Bytes of the gradient buffer of value ``name``, as the cost graph's
    :func:`passes.kept_bytes.gradient_bytes` reads them: its ``grad_bytes``, else its
    storage's size."""
    cost = costs[name]
    if cost.grad_bytes is not None:
        return cost.grad_bytes
    return costs[cost.alias_of].bytes if cost.alias_of in costs else cost.bytes
