"""What keeping values costs in bytes: the storage a value keeps alive, a segment
boundary's kept set, a value's gradient and the one summed gradient of a parameter several
ops read.

The facts the cut heuristics, the planners and the simulator price plans with, read from
the node attributes :mod:`passes.costgraph` defines (``bytes``, ``alias_of``, ``cuttable``,
``requires_grad``, ``param_grad_bytes``, ``param_grads``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import networkx as nx

from passes.graph_facts import in_order, per_graph, storage_root


def gradient_bytes(graph: nx.DiGraph, name: str) -> int:
    """Bytes of ``name``'s gradient buffer: its ``grad_bytes`` where the profile gave one (a
    view's own size), else the size of the storage it lives in."""
    own = graph.nodes[name]["grad_bytes"]
    return graph.nodes[storage_root(graph, name)]["bytes"] if own is None else own


class CastUp(NamedTuple):
    """How an op's backward makes the gradients of the parameters it reads through autocast's
    16-bit casts (``param_grad_cast_bytes``), as the simulator and the exact solver's training
    graph both count it: its function makes them ``narrowed_by`` bytes smaller than
    ``param_grad_bytes`` (16-bit), ``backward_extra_bytes`` already holds ``scratch_less`` of
    them, and once it has returned they are cast up with ``moment`` bytes on top of them."""

    narrowed_by: int
    scratch_less: int
    moment: int


def cast_up(cast_bytes: int, narrow_bytes: int, reads_shared: bool) -> CastUp:
    """:class:`CastUp` of an op whose cast parameters' gradients are ``cast_bytes`` at full
    width and ``narrow_bytes`` at 16 bits. The op reading a shared weight (``reads_shared``)
    holds that gradient at full width from its function on, as the sum needs it: its scratch,
    counted on the 16-bit gradient, is that much less, and the cast up holds the 16-bit one
    on top.

    >>> cast_up(40, 20, False), cast_up(40, 20, True)
    (CastUp(narrowed_by=20, scratch_less=0, moment=40), CastUp(narrowed_by=0, scratch_less=20, moment=20))
    """
    if reads_shared:
        return CastUp(0, cast_bytes - narrow_bytes, narrow_bytes if cast_bytes else 0)
    return CastUp(cast_bytes - narrow_bytes, 0, cast_bytes)


def _parameter_readers(graph: nx.DiGraph) -> dict[str, tuple[int, list[str]]]:
    """Every trained parameter, as ``name -> (gradient bytes, the ops that take part in
    backward and make a gradient for it)``: the ops reading a ``param`` value and those naming
    the parameter in ``param_grads``. A ``param`` goes by the model's name for it when it has
    one, so a module's own weight read elsewhere as a value is one parameter."""
    readers: dict[str, tuple[int, list[str]]] = {}
    for name in in_order(graph):
        attributes = graph.nodes[name]
        if attributes["kind"] == "param" and attributes["param_grad_bytes"]:
            key, nbytes = (*attributes["param_grads"], (name, attributes["param_grad_bytes"]))[0]
            ops = [r for r in graph.successors(name) if _in_backward(graph.nodes[r])]
            readers.setdefault(key, (nbytes, []))[1].extend(ops)
        elif _in_backward(attributes):
            for key, nbytes in attributes["param_grads"]:
                readers.setdefault(key, (nbytes, []))[1].append(name)
    return readers


def _in_backward(attributes: Mapping[str, Any]) -> bool:
    """Whether the node with these attributes is an op whose backward runs (it takes part in backward)."""
    return attributes["kind"] == "op" and attributes["requires_grad"]


@per_graph
def shared_parameters(graph: nx.DiGraph) -> list[tuple[str, int, tuple[str, ...]]]:
    """Trained parameters several ops that take part in backward make gradients for, as
    ``(param, gradient bytes, readers)``: autograd sums their gradients in one buffer that
    lives from the first reader's backward to the last one's, not one reader's moment. The
    readers of a ``param`` value, and the ops naming one parameter in ``param_grads``: in an
    fx capture a module called twice is two ops holding the same weights."""
    shared = []
    for param, (nbytes, ops) in _parameter_readers(graph).items():
        readers = tuple(dict.fromkeys(ops))
        if len(readers) > 1:
            shared.append((param, nbytes, readers))
    return shared


def shared_by_reader(graph: nx.DiGraph) -> dict[str, list[tuple[str, int]]]:
    """For each op, the shared parameters it makes a gradient for (:func:`shared_parameters`),
    as ``(param, gradient bytes)`` in their order there."""
    by_reader: dict[str, list[tuple[str, int]]] = {}
    for param, nbytes, readers in shared_parameters(graph):
        for reader in readers:
            by_reader.setdefault(reader, []).append((param, nbytes))
    return by_reader


def keep_cost(graph: nx.DiGraph, name: str) -> float:
    """Bytes it costs to keep ``name`` alive across a boundary; ``inf`` when not cuttable.

    Inputs and parameters (and views of them) cost nothing: something else holds them.
    A view costs the bytes of the storage it keeps alive.
    """
    if not graph.nodes[name]["cuttable"]:
        return float("inf")
    root = storage_root(graph, name)
    if graph.nodes[root]["kind"] != "op":
        return 0.0
    return float(graph.nodes[root]["bytes"])


def boundary(graph: nx.DiGraph, before: set[str]) -> set[str]:
    """Values computed in ``before`` that something outside ``before`` still reads.

    ``before`` is a down-closed set (it holds the inputs of each of its nodes, parameters
    aside): the values computed before a segment boundary.
    """
    return {u for u in before for v in graph.successors(u) if v not in before}


def storage_bytes(graph: nx.DiGraph, values: Iterable[str]) -> int:
    """Activation bytes ``values`` keep alive: each storage they live in once, those of
    inputs and parameters (and views of them) free, as something else holds them."""
    roots = {storage_root(graph, name) for name in values}
    return sum(graph.nodes[root]["bytes"] for root in roots if graph.nodes[root]["kind"] == "op")


def boundary_bytes(graph: nx.DiGraph, values: Iterable[str]) -> float:
    """Bytes kept alive by a set of values kept at a boundary (:func:`storage_bytes`);
    ``inf`` if any is not cuttable."""
    values = list(values)
    if not all(graph.nodes[name]["cuttable"] for name in values):
        return float("inf")
    return float(storage_bytes(graph, values))
