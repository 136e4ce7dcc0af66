"""An exact reference solver in the style of Checkmate (Jain et al. 2020, arXiv 1910.02653).

It measures how far the heuristic strategies are from optimal; it is not a strategy itself.
The MILP is solved by HiGHS through :func:`scipy.optimize.milp`.

**Training graph.** Nodes ``0..n-1`` are the op nodes in ``order``. Node ``n`` is the loss
gradient seed (the gradients of the graph outputs that need one). Then, in reverse forward
order, one backward node ``b_k`` per op ``k`` that receives a gradient (``requires_grad``
and read by the output sink or by an op that has a backward node). ``b_k`` reads the seed
(if the sink reads ``k``), the ``b_j`` of its op readers ``j`` (the gradient of ``k``'s
output) and the storage roots of the op values in ``k``'s ``saved``; it produces the
gradients of ``k``'s inputs, so its size is the storage-root bytes of its predecessors that
need a gradient (ops and inputs, not params). The gradient of a value read by several ops
therefore lives once per reader until its own backward has run (pessimistic next to
PyTorch's in-place accumulation). Inputs and params are always available and cost nothing.
A forward op's size is its ``bytes`` (views: 0) plus its ``saved_extra_bytes``; when the
latter is non-zero ``b_k`` also reads ``k``, so the extra stays alive until backward. An op
reading a view also reads the view's storage root, so a view never outlives its storage.

**Variables** (stage ``t`` of ``T`` computes node ``t``; ``m_i`` is node ``i``'s size):
``R[t,i]`` binary for ``i <= t`` (node ``i`` computed in stage ``t``); ``S[t,i]`` binary for
``i < t`` (node ``i`` in memory entering stage ``t``); ``F[t,i,k]`` continuous in ``[0, 1]``
for each edge ``i -> k`` with ``k < t`` (``i`` freed right after ``k`` runs in stage ``t``);
``U[t,k]`` continuous in ``[0, budget]`` for ``k <= t`` (memory just after computing ``k``).

**Constraints.** ``R[t,t] = 1``; ``S[0,:] = 0`` and nothing later than ``t`` in stage ``t``
(Checkmate's full schedule). ``R[t,k] <= R[t,i] + S[t,i]`` for each edge ``i -> k``;
``S[t+1,i] <= S[t,i] + R[t,i]``. ``R[t,i] = 0`` for ``t != i`` when ``i`` may run only once:
backward and seed nodes, ops with ``recomputable=False`` or reading an input or param that
is not ``cuttable``. A recompute of ``k`` reading an op value ``i`` that is not ``cuttable``
(written in place later, so a kept copy may be stale) recomputes ``i`` too: ``R[t,k] <=
R[t,i]`` for ``t != k``. Graph outputs (and their storage roots) stay in memory once
computed, the caller holds them: ``S[t,o] = 1`` for ``t > o``. Memory, as in the paper:
``U[t,0] = R[t,0]·m_0 + Σ_i S[t,i]·m_i``, ``U[t,k] = U[t,k-1] + R[t,k]·m_k - Σ_{i -> k-1}
m_i·F[t,i,k-1]`` (rows for ``k`` that cannot run in stage ``t`` are merged away).
Checkmate bounds its binary ``FREE`` from both sides through a hazard count; here ``F`` is
only bounded above, one hazard per row: ``F[t,i,k] <= R[t,k]``, ``F[t,i,k] <= 1 -
S[t+1,i]`` and ``F[t,i,k] <= 1 - R[t,j]`` for each reader ``j > k`` of ``i``. Freeing less
than allowed only costs memory, so the optimum is the same with continuous ``F`` and the LP
relaxation is tighter. Values no one reads in a stage are not freed in it (as in the paper).
Dominance reductions that keep every optimum (each drops only useless work or memory):
nothing is computed or kept after :func:`last_use`; ``R[t,i] + S[t,i] <= 1`` for ``i < t``
(cuttable ``i``); a value recomputed or kept in stage ``t`` is read by a node run in ``t`` or
kept into ``t+1``: ``R[t,i], S[t,i] <= Σ_{i -> j, j <= t} R[t,j] + S[t+1,i]`` (outputs aside).

**Objective.** Minimise ``Σ_t Σ_{i<n} R[t,i]·flops_i`` (forward compute with recompute;
backward nodes run exactly once, so their cost is a constant and left out).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from passes.costgraph import in_order, op_nodes, storage_root
from passes.simulate import LOSS_WORKING_SET

MAX_OPS = 60

Matrix = tuple[tuple[int, ...], ...]


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
    transient: tuple[int, ...]  # bytes briefly allocated on top while the node runs at home
    home: tuple[int, ...]  # the stage where it first runs: itself, or its op for an extra
    n_forward: int

    @property
    def size(self) -> int:
        return len(self.names)

    def makers(self) -> set[int]:
        """Ops with an extra: recomputed at times only to make it, their output unread."""
        return {h for i, h in enumerate(self.home) if h != i}

    def frees(self, k: int) -> tuple[int, ...]:
        """Nodes that may be freed right after ``k`` runs: its inputs, and a maker itself."""
        return (*self.preds[k], *((k,) if k in self.makers() else ()))

    def readers(self) -> list[list[int]]:
        """For each node, the nodes that read it, ascending."""
        out: list[list[int]] = [[] for _ in self.names]
        for k, preds in enumerate(self.preds):
            for i in preds:
                out[i].append(k)
        return out


@dataclass(frozen=True)
class CheckmateResult:
    """The MILP's schedule: forward recompute it costs and its peak in the memory model."""

    recompute_flops: int
    peak_bytes: float
    status: str
    solve_seconds: float
    stages: tuple[str, ...] = ()
    R: Matrix = ()
    S: Matrix = ()


def _grad_bytes(graph: nx.DiGraph, name: str) -> int:
    """Bytes of ``name``'s gradient buffer: its storage root's size (as the simulator)."""
    return graph.nodes[storage_root(graph, name)]["bytes"]


def _needs_grad(graph: nx.DiGraph, name: str) -> bool:
    return graph.nodes[name]["requires_grad"] and graph.nodes[name]["kind"] in ("op", "input")


class _Nodes:
    """The training graph's node attributes as lists while it is being built."""

    FIELDS = ("names", "mem", "flops", "preds", "once", "kept", "fresh", "transient", "home")

    def __init__(self) -> None:
        self.lists: dict[str, list] = {field: [] for field in self.FIELDS}

    def add(self, name: str, mem: int, preds: Iterable[int], *, flops: int = 0, once: bool = True,
            kept: bool = False, fresh: tuple[int, ...] = (), transient: int = 0, home: int | None = None) -> int:
        index = len(self.lists["names"])
        values = (name, mem, flops, tuple(sorted(set(preds))), once, kept, fresh, transient,
                  index if home is None else home)
        for field, value in zip(self.FIELDS, values, strict=True):
            self.lists[field].append(value)
        return index


def training_graph(graph: nx.DiGraph) -> TrainingGraph:
    """The forward ops (each after its saved extra bytes, if any), one gradient seed per graph
    output that needs one, and per op one backward node per gradient buffer it creates."""
    nodes, index, extra = _Nodes(), {}, {}
    sink_reads = {u for n, kind in graph.nodes(data="kind") if kind == "output" for u in graph.predecessors(n)}
    kept = {storage_root(graph, v) for v in sink_reads} | sink_reads
    for k in op_nodes(graph):
        attributes, reads = graph.nodes[k], _forward_reads(graph, k, index)
        once = not attributes["recomputable"] or any(
            not graph.nodes[u]["cuttable"] and u not in index for u in graph.predecessors(k))
        if attributes["saved_extra_bytes"]:
            extra[k] = nodes.add(f"extra:{k}", attributes["saved_extra_bytes"], reads, once=once,
                                 home=len(nodes.lists["names"]) + 1)
        fresh = tuple(index[u] for u in graph.predecessors(k) if u in index and not graph.nodes[u]["cuttable"])
        index[k] = nodes.add(k, attributes["bytes"], reads, flops=attributes["flops"], once=once,
                             kept=k in kept, fresh=fresh)
    n_forward = len(nodes.lists["names"])
    owner: dict[str, int] = {}  # the node whose output is each value's gradient buffer
    trained = [v for v in in_order(graph, sink_reads) if _needs_grad(graph, v)]
    loss = LOSS_WORKING_SET * sum(_grad_bytes(graph, v) for v in trained)  # held while the seeds are made
    for v in trained:
        owner[v] = nodes.add(f"grad-seed:{v}", _grad_bytes(graph, v), (), kept=graph.nodes[v]["kind"] == "input",
                             transient=loss if v == trained[-1] else 0)
    for k in reversed(list(index)):
        gets_grad = k in owner and _needs_grad(graph, k)
        inputs = [u for u in graph.predecessors(k) if gets_grad and _needs_grad(graph, u)]
        reads = [owner[k]] if gets_grad else []
        reads += [owner[u] for u in inputs if u in owner] + ([extra[k]] if k in extra else [])
        reads += [index[r] for r in {storage_root(graph, v) for v in graph.nodes[k]["saved"]} if r in index]
        new = [u for u in inputs if u not in owner]
        partial = max(_partial_peak(graph, inputs, owner), graph.nodes[k]["param_grad_bytes"] if gets_grad else 0)
        for position, u in enumerate(new or [None]):  # one node per new gradient buffer
            node = nodes.add(f"backward:{k}" + (f":{u}" if position else ""), _grad_bytes(graph, u) if u else 0,
                             reads, kept=bool(u) and graph.nodes[u]["kind"] == "input",
                             transient=partial if position == max(len(new) - 1, 0) else 0)
            if u is not None:
                owner[u] = node
    return TrainingGraph(**{field: tuple(values) for field, values in nodes.lists.items()}, n_forward=n_forward)


def _partial_peak(graph: nx.DiGraph, inputs: list[str], owner: dict[str, int]) -> int:
    """Bytes above "every new gradient buffer allocated" that a backward step briefly needs:
    a gradient added into an existing buffer is first made on its own, before the new
    buffers of the inputs after it (the simulator's order)."""
    peak, allocated_after = 0, 0
    for u in reversed(inputs):
        if u in owner:
            peak = max(peak, _grad_bytes(graph, u) - allocated_after)
        else:
            allocated_after += _grad_bytes(graph, u)
    return peak


def _forward_reads(graph: nx.DiGraph, name: str, index: dict[str, int]) -> tuple[int, ...]:
    """The ops ``name`` reads, with the storage root of each view it reads (a view keeps
    its root's storage alive: reading the view needs the root in memory)."""
    reads = {index[u] for u in graph.predecessors(name) if u in index}
    reads |= {index[storage_root(graph, u)] for u in graph.predecessors(name) if storage_root(graph, u) in index}
    return tuple(sorted(reads))


def stage_peaks(training: TrainingGraph, R: Matrix, S: Matrix) -> list[float]:
    """Peak bytes of each stage of a schedule in the memory model above, freeing eagerly."""
    T, readers = training.size, training.readers()
    peaks = []
    for t in range(T):
        current = sum(training.mem[i] for i in range(t) if S[t][i])
        peak = current
        for k in range(t + 1):
            if not R[t][k]:
                continue
            current += training.mem[k]
            peak = max(peak, current + (training.transient[k] if k == t else 0))
            for i in (*training.preds[k], k):
                unread = i != k or not any(R[t][j] for j in readers[k] if j <= t)
                if unread and not (t + 1 < T and S[t + 1][i]) and not any(R[t][j] for j in readers[i] if j > k):
                    current -= training.mem[i]
        peaks.append(peak)
    return peaks


def no_recompute_schedule(training: TrainingGraph) -> tuple[Matrix, Matrix]:
    """Checkmate's checkpoint-all schedule: each node once at home, kept while a later stage reads it."""
    T, readers, home = training.size, training.readers(), training.home
    R = tuple(tuple(int(home[i] == t) for i in range(T)) for t in range(T))
    S = tuple(tuple(int(home[i] < t and (training.kept[i] or any(home[j] >= t for j in readers[i])))
                    for i in range(T)) for t in range(T))
    return R, S


def no_recompute_peak(graph: nx.DiGraph) -> float:
    """Peak bytes without recompute: the simulator's eager peak, the least budget needing no recompute."""
    training = training_graph(graph)
    return max(stage_peaks(training, *no_recompute_schedule(training)), default=0)


class _Model:
    """Sparse MILP rows and variable columns, built up one constraint at a time."""

    def __init__(self) -> None:
        self.columns: dict[tuple, int] = {}
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, key: tuple, lower: float, upper: float, integer: bool) -> int:
        self.columns[key] = len(self.lower)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(int(integer))
        return self.columns[key]

    def row(self, terms: list[tuple[tuple, float]], lower: float, upper: float) -> None:
        coefficients: dict[int, float] = {}
        for key, value in terms:
            if key in self.columns:
                column = self.columns[key]
                coefficients[column] = coefficients.get(column, 0.0) + value
        self.rows.append((coefficients, lower, upper))

    def constraint(self) -> LinearConstraint:
        data = [(r, c, v) for r, (terms, _, _) in enumerate(self.rows) for c, v in terms.items()]
        rows, columns, values = zip(*data, strict=True) if data else ((), (), ())
        matrix = coo_array((values, (rows, columns)), shape=(len(self.rows), len(self.lower)))
        return LinearConstraint(matrix.tocsr(), [r[1] for r in self.rows], [r[2] for r in self.rows])


def last_use(training: TrainingGraph) -> list[int]:
    """The last stage at which each node can be of use: a reader that runs once reads it
    no later than its own stage, a recomputable reader as late as it is itself of use.
    Computing or keeping a node after that only wastes memory, so those variables are left
    out (a dominance reduction that keeps every optimum)."""
    T, readers, home = training.size, training.readers(), training.home
    last = [T - 1 if kept else -1 for kept in training.kept]
    for i in reversed(range(T)):
        for j in readers[i]:
            last[i] = max(last[i], home[j] if training.once[j] else max(home[j], last[j]))
        last[home[i]] = max(last[home[i]], last[i])  # an op is of use while its extra is
    return [max(used, home[i]) for i, used in enumerate(last)]


def _build(training: TrainingGraph, budget: float) -> _Model:
    """Checkmate's variables and constraints, memory in units of the largest node size.

    Variables that must be 0 are never created; :meth:`_Model.row` drops their terms.
    """
    T, readers, last = training.size, training.readers(), last_use(training)
    unit = max(max(training.mem, default=0), 1)
    mem = [m / unit for m in training.mem]
    home = training.home
    runs = [[i for i in range(t + 1) if t == home[i] or (not training.once[i] and home[i] < t <= last[i])]
            for t in range(T)]
    model = _Model()
    for t in range(T):
        for i in runs[t]:
            model.var(("R", t, i), float(i == t), 1.0, True)
            model.var(("U", t, i), 0.0, budget / unit, False)
            for p in training.frees(i) if i < t else ():
                model.var(("F", t, p, i), 0.0, 1.0, False)
        for i in range(t):
            if home[i] < t <= last[i]:
                model.var(("S", t, i), float(training.kept[i]), 1.0, True)
    for t in range(T):
        _schedule_rows(model, training, readers, t)
        previous = None
        for k in runs[t]:
            terms = [(("U", t, k), 1.0), (("R", t, k), -mem[k])]
            if previous is None:
                terms += [(("S", t, i), -mem[i]) for i in range(t)]
            else:
                terms += [(("U", t, previous), -1.0)]
                terms += [(("F", t, i, previous), mem[i]) for i in training.frees(previous)]
            transient = training.transient[k] / unit if k == t else 0.0
            model.row(terms, transient, transient)
            previous = k
    return model


def _schedule_rows(model: _Model, training: TrainingGraph, readers: list[list[int]], t: int) -> None:
    """Stage ``t``'s dependency, keep, free and dominance rows."""
    inf, after = -math.inf, ("S", t + 1)
    for k in range(t + 1):
        if ("R", t, k) not in model.columns:
            continue
        # an extra is made only with its op; a recompute recomputes the uncuttable values it reads
        recompute = training.fresh[k] if t != training.home[k] else ()
        for i in (*recompute, *((training.home[k],) if training.home[k] != k else ())):
            model.row([(("R", t, k), 1.0), (("R", t, i), -1.0)], inf, 0.0)
        for i in training.preds[k]:
            model.row([(("R", t, k), 1.0), (("R", t, i), -1.0), (("S", t, i), -1.0)], inf, 0.0)
        for i in training.frees(k) if k < t else ():  # F <= R[t,k], 1 - S[t+1,i], 1 - R[t,j>k]
            free = ("F", t, i, k)
            model.row([(free, 1.0), (("R", t, k), -1.0)], inf, 0.0)
            model.row([(free, 1.0), ((*after, i), 1.0)], inf, 1.0)
            for j in readers[i]:
                if k < j <= t:
                    model.row([(free, 1.0), (("R", t, j), 1.0)], inf, 1.0)
    # recomputing what is in memory is useless, except to read a fresh copy or make an extra
    # dominance: what stage t computes or holds, it reads or keeps; nothing in memory is
    # recomputed, except for a fresh copy of an uncuttable value or to make an op's extra
    makers = training.makers()
    again = makers | {i for reads in training.fresh for i in reads}
    for i in range(t + 1):
        model.row([((*after, i), 1.0), (("S", t, i), -1.0), (("R", t, i), -1.0)], inf, 0.0)
        if i == t:
            continue
        if i not in again:
            model.row([(("S", t, i), 1.0), (("R", t, i), 1.0)], inf, 1.0)
        used = [(("R", t, j), -1.0) for j in readers[i] if j <= t] + [((*after, i), -1.0)]
        if i not in makers:
            model.row([(("R", t, i), 1.0), *used], inf, 0.0)
        if not training.kept[i]:
            model.row([(("S", t, i), 1.0), *used], inf, 0.0)


def _matrix(model: _Model, x: np.ndarray, name: str, T: int) -> Matrix:
    """Rounded 0/1 values of the ``R`` or ``S`` variables as a ``T x T`` matrix."""
    def value(t: int, i: int) -> int:
        column = model.columns.get((name, t, i))
        return 0 if column is None else int(x[column] > 0.5)
    return tuple(tuple(value(t, i) for i in range(T)) for t in range(T))


def checkmate_schedule(graph: nx.DiGraph, budget_bytes: float, *, time_limit: float = 30.0) -> CheckmateResult | None:
    """Solve Checkmate's MILP for ``graph`` under ``budget_bytes``; ``None`` when infeasible.

    ``status`` is ``"optimal"`` or ``"time_limit"`` (a feasible schedule, maybe not optimal).
    Raises :class:`ValueError` above :data:`MAX_OPS` op nodes and :class:`TimeoutError` when
    the time limit passes before any feasible schedule is found.
    """
    if len(op_nodes(graph)) > MAX_OPS:
        raise ValueError(f"checkmate_schedule: {len(op_nodes(graph))} op nodes, more than {MAX_OPS}; "
                         "the MILP grows as n^2 (use a heuristic strategy)")
    training = training_graph(graph)
    if budget_bytes < 0:
        return None
    model = _build(training, budget_bytes)
    cost = np.zeros(len(model.lower))
    divisor = math.gcd(*training.flops) or 1
    for (kind, _, i, *_), column in model.columns.items():
        if kind == "R" and i < training.n_forward:
            cost[column] = training.flops[i] / divisor
    started = time.perf_counter()
    solution = milp(cost, constraints=model.constraint(), integrality=np.array(model.integer),
                    bounds=Bounds(model.lower, model.upper),
                    options={"time_limit": time_limit, "mip_rel_gap": 1e-9, "presolve": True})
    seconds = time.perf_counter() - started
    if solution.status == 2:
        return None
    if solution.x is None:
        raise TimeoutError(f"checkmate_schedule: no feasible schedule within {time_limit}s ({solution.message})")
    T = training.size
    R, S = _matrix(model, solution.x, "R", T), _matrix(model, solution.x, "S", T)
    total = sum(training.flops[i] * R[t][i] for t in range(T) for i in range(training.n_forward))
    return CheckmateResult(
        recompute_flops=total - sum(training.flops[: training.n_forward]),
        peak_bytes=float(max(stage_peaks(training, R, S), default=0)),
        status="optimal" if solution.status == 0 else "time_limit",
        solve_seconds=seconds, stages=training.names, R=R, S=S,
    )
