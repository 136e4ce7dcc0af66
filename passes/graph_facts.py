"""Facts the passes read of a built cost graph (:mod:`passes.costgraph`): execution order,
the op nodes, the forward's outputs, which ops draw random numbers or may run again, storage
owners, and flat maps of node attributes. Planning asks each of them thousands of times per
plan it weighs, so the ones over the whole graph are found once per graph
(:func:`per_graph_value`); a cost graph's attributes do not change once it is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import wraps
from types import MappingProxyType
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

import networkx as nx

T = TypeVar("T")
S = TypeVar("S")


def in_order(graph: nx.DiGraph, nodes: Iterable[str] | None = None) -> list[str]:
    """The given nodes (default: all, sorted once per graph: :func:`all_in_order`) sorted
    by execution order."""
    if nodes is None:
        return all_in_order(graph)
    nodes = list(nodes)
    return nodes if len(nodes) < 2 else sorted(nodes, key=node_attribute(graph, "order").__getitem__)


def per_graph_value(function: Callable[[nx.DiGraph], T]) -> Callable[[nx.DiGraph], T]:
    """Memoise ``function(graph)`` per cost graph: planning asks for the same facts many
    times, and a cost graph's attributes do not change once it is built. A graph still being
    built (nodes added since) is asked again. The value is shared: make a fact immutable; a
    cache that fills as it is asked (a dict, e.g. :func:`node_attribute`'s) says so."""
    memo: WeakKeyDictionary[nx.DiGraph, tuple[int, T]] = WeakKeyDictionary()

    @wraps(function)
    def memoised(graph: nx.DiGraph) -> T:
        size, entry = len(graph), memo.get(graph)
        if entry is None or entry[0] != size:
            entry = memo[graph] = size, function(graph)
        return entry[1]

    return memoised


def per_segment(function: Callable[[nx.DiGraph, S], T]) -> Callable[[nx.DiGraph, S], T]:
    """Memoise ``function(graph, segment)`` per cost graph and segment (segments are frozen
    and compare by value): the simulator, the cost and the keep searches ask the same
    facts of the same segments many times (a 50k-node budget plan asked whether ~100
    segments run by hooks 1027 times, 3.7 s). Like :func:`per_graph_value`: a graph still
    being built is asked again, and the value is shared, so make it immutable."""
    memo: WeakKeyDictionary[nx.DiGraph, tuple[int, dict]] = WeakKeyDictionary()
    missing = object()

    @wraps(function)
    def memoised(graph: nx.DiGraph, segment: S) -> T:
        size, entry = len(graph), memo.get(graph)
        if entry is None or entry[0] != size:
            entry = memo[graph] = size, {}
        found = entry[1].get(segment, missing)
        if found is missing:
            found = entry[1][segment] = function(graph, segment)
        return found

    return memoised


def per_graph(function: Callable[[nx.DiGraph], list]) -> Callable[[nx.DiGraph], list]:
    """:func:`per_graph_value` of a list-valued ``function``; callers get a copy."""
    memoised = per_graph_value(function)
    return wraps(function)(lambda graph: list(memoised(graph)))


@per_graph
def all_in_order(graph: nx.DiGraph) -> list[str]:
    """Every node in execution order (a sort reading every node's attribute dict: planning
    asks for it from several passes)."""
    return sorted(graph.nodes, key=node_attribute(graph, "order").__getitem__)


@per_graph
def op_nodes(graph: nx.DiGraph) -> list[str]:
    """The computed values (kind ``op``) in execution order: what segments partition."""
    kind = node_attribute(graph, "kind")
    return [n for n in in_order(graph) if kind[n] == "op"]


@per_graph_value
def output_sink(graph: nx.DiGraph) -> str | None:
    """The node of kind ``output`` that gathers the forward's results (``None`` in a graph
    without one)."""
    return next((n for n, kind in graph.nodes(data="kind") if kind == "output"), None)


@per_graph
def graph_outputs(graph: nx.DiGraph) -> list[str]:
    """The values the forward returns (those the output sink reads), in execution order
    (asked by every replay and every validity check of a plan search)."""
    sink = output_sink(graph)
    return [] if sink is None else in_order(graph, set(graph.predecessors(sink)))


def needs_grad(graph: nx.DiGraph, name: str) -> bool:
    """Whether backward computes a gradient for this value (ops and inputs that require it)."""
    return graph.nodes[name]["requires_grad"] and graph.nodes[name]["kind"] in ("op", "input")


def inputs_without_grad(graph: nx.DiGraph) -> tuple[str, ...]:
    """The graph's inputs that needed no gradient in the example it was costed on but could
    need one in training (floating point): what ops save for backward was measured without
    their gradient, so a plan holds more than simulated when training passes one that needs
    it (``x * x`` on such an input saves ``x`` twice). A rewritten module checks them at
    each call (:func:`graphckpt.planned_inputs.warn_if_needs_grad`)."""
    return tuple(name for name, attributes in graph.nodes(data=True)
                 if attributes["kind"] == "input" and not attributes["requires_grad"]
                 and str(attributes.get("dtype", "")).startswith(("float", "bfloat", "complex")))


def keeps_order(graph: nx.DiGraph, name: str) -> bool:
    """Whether ``name`` must keep its eager order relative to the other such nodes
    (random draws, and in-place writes with the readers before them)."""
    attributes = graph.nodes[name]
    return attributes["random"] or attributes["ordered"]


def draws_random(graph: nx.DiGraph, nodes: Iterable[str]) -> bool:
    """Whether running ``nodes`` may draw random numbers, so that recomputing them must
    replay the generator's state; unknown, so yes, on a graph costed without inputs."""
    return not graph.graph.get("measured", False) or not random_nodes(graph).isdisjoint(nodes)


@per_graph_value
def random_nodes(graph: nx.DiGraph) -> frozenset[str]:
    """The nodes that draw random numbers: planning asks :func:`draws_random` of every
    segment it weighs, a set answers without reading each node's attributes again."""
    return frozenset(name for name, random in graph.nodes(data="random") if random)


def pure(graph: nx.DiGraph, name: str) -> bool:
    """Whether running op ``name`` again without gradients gives forward's value and changes
    nothing: recomputable, no random draw, no in-place write or state update kept in order,
    no storage written later, and no ``state`` value read (it changed since)."""
    return name in pure_ops(graph)


@per_graph_value
def pure_ops(graph: nx.DiGraph) -> frozenset[str]:
    """Every op :func:`pure` holds for, found once per cost graph (planning asks of every
    node of every segment it weighs)."""
    return frozenset(name for name in _repeatable_ops(graph) if not graph.nodes[name]["random"])


@per_graph_value
def redrawable_ops(graph: nx.DiGraph) -> frozenset[str]:
    """The dropouts a segment run by saved-tensor hooks may draw again
    (:func:`passes.hooked.redrawn`): ``redrawable`` ops that would be :func:`pure` but for
    their draw, on a measured graph (an unmeasured one knows nothing of draws)."""
    if not graph.graph.get("measured", False):
        return frozenset()
    return frozenset(name for name in _repeatable_ops(graph) if graph.nodes[name]["redrawable"])


def _repeatable_ops(graph: nx.DiGraph) -> list[str]:
    """Ops that may run again with no effect but their value (and draws): recomputable,
    cuttable, no in-place write or state update kept in order, no ``state`` value read."""
    state = {name for name, value in graph.nodes(data="state") if value}
    return [name for name, attributes in graph.nodes(data=True)
            if attributes["kind"] == "op" and attributes["recomputable"] and attributes["cuttable"]
            and not (attributes["ordered"] or attributes["state"]) and state.isdisjoint(graph.predecessors(name))]


def node_attribute(graph: nx.DiGraph, key: str) -> Mapping[str, Any]:
    """Every node's ``key`` attribute by node name, read from the graph once. The planner
    reads ``flops``, ``bytes`` and ``saves_from`` of every node thousands of times; a flat
    map is faster to read than ``graph.nodes[name][key]`` and, unlike 50k attribute dicts,
    stays in the CPU caches (those reads grew faster than the graph did)."""
    columns = _node_attributes(graph)
    if key not in columns:
        columns[key] = MappingProxyType(dict(graph.nodes(data=key)))
    return columns[key]


@per_graph_value
def _node_attributes(graph: nx.DiGraph) -> dict[str, Mapping[str, Any]]:
    """The memo of :func:`node_attribute`: attribute name -> its map, filled as asked."""
    return {}


def is_activation(graph: nx.DiGraph, name: str) -> bool:
    """True for values that cost activation memory when kept (not inputs, params, output)."""
    return graph.nodes[name]["kind"] == "op"


def storage_root(graph: nx.DiGraph, name: str) -> str:
    """The value that owns ``name``'s storage (itself when it is not an alias)."""
    return graph.nodes[name]["alias_of"] or name


@per_segment
def leaves_nothing(graph: nx.DiGraph, segment: Any) -> bool:
    """Whether a recomputed segment's checkpoint call leaves nothing behind once its forward
    returns: no op in it saves anything for backward (nor does it nest a recomputed child,
    which saves its inputs), and it keeps nothing from forward. No saved-tensor handle then
    holds the call's frame, so its inputs go at their last use as in eager code, and backward
    reruns nothing (:func:`passes.recompute.recompute_steps` finds no step). For example, a
    segment cut around ``scores * scale + mask`` (neither op saves): LLaMA's sqrt plan on a
    GPU held each layer's 256 MiB attention scores in the simulation, 6.07 GiB against 4.06
    measured."""
    saves_from = node_attribute(graph, "saves_from")
    return (segment.recompute and not segment.saved_inside and not any(c.recompute for c in segment.children)
            and all(saves_from[name] == "nothing" for name in segment.nodes))
