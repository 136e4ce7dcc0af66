"""In-place operations, made safe for recomputation.

A recomputed segment starts again from the values kept at its boundary; if an in-place op
later wrote into one of them, the recompute would read the wrong data. Two defences:

1. :func:`isolate_inplace` gives each in-place op on an activation a tensor of its own to
   write (its out-of-place twin, ``relu`` for ``relu_``, or a ``clone`` right before it)
   whenever nothing else reads the old value afterwards, so the written storage never
   needs to be a boundary.
2. :func:`mutation_constraints` marks what is left: values written in place later may not
   be kept at a boundary (``cuttable=False``), and anything reading an input, parameter or
   buffer that is written in place may not be recomputed (``recomputable=False``), unless
   the write is a state update (:mod:`graphckpt.state`: running statistics, a batch counter),
   which a recompute redirects to scratch copies.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx

from graphckpt.node_cost import NodeCost
from graphckpt.state import state_keys, state_roots
from graphckpt.torch_compat import rename_node
from graphckpt.written import inplace_flag, mutated_arguments


def view_parents(graph_module: fx.GraphModule, costs: Mapping[str, NodeCost]) -> dict[fx.Node, fx.Node]:
    """For each node whose value shares storage with one of its inputs, that input.

    A node is a view if it is one in training or in eval mode (``Dropout`` returns its
    input in eval: ``NodeCost.eval_alias_of``). In-place ops are views of what they write.
    """
    parents: dict[fx.Node, fx.Node] = {}
    for node in graph_module.graph.nodes:
        written = mutated_arguments(graph_module, node)
        if len(written) == 1:
            parents[node] = written[0]
            continue
        cost = costs.get(node.name)
        for root in (cost.alias_of, cost.eval_alias_of) if cost is not None else ():
            same = [u for u in node.all_input_nodes if root is not None and
                    (u.name == root or (u.name in costs and costs[u.name].alias_of == root))]
            if same:
                parents[node] = same[0]
                break
    return parents


def _storage_roots(nodes: Sequence[fx.Node], parents: Mapping[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    roots: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        parent = parents.get(node)
        roots[node] = roots.get(parent, parent) if parent is not None else node
    return roots


def written_storage_roots(graph_module: fx.GraphModule, parents: Mapping[fx.Node, fx.Node]) -> frozenset[str]:
    """The values whose storage the captured code writes in place (the value itself or a view
    of it), before :func:`isolate_inplace` gives those writes tensors of their own: what the
    model's own forward, which ``graphckpt.enable`` runs, still writes (a ``ReLU(inplace=True)``
    on a Linear's output)."""
    nodes = list(graph_module.graph.nodes)
    roots = _storage_roots(nodes, parents)
    return frozenset(roots.get(target, target).name for node in nodes for target in mutated_arguments(graph_module, node))


def _view_children(parents: Mapping[fx.Node, fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """``parents`` turned round: each node's direct views."""
    children: dict[fx.Node, list[fx.Node]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    return children


def _sharing_storage(node: fx.Node, parents: Mapping[fx.Node, fx.Node],
                     children: Mapping[fx.Node, list[fx.Node]]) -> list[fx.Node]:
    """The nodes whose value shares ``node``'s storage: its root and every view below it,
    found in the group's size rather than the graph's (a 2000-block stack with an in-place
    ReLU and ``+=`` a block spent 6 s here when each op scanned the whole graph)."""
    root = node
    while root in parents:
        root = parents[root]
    group, stack = [], [root]
    while stack:
        member = stack.pop()
        group.append(member)
        stack.extend(children.get(member, ()))
    return group


def _reparent(parents: dict[fx.Node, fx.Node], children: dict[fx.Node, list[fx.Node]], node: fx.Node,
              parent: fx.Node | None) -> None:
    """Make ``node`` a view of ``parent`` (of nothing: ``None``) in both maps."""
    old = parents.pop(node, None)
    if old is not None:
        children[old].remove(node)
    if parent is not None:
        parents[node] = parent
        children.setdefault(parent, []).append(node)


def out_of_place_twin(graph_module: fx.GraphModule, node: fx.Node,
                      costs: Mapping[str, NodeCost] | None = None) -> tuple[str, Any, tuple, dict] | None:
    """The ``(op, target, args, kwargs)`` computing what in-place ``node`` writes into a new
    tensor instead, for the in-place ops whose out-of-place twin saves for backward only
    its result, as they do (``relu``, ``sigmoid``, ``tanh``), or nothing (``add``, ``sub``,
    ``mul``, ``div`` by a Python number; ``add``, ``sub`` of a tensor of the same dtype, as
    measured in ``costs``: a ResNet block's ``out += identity``); ``None`` for any other op.

    Run instead of a ``clone`` and the in-place op (:func:`isolate_inplace`), the twin makes
    the same value with one pass over memory instead of two, and leaves the same tensors
    alive. Twins saving their input (``hardtanh`` for ``ReLU6``, ``leaky_relu``, ``elu``)
    would keep the input alive beside the result, which eager does not, so those keep the
    clone. A ``ReLU(inplace=True)`` module becomes ``torch.nn.functional.relu``: the module
    holds nothing and the user's model keeps its own flag.

    >>> graph_module = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(inplace=True)))
    >>> out_of_place_twin(graph_module, list(graph_module.graph.nodes)[2])[1].__name__
    'relu'
    """
    if node.op == "call_module":
        return _module_twin(graph_module.get_submodule(node.target), node)
    if node.op == "call_method":
        return _method_twin(node, costs)
    if node.op == "call_function":
        return _function_twin(node, costs)
    return None


def _module_twin(module: torch.nn.Module, node: fx.Node) -> tuple[str, Any, tuple, dict] | None:
    """``ReLU(inplace=True)`` as ``torch.nn.functional.relu`` (exactly ``ReLU``: a subclass may do more)."""
    if type(module) is torch.nn.ReLU and module.inplace is True and len(node.args) == 1 and not node.kwargs:
        return ("call_function", torch.nn.functional.relu, node.args, {})
    return None


def _method_twin(node: fx.Node, costs: Mapping[str, NodeCost] | None) -> tuple[str, Any, tuple, dict] | None:
    """``x.relu_()`` as ``x.relu()``; in-place arithmetic as :func:`_arithmetic_twin` says."""
    if len(node.args) == 1 and not node.kwargs and node.target in _UNARY_METHOD_TWINS:
        return ("call_method", _UNARY_METHOD_TWINS[node.target], node.args, {})
    return _arithmetic_twin(node, costs)


def _function_twin(node: fx.Node, costs: Mapping[str, NodeCost] | None) -> tuple[str, Any, tuple, dict] | None:
    """``torch.relu_(x)`` or ``F.relu(x, inplace=True)`` as ``relu(x)``; in-place arithmetic
    (``x += 2``) as :func:`_arithmetic_twin` says."""
    if node.target in _ARITHMETIC_TWINS:
        return _arithmetic_twin(node, costs)
    inplace = inplace_flag(node)
    if len(node.args) + len(node.kwargs) != 1 + inplace:  # the value, and the flag if it is one
        return None
    if node.target in _TWIN_FUNCTIONS:
        return ("call_function", _TWIN_FUNCTIONS[node.target], node.args[:1], {})
    if node.target is torch.nn.functional.relu and inplace:
        return ("call_function", torch.nn.functional.relu, node.args[:1], {})
    return None


def _arithmetic_twin(node: fx.Node, costs: Mapping[str, NodeCost] | None) -> tuple[str, Any, tuple, dict] | None:
    """``x.mul_(2)`` as ``x.mul(2)`` and ``x += 2`` as ``x + 2`` (by a Python number); ``x.add_(y)``
    and ``x += y`` as ``x.add(y)``, ``x + y`` (a tensor of the same dtype, sums only: their
    backward saves neither operand, a product's saves both)."""
    twin = _ARITHMETIC_TWINS.get(node.target)
    if twin is None or not (_by_a_number(node) or (twin in _SUMS and _by_same_dtype(node, costs))):
        return None
    return (node.op, twin, node.args, {})


def _by_a_number(node: fx.Node) -> bool:
    """Whether ``node`` is ``value <op> number`` with a Python number: then the out-of-place
    op keeps the value's dtype wherever the in-place one runs, and saves nothing either way
    (a tensor operand could promote the dtype, so it keeps its clone)."""
    return (len(node.args) == 2 and not node.kwargs and isinstance(node.args[0], fx.Node)
            and isinstance(node.args[1], (int, float)))


def _by_same_dtype(node: fx.Node, costs: Mapping[str, NodeCost] | None) -> bool:
    """Whether ``node`` is ``value <op> other`` with ``other`` a tensor of ``value``'s one
    dtype: then the out-of-place op makes the dtype and shape the in-place one writes."""
    if len(node.args) != 2 or node.kwargs or not costs or not all(isinstance(a, fx.Node) for a in node.args):
        return False
    dtypes = [costs[a.name].dtype if a.name in costs else "" for a in node.args]
    return bool(dtypes[0]) and "," not in dtypes[0] and dtypes[0] == dtypes[1]


_UNARY_METHOD_TWINS = {"relu_": "relu", "sigmoid_": "sigmoid", "tanh_": "tanh"}
_ARITHMETIC_TWINS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", operator.iadd: operator.add,
                     operator.isub: operator.sub, operator.imul: operator.mul, operator.itruediv: operator.truediv}
_SUMS = {"add", "sub", operator.add, operator.sub}  # twins whose backward saves neither operand
_TWIN_FUNCTIONS = {torch.relu_: torch.relu, torch.nn.functional.relu_: torch.nn.functional.relu,
                   torch.sigmoid_: torch.sigmoid, torch.tanh_: torch.tanh}


def writes_activations(graph_module: fx.GraphModule) -> bool:
    """Whether an op writes in place into a value the graph computes rather than straight
    into an input or a buffer: whether :func:`isolate_inplace` may have work to do."""
    return any(len(written) == 1 and written[0].op not in ("placeholder", "get_attr")
               for written in (mutated_arguments(graph_module, node) for node in graph_module.graph.nodes))


def isolate_inplace(graph_module: fx.GraphModule, parents: dict[fx.Node, fx.Node],
                    costs: Mapping[str, NodeCost] | None = None) -> None:
    """Give each in-place op on an activation that can take one a tensor of its own to
    write: run its out-of-place twin instead (:func:`out_of_place_twin`), or else insert a
    ``clone`` before it, so that the written storage never needs to be a boundary.

    Safe when no other value sharing the written storage is read after the op: readers of
    the written value itself after the op are pointed at the new tensor. ``parents`` (from
    :func:`view_parents`) is kept up to date; ``costs``, the measured nodes, tell dtypes
    (:func:`out_of_place_twin`).
    """
    graph = graph_module.graph
    changed, twinned = False, []
    position: dict[fx.Node, float] = {n: i for i, n in enumerate(graph.nodes)}  # a clone: just before its op
    children = _view_children(parents)
    for node in list(graph.nodes):
        written = mutated_arguments(graph_module, node)
        if len(written) != 1:
            continue
        target = written[0]
        group = _sharing_storage(target, parents, children)
        if any(n.op in ("placeholder", "get_attr") for n in group):
            continue
        if any(position[r] > position[node] for n in group if n is not target and position[n] < position[node]
               for r in n.users):
            continue
        twin = out_of_place_twin(graph_module, node, costs)
        if twin is not None:
            inplace_name = _target_name(node)
            named_inplace = inplace_name.endswith("_") and node.name.startswith(inplace_name)
            node.op, node.target, node.args, node.kwargs = twin
            _reparent(parents, children, node, None)
            written_to = node
            if named_inplace:
                twinned.append(node)
        else:
            with graph.inserting_before(node):
                written_to = graph.call_method("clone", (target,))
            position[written_to] = position[node] - 0.5
        for reader in list(target.users):
            if reader is not written_to and (reader is node or position[reader] > position[node]):
                reader.replace_input_with(target, written_to)
                if parents.get(reader) is target:
                    _reparent(parents, children, reader, written_to)
        changed = True
    for node in twinned:  # after the loop: ``costs`` name the nodes as captured
        rename_node(node, _target_name(node))
    if changed:
        graph_module.recompile()


def _target_name(node: fx.Node) -> str:
    """The name fx makes a call's node name from (``mul_`` for ``x.mul_(2)``, ``relu`` for
    ``F.relu``): a twin named after its in-place op is renamed after its own, so generated
    code reads ``mul_4 = layers_4.mul(1.5)``, not ``mul__4``; a module's twin keeps its
    module path (``blocks_1_relu``)."""
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.name)


class MutationConstraints(NamedTuple):
    """Node names the in-place writes left in a graph constrain (:func:`mutation_constraints`)."""

    not_recomputable: set[str]
    not_cuttable: set[str]
    ordered: set[str]  # each write and the earlier readers of its storage: must not run after it
    state: set[str]  # (views of) buffers and inputs forward only updates (graphckpt.state)


def mutation_constraints(graph_module: fx.GraphModule, parents: Mapping[fx.Node, fx.Node]) -> MutationConstraints:
    """What the in-place writes left in ``graph_module`` forbid a plan to do.

    A write into an activation pins its storage (not cuttable) and the earlier readers'
    order; a write into an input or buffer that is read for its value makes the write and
    those readers unrecomputable. A state update (a buffer nothing reads but to update it)
    stays recomputable; only several updates of one buffer are ordered
    (:func:`_state_update_order`)."""
    nodes = list(graph_module.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    not_recomputable: set[str] = set()
    not_cuttable: set[str] = set()
    ordered: set[str] = set()
    roots = _storage_roots(nodes, parents)
    written = {node: mutated_arguments(graph_module, node) for node in nodes}
    state = state_roots(nodes, roots, written)
    for node in nodes:
        for target in written[node]:
            if roots[target] in state:
                continue
            group = [n for n in nodes if roots[n] is roots[target] and position[n] < position[node]]
            ordered.add(node.name)
            ordered.update(r.name for n in group for r in n.users if position[r] < position[node] and r.op != "output")
            if any(n.op in ("placeholder", "get_attr") for n in group):
                not_recomputable.add(node.name)
                not_recomputable.update(r.name for n in group for r in n.users
                                        if position[r] <= position[node])
            else:
                not_cuttable.update(n.name for n in group)
    more_ordered, more_fixed = _state_update_order(graph_module, nodes, roots, written)
    return MutationConstraints(not_recomputable | more_fixed, not_cuttable, ordered | more_ordered,
                               {n.name for n in nodes if roots[n] in state})


def _state_update_order(graph_module: fx.GraphModule, nodes: Sequence[fx.Node], roots: Mapping[fx.Node, fx.Node],
                        written: Mapping[fx.Node, Sequence[fx.Node]]) -> tuple[set[str], set[str]]:
    """``(ordered, not_recomputable)`` for buffers updated at several places (one norm layer
    called three times: momentum updates do not commute) or read as ``get_attr`` while a
    norm layer updates them: the updates and those readers keep their eager order, and a
    reader an update follows is not recomputed (its recompute would see later statistics)."""
    position = {n: i for i, n in enumerate(nodes)}
    updates: dict[str, list[fx.Node]] = {}
    for node in nodes:
        for key in state_keys(graph_module, node, roots, written):
            updates.setdefault(key, []).append(node)
    ordered: set[str] = set()
    fixed: set[str] = set()
    for key, writers in updates.items():
        attributes = {n for n in nodes if n.op == "get_attr" and n.target == key}
        readers = [r for n in nodes if roots[n] in attributes for r in n.users
                   if r not in writers and r.op != "output"]
        if len(writers) > 1 or readers:
            ordered.update(n.name for n in (*writers, *readers))
        last = max(position[w] for w in writers)
        fixed.update(r.name for r in readers if position[r] < last)
    return ordered, fixed
