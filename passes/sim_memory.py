"""The simulator's live memory: storages alive, why, and the running peak.

:mod:`passes.simulate` replays a plan's step over a :class:`LiveMemory`; this module holds the
bookkeeping it replays onto (reasons a storage lives, recomputed copies per nesting level,
gradient buffers shared by views, summed gradients of shared parameters) and the index of a
cost graph the replay reads (:func:`graph_index`), so the replay's own module is about the
order things happen in.

The replay runs on integer node ids and flat lists built once per graph, and names what it
allocates by integer keys (:func:`slot`): on a 50k-node graph the name-keyed dicts of
attribute dicts and the tuple keys it used to build outgrew the CPU caches, so each of its
millions of steps got slower as graphs grew (the plan stages grew as n^1.14-1.35 from 10k
to 50k nodes where their work is linear).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import networkx as nx

from passes.kept_bytes import CastUp, cast_up, shared_by_reader, shared_parameters

# What an integer key names, beside the node (:func:`slot`); a value's storage is VALUE.
SLOT_KINDS = 11
(VALUE, EXTRA, FORWARD_EXTRA, SELECTIVE_EXTRA, GRAD_PARTIAL, GRAD, PARAM_ACCUMULATOR, PARAM_GRAD, BACKWARD_EXTRA,
 AUTOCAST_CACHE, STATE_COPY) = range(SLOT_KINDS)


def slot(node: int, kind: int) -> int:
    """The integer key of ``kind`` bytes belonging to node id ``node`` (forward's storage
    for :data:`VALUE`; :meth:`LiveMemory.key` adds the nesting level of a recomputed copy)."""
    return node * SLOT_KINDS + kind


@dataclass(frozen=True)
class GraphIndex:
    """A cost graph's attributes and edges as flat lists indexed by node id (``ids[name]``):
    the replay reads them millions of times on large graphs, and networkx views and
    per-node attribute dicts are slow to index and large to keep in cache."""

    ids: dict[str, int]
    names: list[str]
    owns: list[bool]  # the node owns its storage (not an alias)
    nbytes: list[int]
    roots: list[int]  # the id owning each node's storage
    value_keys: list[int]  # the key of each node's storage in forward (:meth:`LiveMemory.key` with no recompute open)
    readers: list[tuple[int, ...]]
    activation_reads: list[tuple[int, ...]]  # reads that are not parameters: what a read releases
    saved: list[tuple[int, ...]]
    released_early: list[tuple[int, ...]]
    saved_extra: list[int]
    forward_extra: list[int]
    cached_rerun_extra: list[int]  # forward_extra of a rerun whose kernels the selective cache serves
    selective_forward_extra: list[int]  # forward_extra under selective checkpointing's dispatch mode
    autocast_cache: list[int]
    autocast_cached: tuple[int, ...]  # the nodes with ``autocast_cache`` bytes
    state_copy: list[int]  # the recompute's copies of running statistics an op saves (``state_copy_bytes``)
    state_copied: frozenset[int]  # the nodes with ``state_copy`` bytes (none on most graphs)
    selective_extra: list[int]
    backward_extra: list[int]
    param_grad: list[int]
    cast_up: list[CastUp]  # how it makes the gradients of parameters it reads through autocast's casts
    grad_views: list[bool]
    grad_reads: list[tuple[tuple[int, int], ...]]  # reads backward makes a gradient for, with its bytes
    shared: list[tuple[tuple[int, int], ...]]  # op -> (shared parameter's id, gradient bytes) it reads
    shared_readers: dict[int, int]  # shared parameter's id (after the nodes') -> readers adding to its gradient

    def id_list(self, names: Iterable[str]) -> list[int]:
        """The ids of ``names``, in order."""
        ids = self.ids
        return [ids[name] for name in names]


_GRAPH_INDEXES: WeakKeyDictionary[nx.DiGraph, GraphIndex] = WeakKeyDictionary()


def graph_index(graph: nx.DiGraph) -> GraphIndex:
    """The :class:`GraphIndex` of ``graph``, built once (cost graphs do not change once built)."""
    if graph not in _GRAPH_INDEXES:
        _GRAPH_INDEXES[graph] = _build_index(graph)
    return _GRAPH_INDEXES[graph]


def _build_index(graph: nx.DiGraph) -> GraphIndex:
    """:class:`GraphIndex` lists from one pass over ``graph``'s nodes, each node's attributes
    read together (a pass per attribute touched every attribute dict again: 10x slower at 50k
    nodes than at 10k, once the dicts outgrow the caches), then one over its edges."""
    names = list(graph)
    ids = {name: index for index, name in enumerate(names)}
    columns: dict[str, list] = {key: [] for key in _COLUMNS}
    is_param, grad_from = [], []
    for attributes in map(graph.nodes.__getitem__, names):
        for key, column in columns.items():
            column.append(attributes[key])
        is_param.append(attributes["kind"] == "param")
        grad_from.append(attributes["requires_grad"] and attributes["kind"] in ("op", "input"))
    roots = [index if alias is None else ids[alias] for index, alias in enumerate(columns["alias_of"])]
    grad_bytes = [columns["bytes"][root] if own is None else own  # :func:`passes.kept_bytes.gradient_bytes`
                  for root, own in zip(roots, columns["grad_bytes"], strict=True)]
    pred, succ = graph.pred, graph.succ  # each graph.pred makes a new view: bound once
    reads = [[ids[v] for v in pred[name]] for name in names]
    params = shared_parameters(graph)  # they go by the model's names, not always nodes: ids past the nodes'
    param_ids = {param: len(names) + number for number, (param, _, _) in enumerate(params)}
    shared_readers = {param_ids[param]: len(readers) for param, _, readers in params}
    by_reader = shared_by_reader(graph)
    shared = [[(param_ids[param], nbytes) for param, nbytes in by_reader.get(name, ())] for name in names]
    return GraphIndex(
        ids=ids,
        names=names,
        owns=[alias is None for alias in columns["alias_of"]],
        nbytes=columns["bytes"],
        roots=roots,
        value_keys=[slot(root, VALUE) for root in roots],
        readers=[tuple(ids[r] for r in succ[name]) for name in names],
        activation_reads=[tuple(v for v in read if not is_param[v]) for read in reads],
        saved=[tuple(map(ids.__getitem__, saved)) for saved in columns["saved"]],
        released_early=[tuple(map(ids.__getitem__, early)) for early in columns["released_early"]],
        saved_extra=columns["saved_extra_bytes"],
        forward_extra=columns["forward_extra_bytes"],
        cached_rerun_extra=[extra if cached is None else cached
                            for extra, cached in zip(columns["forward_extra_bytes"], columns["cached_rerun_extra_bytes"],
                                                     strict=True)],
        selective_forward_extra=[extra if moded is None else moded
                                 for extra, moded in zip(columns["forward_extra_bytes"],
                                                         columns["selective_forward_extra_bytes"], strict=True)],
        autocast_cache=columns["autocast_cache_bytes"],
        autocast_cached=tuple(i for i, cached in enumerate(columns["autocast_cache_bytes"]) if cached),
        state_copy=columns["state_copy_bytes"],
        state_copied=frozenset(i for i, copied in enumerate(columns["state_copy_bytes"]) if copied),
        selective_extra=columns["selective_extra_bytes"],
        backward_extra=columns["backward_extra_bytes"],
        param_grad=columns["param_grad_bytes"],
        cast_up=[cast_up(cast, narrow, bool(params)) for cast, narrow, params in
                 zip(columns["param_grad_cast_bytes"], columns["param_grad_narrow_bytes"], shared, strict=True)],
        grad_views=[bool(views) for views in columns["grad_views"]],
        grad_reads=[tuple((v, grad_bytes[v]) for v in read if grad_from[v]) for read in reads],
        shared=[tuple(params) for params in shared],
        shared_readers=shared_readers,
    )


_COLUMNS = ("alias_of", "bytes", "saved", "released_early", "saved_extra_bytes", "forward_extra_bytes",
            "cached_rerun_extra_bytes", "selective_forward_extra_bytes", "autocast_cache_bytes", "selective_extra_bytes",
            "backward_extra_bytes", "state_copy_bytes",
            "param_grad_bytes", "param_grad_cast_bytes", "param_grad_narrow_bytes", "grad_views", "grad_bytes")


class LimitExceeded(Exception):
    """The running peak went above :attr:`LiveMemory.limit`: the replay stops there."""


class LiveMemory:
    """Live storages with the number of reasons each is alive, and the running peak.

    Keys are integers (:func:`slot`), or tuples for the few generator-state copies. Values
    of a segment being recomputed get storages of their own: the recompute makes new
    tensors even where forward's are still alive. ``fresh`` is a stack with one set of
    recomputed node ids per level of nesting; a value belongs to the innermost level naming it.
    A peak above ``limit`` raises :class:`LimitExceeded` (a replay that only asks whether a plan
    stays under some peak need not go on once it does not).
    """

    def __init__(self, graph: nx.DiGraph, limit: float = float("inf")) -> None:
        self.graph = graph
        self.index = graph_index(graph)
        self.size = len(self.index.names)
        self.holds: dict = {}
        self.live: dict = {}
        self.fresh: list[set[int]] = []
        self.grad_buffer: dict[int, int] = {}  # a value's gradient -> the buffer key it is a view of
        self.views_of: dict[int, int] = {}  # gradient buffer key -> gradients viewing it
        self.current = 0
        self.peak = 0
        self.limit = limit
        self.pending_readers = dict(self.index.shared_readers)  # shared parameter -> backward still to add

    def key(self, node: int) -> int:
        """The key of ``node``'s storage: forward's, or the innermost recompute's copy."""
        root = self.index.roots[node]
        fresh = self.fresh
        if not fresh:  # forward, and kept segments' backward: forward's storage
            return self.index.value_keys[node]
        for level in range(len(fresh) - 1, -1, -1):
            if root in fresh[level]:
                return ((level + 1) * self.size + root) * SLOT_KINDS + VALUE
        return root * SLOT_KINDS + VALUE

    def allocate(self, key: int | tuple, nbytes: int) -> None:
        """``nbytes`` more live under ``key``, unless ``key`` is live already (or nothing)."""
        if nbytes and key not in self.live:
            self.live[key] = nbytes
            self.current += nbytes
            if self.current > self.peak:
                self.raise_peak(self.current)

    def touch(self, nbytes: int) -> None:
        """``nbytes`` live for a moment only (temporaries freed right after they are made)."""
        if self.current + nbytes > self.peak:
            self.raise_peak(self.current + nbytes)

    def raise_peak(self, peak: int) -> None:
        """A new running peak: recorded, or :class:`LimitExceeded` past ``limit``. The one
        place a replay reaches a new peak, so a memory that watches the live set there
        (:mod:`passes.sim_peak`) overrides it."""
        self.peak = peak
        if peak > self.limit:
            raise LimitExceeded(peak)

    def hold(self, node: int, times: int = 1, key: int | None = None) -> None:
        """One more reason (``times`` more) for ``node``'s storage (``key``, when known) to live."""
        if key is None:
            key = self.key(node)
        self.holds[key] = self.holds.get(key, 0) + times

    def release(self, node: int, times: int = 1, key: int | None = None) -> None:
        """One reason fewer; the storage is freed when none is left."""
        if key is None:
            key = self.key(node)
        left = self.holds.get(key, 0) - times
        self.holds[key] = left
        if left <= 0:
            self.current -= self.live.pop(key, 0)

    def free(self, key: int | tuple) -> None:
        """Drop whatever is live under ``key``."""
        self.current -= self.live.pop(key, 0)

    def share_gradient(self, value: int, owner: int) -> None:
        """``value``'s gradient is a view of ``owner``'s (a ``grad_views`` node's input)."""
        buffer = self.grad_buffer.get(owner, owner * SLOT_KINDS + GRAD)
        self.grad_buffer[value] = buffer
        self.views_of[buffer] = self.views_of.get(buffer, 0) + 1

    def gradient_buffer(self, value: int) -> int:
        """The key of the buffer ``value``'s gradient is (or is a view of)."""
        return self.grad_buffer.get(value, value * SLOT_KINDS + GRAD)

    def shares_gradient(self, value: int) -> bool:
        """Whether ``value``'s gradient is a view of a buffer another value's gradient views too."""
        buffer = self.grad_buffer.get(value)
        return buffer is not None and self.views_of[buffer] > 1

    def backward_begins(self, node: int) -> None:
        """``node``'s backward starts (every op's, gradient or not). Nothing to do here; a
        memory that notes where each op's backward runs (:mod:`passes.plan_start`) overrides it."""

    def free_gradient(self, value: int) -> None:
        """Drop ``value``'s gradient; a shared buffer goes when its last view does."""
        own = value * SLOT_KINDS + GRAD
        buffer = self.grad_buffer.pop(value, own)
        views = self.views_of.get(buffer, 0)
        if buffer != own or views == 0:
            views -= buffer != own
            self.views_of[buffer] = views
            if views <= 0:
                self.views_of.pop(buffer, None)
                self.free(buffer)
