"""The training graph the exact solver (:mod:`passes.checkmate`) schedules, and the peak of
a schedule over it: forward ops, gradient seeds and backward nodes, one stage each.

The graph (one node per stage; it mirrors :mod:`passes.simulate`, so the schedule
without recompute peaks at the simulator's eager peak). Forward: the op nodes in ``order``
(size ``bytes``, 0 for views); an op with ``saved_extra_bytes`` is preceded by an *extra*
node of that size, made only together with its op and only if wanted (a recomputed segment
does not save in forward); an op run without it holds it for a moment all the same
(:meth:`TrainingGraph.extra_node`). An op reading a view also reads the view's storage root. Then one
gradient seed per graph output that needs a gradient (size: its gradient's bytes,
:func:`passes.kept_bytes.gradient_bytes`; the loss working set ``passes.sim_loss.LOSS_WORKING_SET`` x those
bytes is held for a moment; the model's own loss's seed and, for a loss computed outside, the
loss's scalars are kept to the end). Then, ops in reverse, the backward of op ``k`` (:mod:`passes.training_backward`) as
autograd's engine runs it. Its function: one node per gradient buffer it creates, new or the
first gradient of a weight several ops share (one node if none), each reading ``k``'s
gradient buffer, the buffers it adds into, ``k``'s extra and the storage roots of ``k``'s
``saved`` values; its ``param_grad_bytes``, its ``backward_extra_bytes`` and the gradients
it adds into existing buffers are held for a moment (*transient* bytes). Then, its saved
values let go, the sums: a node per gradient summed out of place into a new buffer, and one
for the sums into shared weights' buffers, with everything it returned held for a moment.
The gradients a ``grad_views`` op (``cat``, ``stack``, an ``add`` passing its gradient
through) hands its inputs are views of its own gradient: no nodes of their own, its
gradient's node stands for them, read by every backward that reads theirs, so it lives until
the last of them is used. A gradient added into a buffer another value's gradient still is,
that its gradient is a view of, or that is a slice of a larger one, is summed out of place
(autograd adds in place only into a dense tensor it holds the only reference to). Inputs and
params are free; input gradients, graph outputs and their storage roots stay in memory to the
end (*kept*). ``random`` and ``ordered`` ops need nothing more: each first runs in its own
stage, in eager order.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import networkx as nx

from passes.graph_facts import graph_outputs, op_nodes, per_graph_value, storage_root
from passes.kept_bytes import gradient_bytes
from passes.schedule import Matrix, hooked_ops
from passes.sim_loss import loss_scalar_bytes, loss_working_bytes, trained_outputs
from passes.training_backward import add_backward, backward_stage

LOSS_SCALARS = "loss-scalars"  # the node of a loss computed outside the graph: its scalars, kept to the end
FIELDS = ("names", "mem", "flops", "preds", "once", "kept", "fresh", "transient", "home", "about", "root", "run_extra",
          "cached")


@dataclass(frozen=True)
class TrainingGraph:
    """The forward + backward graph the MILP schedules; stage ``t`` is node ``t``'s stage."""

    names: tuple[str, ...]
    mem: tuple[int, ...]
    flops: tuple[int, ...]
    preds: tuple[tuple[int, ...], ...]
    once: tuple[bool, ...]  # computed in its home stage only
    kept: tuple[bool, ...]  # in memory from its home stage to the end
    fresh: tuple[tuple[int, ...], ...]  # uncuttable values a recompute must recompute too
    transient: tuple[int, ...]  # bytes held for a moment on top when the node runs at home
    home: tuple[int, ...]  # the stage where it first runs: itself, or its op for an extra
    n_forward: int
    about: tuple[str, ...] = ()  # the cost graph's value each node is, or is the gradient or extra of
    root: tuple[int, ...] = ()  # the node whose storage each node's value is (itself, but for a view's)
    run_extra: tuple[int, ...] = ()  # bytes held for a moment on top whenever the node runs (forward_extra_bytes)
    cached: tuple[int, ...] = ()  # bytes autocast's cache holds from the node's home to the end of forward
    makers: frozenset[int] = field(init=False)  # ops with an extra
    remade: frozenset[int] = field(init=False)  # makers, and values a recompute must make again: a stage may
    # both hold and recompute these
    _readers: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _cache_entering: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _extras: tuple[int, ...] = field(init=False, repr=False, compare=False)  # each op's extra node, or -1

    def __post_init__(self) -> None:
        extras = [-1] * len(self.names)
        for i, h in enumerate(self.home):
            if h != i:
                extras[h] = i
        object.__setattr__(self, "_extras", tuple(extras))
        object.__setattr__(self, "makers", frozenset(k for k, extra in enumerate(extras) if extra >= 0))
        object.__setattr__(self, "remade", self.makers | {i for reads in self.fresh for i in reads})
        readers: list[list[int]] = [[] for _ in self.names]
        for k, preds in enumerate(self.preds):
            for i in preds:
                readers[i].append(k)
        object.__setattr__(self, "_readers", tuple(tuple(r) for r in readers))
        object.__setattr__(self, "_cache_entering", tuple(itertools.accumulate(self.cached[:self.n_forward], initial=0)))

    @property
    def size(self) -> int:
        return len(self.names)

    def frees(self, k: int) -> tuple[int, ...]:
        """Nodes that may be freed right after ``k`` runs: its inputs, and itself for a maker."""
        return (*self.preds[k], k) if k in self.makers else self.preds[k]

    def role(self, i: int) -> str:
        """What node ``i`` holds: ``"value"`` (a forward op's), ``"extra"`` (what an op saves
        beyond values), ``"gradient"`` or ``"loss"`` (the loss's scalars)."""
        if i < self.n_forward:
            return "value" if self.home[i] == i else "extra"
        return "loss" if self.names[i] == LOSS_SCALARS else "gradient"

    def cache_entering(self, t: int) -> int:
        """Bytes autocast's cache holds entering stage ``t``: the casts of the forward ops
        before it, until forward ends (the simulator's ``AUTOCAST_CACHE``; eager code, which
        an exact schedule's forward is, caches them)."""
        return self._cache_entering[t] if t < self.n_forward else 0

    def extra_node(self, k: int) -> int | None:
        """The extra node of op ``k`` (what it saves beyond values), if it has one. An op run
        without it, in forward (a schedule dropping it) or by a step, makes it all the same
        and lets it go when the op returns: its bytes are held for a moment on top, as its
        forward temporaries are. Under bf16 autocast, a step's Linear casts its weight and
        input there (an exact schedule measured 5% over its simulated peak without them,
        stop 68)."""
        extra = self._extras[k]
        return None if extra < 0 else extra

    def readers(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the nodes that read it, ascending (found once, with the graph)."""
        return self._readers


@per_graph_value
def training_graph(graph: nx.DiGraph) -> TrainingGraph:
    """The forward ops and their extras, the gradient seeds and the backward nodes (built
    once per cost graph: a budget plan's LP bound, solve and schedule all read it)."""
    nodes: dict[str, list] = {name: [] for name in FIELDS}

    def add(name: str, mem: int, preds: Iterable[int], *, flops: int = 0, once: bool = True, kept: bool = False,
            fresh: tuple[int, ...] = (), transient: int = 0, home: int | None = None, about: str = "",
            root: int | None = None, run_extra: int = 0, cached: int = 0) -> int:
        index = len(nodes["names"])
        values = (name, mem, flops, tuple(sorted(set(preds))), once, kept, fresh, transient,
                  index if home is None else home, about or name, index if root is None else root, run_extra, cached)
        for key, value in zip(FIELDS, values, strict=True):
            nodes[key].append(value)
        return index

    index: dict[str, int] = {}
    extra: dict[str, int] = {}
    sink_reads = set(graph_outputs(graph))
    kept = {storage_root(graph, v) for v in sink_reads} | sink_reads
    for k in op_nodes(graph):
        attributes, reads = graph.nodes[k], _forward_reads(graph, k, index)
        once = not attributes["recomputable"] or any(
            not graph.nodes[u]["cuttable"] and u not in index for u in graph.predecessors(k))
        if attributes["saved_extra_bytes"]:
            extra[k] = add(f"extra:{k}", attributes["saved_extra_bytes"], reads, once=once, home=len(nodes["names"]) + 1,
                           about=k)
        fresh = tuple(index[u] for u in graph.predecessors(k) if u in index and not graph.nodes[u]["cuttable"])
        index[k] = add(k, attributes["bytes"], reads, flops=attributes["flops"], once=once, kept=k in kept, fresh=fresh,
                       root=index.get(storage_root(graph, k)), run_extra=attributes.get("forward_extra_bytes", 0),
                       cached=attributes.get("autocast_cache_bytes", 0))
    n_forward = len(nodes["names"])
    trained = trained_outputs(graph)
    loss = loss_working_bytes(graph)
    scalars = loss_scalar_bytes(graph)
    if scalars:
        add(LOSS_SCALARS, scalars, (), kept=True, about="loss")
    own_loss = graph.graph.get("loss")  # its gradient is backward's seed, held to the end
    owner = {v: add(f"grad-seed:{v}", gradient_bytes(graph, v), (), kept=graph.nodes[v]["kind"] == "input" or v == own_loss,
                    transient=loss if v == trained[-1] else 0, about=v) for v in trained}  # v's gradient buffer
    add_backward(graph, add, nodes, index, extra, owner)
    return TrainingGraph(**{key: tuple(values) for key, values in nodes.items()}, n_forward=n_forward)


def hooked_stages(graph: nx.DiGraph, training: TrainingGraph) -> frozenset[int]:
    """The stages where the runtime can run a step: the first backward node of each op it
    hooks (:func:`passes.schedule.hooked_ops`). What the executable MILP may recompute at,
    what the schedule of its solution runs at, and where the plan read as a schedule makes
    its values (:mod:`passes.checkmate`, :mod:`passes.exact`, :mod:`passes.plan_start`)."""
    at = {name: t for t, name in enumerate(training.names)}
    return frozenset(at[stage] for op in hooked_ops(graph) if (stage := backward_stage(op)) in at)


def _forward_reads(graph: nx.DiGraph, name: str, index: dict[str, int]) -> set[int]:
    """The ops ``name`` reads, and the storage root of each view it reads."""
    return {index[v] for u in graph.predecessors(name) for v in (u, storage_root(graph, u)) if v in index}


def stage_peaks(training: TrainingGraph, R: Matrix, S: Matrix) -> list[float]:
    """Peak bytes of each stage of a schedule in the memory model above, freeing eagerly."""
    return [_stage(training, R, S, t).peak for t in range(training.size)]


@dataclass(frozen=True)
class StageMoment:
    """One stage's run: its ``peak``; and, where the stage was watched for a peak, the nodes
    ``live`` when it first reached it, the ``temporary`` bytes of that moment (a node's
    transient, or its forward's temporaries), the node whose run ``reached`` it (``None``:
    held entering the stage) and the forward ops whose casts autocast's cache holds."""

    peak: float
    live: tuple[int, ...] = ()  # ascending; a node twice when a stage holds a copy and makes it afresh
    temporary: int = 0
    reached: int | None = None
    cached: tuple[int, ...] = ()  # forward ops whose casts autocast's cache holds then


def _cached(training: TrainingGraph, t: int, running: int | None = None) -> tuple[int, ...]:
    """The forward ops whose casts autocast's cache holds in stage ``t`` (entering it, or
    once ``running`` has run)."""
    last = t if running == t else t - 1
    return tuple(i for i in range(min(last + 1, training.n_forward)) if training.cached[i])


def peak_moment(training: TrainingGraph, R: Matrix, S: Matrix) -> tuple[int, StageMoment]:
    """The stage where a schedule first reaches its peak, and what is live there then: the
    schedule's own breakdown (the parts add up to :func:`stage_peaks`' maximum exactly)."""
    peaks = stage_peaks(training, R, S)
    stage = max(range(len(peaks)), key=lambda t: (peaks[t], -t))
    return stage, _stage(training, R, S, stage, watch=peaks[stage])


def _stage(training: TrainingGraph, R: Matrix, S: Matrix, t: int, watch: float | None = None) -> StageMoment:
    """Stage ``t``'s peak; with ``watch`` (its peak), also the moment it first reaches it."""
    T, readers, mem = training.size, training.readers(), training.mem
    live = Counter(i for i in range(t) if S[t][i])  # a maker held may be made afresh for its extra: 2 copies
    current = sum(mem[i] for i in live) + training.cache_entering(t)
    peak, seen = current, None
    if watch is not None and current >= watch:
        seen = StageMoment(watch, tuple(sorted(live.elements())), cached=_cached(training, t))
    for k in (k for k in range(t + 1) if R[t][k]):
        live[k] += 1
        current += mem[k]
        current += training.cached[k] if k == t else 0  # its casts, cached from its run at home
        extra = training.extra_node(k)
        dropped = mem[extra] if extra is not None and not R[t][extra] else 0  # made and let go inside the op
        again = training.cached[k] if k != t else 0  # its casts, autocast's cache off: made for the op alone
        moment = current + training.run_extra[k] + dropped + again + (training.transient[k] if k == t else 0)
        peak = max(peak, moment)
        if watch is not None and seen is None and moment >= watch:
            seen = StageMoment(watch, tuple(sorted(live.elements())), moment - current, k, _cached(training, t, k))
        for i in (*training.preds[k], k):
            unread = i != k or not any(R[t][j] for j in readers[k] if j <= t)
            if unread and not (t + 1 < T and S[t + 1][i]) and not any(R[t][j] for j in readers[i] if j > k):
                current -= mem[i]
                live[i] -= 1
                if live[i] <= 0:
                    del live[i]
    return seen if seen is not None else StageMoment(peak)


def no_recompute_schedule(training: TrainingGraph) -> tuple[Matrix, Matrix]:
    """Each node once, at home, held while a later stage reads it (:func:`held_between_reads`)."""
    T, home = training.size, training.home
    R = tuple(tuple(int(home[i] == t) for i in range(T)) for t in range(T))
    return R, held_between_reads(training, R)


def held_between_reads(training: TrainingGraph, R: Matrix | list[list[int]]) -> Matrix:
    """``S`` holding each node from a stage that makes it to the last stage reading that
    copy (a stage making it again reads its own), kept nodes to the end, and a view's storage
    while the view is held: the least memory ``R`` runs in."""
    T, home = training.size, training.home
    reads: list[list[int]] = [[] for _ in range(T)]
    for t in range(T):
        for k in range(t + 1):
            if R[t][k]:
                for i in training.preds[k]:
                    reads[i].append(t)
    S = [[0] * T for _ in range(T)]
    for i in range(T):
        if training.kept[i]:
            for t in range(home[i] + 1, T):
                S[t][i] = 1
            continue
        made = [t for t in range(T) if R[t][i]]  # none: an extra forward lets go, never needed
        for m, following in zip(made, [*made[1:], T][:len(made)], strict=True):
            for t in range(m + 1, max((r for r in reads[i] if m < r < following), default=m) + 1):
                S[t][i] = 1
    for t in range(T):
        for i in range(t):
            if S[t][i] and training.root[i] != i:
                S[t][training.root[i]] = 1
    return tuple(tuple(row) for row in S)


def no_recompute_peak(graph: nx.DiGraph) -> float:
    """Peak bytes without recompute (the simulator's eager peak): enough budget for no recompute."""
    training = training_graph(graph)
    return max(stage_peaks(training, *no_recompute_schedule(training)), default=0)


def last_use(training: TrainingGraph) -> list[int]:
    """The last stage at which each node can be of use: a once-only reader reads it at home,
    a recomputable one as late as it is itself of use, an op as late as its extra, a storage
    as late as a view of it."""
    T, readers, home = training.size, training.readers(), training.home
    last = [T - 1 if kept else -1 for kept in training.kept]
    for i in reversed(range(T)):
        for j in readers[i]:
            last[i] = max(last[i], home[j] if training.once[j] else max(home[j], last[j]))
        last[home[i]] = max(last[home[i]], last[i])
        last[training.root[i]] = max(last[training.root[i]], last[i])  # a view held holds its storage
    return [max(used, home[i]) for i, used in enumerate(last)]
