"""The simulator's live memory: storages alive, why, and the running peak.

:mod:`passes.simulate` replays a plan's step over a :class:`LiveMemory`; this module holds the
bookkeeping it replays onto (reasons a storage lives, recomputed copies per nesting level,
gradient buffers shared by views, summed gradients of shared parameters) and the plain-dict
index of a cost graph the replay reads (:func:`graph_index`), so the replay's own module is
about the order things happen in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import networkx as nx

from passes.costgraph import needs_grad, storage_root
from passes.kept_bytes import gradient_bytes, shared_parameters


@dataclass(frozen=True)
class GraphIndex:
    """A cost graph's attributes and edges as plain dicts: the replay reads them millions
    of times on large graphs, and networkx views are slow to index."""

    attributes: dict[str, dict]
    roots: dict[str, str]
    readers: dict[str, tuple[str, ...]]
    reads: dict[str, tuple[str, ...]]
    activation_reads: dict[str, tuple[str, ...]]  # reads that are not parameters: what a read releases
    grad_reads: dict[str, tuple[tuple[str, int], ...]]  # reads backward makes a gradient for, with its bytes
    shared: dict[str, tuple[tuple[str, int], ...]]  # op -> (shared parameter, gradient bytes) it reads
    shared_readers: dict[str, int]  # shared parameter -> readers whose backward adds to its gradient


_GRAPH_INDEXES: WeakKeyDictionary[nx.DiGraph, GraphIndex] = WeakKeyDictionary()


def graph_index(graph: nx.DiGraph) -> GraphIndex:
    """The :class:`GraphIndex` of ``graph``, built once (cost graphs do not change once built)."""
    if graph not in _GRAPH_INDEXES:
        _GRAPH_INDEXES[graph] = GraphIndex(
            attributes=dict(graph.nodes(data=True)),
            roots={name: storage_root(graph, name) for name in graph},
            readers={name: tuple(graph.successors(name)) for name in graph},
            reads={name: tuple(graph.predecessors(name)) for name in graph},
            activation_reads={name: tuple(v for v in graph.predecessors(name) if graph.nodes[v]["kind"] != "param")
                              for name in graph},
            grad_reads={name: tuple((v, gradient_bytes(graph, v)) for v in graph.predecessors(name)
                                    if needs_grad(graph, v)) for name in graph},
            shared=_shared_by_reader(graph),
            shared_readers={param: len(readers) for param, _, readers in shared_parameters(graph)},
        )
    return _GRAPH_INDEXES[graph]


def _shared_by_reader(graph: nx.DiGraph) -> dict[str, tuple[tuple[str, int], ...]]:
    by_reader: dict[str, list[tuple[str, int]]] = {name: [] for name in graph}
    for param, nbytes, readers in shared_parameters(graph):
        for reader in readers:
            by_reader[reader].append((param, nbytes))
    return {name: tuple(params) for name, params in by_reader.items()}


class LiveMemory:
    """Live storages with the number of reasons each is alive, and the running peak.

    Values of a segment being recomputed get storages of their own: the recompute makes new
    tensors even where forward's are still alive. ``fresh`` is a stack with one set of
    recomputed values per level of nesting; a value belongs to the innermost level naming it.
    """

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph = graph
        self.index = graph_index(graph)
        self.holds: Counter = Counter()
        self.live: dict = {}
        self.fresh: list[set[str]] = []
        self.grad_buffer: dict[str, tuple] = {}  # a value's gradient -> the buffer it is a view of
        self.views_of: Counter = Counter()  # gradient buffer -> gradients viewing it
        self.current = 0
        self.peak = 0
        self.pending_readers = Counter(self.index.shared_readers)  # shared parameter -> backward still to add

    def key(self, name: str) -> tuple:
        root = self.index.roots[name]
        if not self.fresh:
            return ("value", root)
        for level in range(len(self.fresh) - 1, -1, -1):
            if root in self.fresh[level]:
                return ("recomputed", level, root)
        return ("value", root)

    def allocate(self, key: tuple, nbytes: int) -> None:
        if key not in self.live and nbytes:
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def hold(self, name: str, times: int = 1, key: tuple | None = None) -> None:
        """One more reason (``times`` more) for ``name``'s storage (``key``, when known) to live."""
        self.holds[key or self.key(name)] += times

    def release(self, name: str, times: int = 1, key: tuple | None = None) -> None:
        """One reason fewer; the storage is freed when none is left."""
        key = key or self.key(name)
        self.holds[key] -= times
        if self.holds[key] <= 0:
            self.free(key)

    def free(self, key: tuple) -> None:
        self.current -= self.live.pop(key, 0)

    def share_gradient(self, value: str, owner: str) -> None:
        """``value``'s gradient is a view of ``owner``'s (a ``grad_views`` node's input)."""
        buffer = self.grad_buffer.get(owner, ("grad", owner))
        self.grad_buffer[value] = buffer
        self.views_of[buffer] += 1

    def free_gradient(self, value: str) -> None:
        """Drop ``value``'s gradient; a shared buffer goes when its last view does."""
        buffer = self.grad_buffer.pop(value, ("grad", value))
        if buffer != ("grad", value) or self.views_of[buffer] == 0:
            self.views_of[buffer] -= buffer != ("grad", value)
            if self.views_of[buffer] <= 0:
                self.views_of.pop(buffer, None)
                self.free(buffer)
