"""An exact reference solver in the style of Checkmate (Jain et al. 2020, arXiv 1910.02653).

It measures how far the heuristic strategies are from optimal; it is not a strategy itself.
The MILP is solved by HiGHS through :func:`scipy.optimize.milp`.

**Training graph** (one node per stage; it mirrors :mod:`passes.simulate`, so the schedule
without recompute peaks at the simulator's eager peak). Forward: the op nodes in ``order``
(size ``bytes``, 0 for views); an op with ``saved_extra_bytes`` is preceded by an *extra*
node of that size, made only together with its op and only if wanted (a recomputed segment
does not save in forward). An op reading a view also reads the view's storage root. Then one
gradient seed per graph output that needs a gradient (size: its storage root's bytes; the
loss working set ``LOSS_WORKING_SET`` x those bytes is held for a moment). Then, ops in
reverse, the backward of op ``k``: one node per gradient buffer it creates (one node if none),
each reading ``k``'s gradient buffer, the buffers it adds into, ``k``'s extra and the storage
roots of ``k``'s ``saved`` values. A gradient added into an existing buffer, and the
``param_grad_bytes`` with, if any, the ``backward_extra_bytes`` plus the gradients ``k`` adds
into existing buffers, are held for a moment (*transient* bytes). Inputs and params are free;
input gradients, graph outputs and their storage roots stay in memory to the end (*kept*).
``random`` and ``ordered`` ops need nothing more: each first runs in its own stage, in eager
order. ``grad_views`` is not modelled (each input gradient is a buffer of its own, as the
simulator did before it learnt views), so parity with the simulator holds on graphs without it.

**Variables** (stage ``t`` of ``T``; ``m_i`` is node ``i``'s size; ``home(i)`` is ``i``, or
an extra's op): ``R[t,i]`` binary, ``i`` computed in stage ``t``; ``S[t,i]`` binary, ``i`` in
memory entering stage ``t``; ``F[t,i,k]`` in ``[0, 1]``: ``i`` freed right after ``k`` runs in
stage ``t``, for ``i -> k`` (and ``k -> k`` for ops with an extra: made just for it, unread);
``U[t,k]`` in ``[0, budget]``: memory just after ``k`` runs in stage ``t``.

**Constraints.** Full schedule: ``R[t,i] = 0`` for ``t < home(i)``, ``R[t,t] = 1`` but for
extras, ``S[t,i] = 0`` for ``t <= home(i)``. ``R[t,k] <= R[t,i] + S[t,i]`` for ``i -> k``;
``S[t+1,i] <= S[t,i] + R[t,i]``; ``S[t,i] = 1`` for kept ``i`` and ``t > home(i)``. Once-only
nodes (seeds, backward nodes, ops with ``recomputable=False`` or reading an uncuttable input
or param) have ``R[t,i] = 0`` for ``t != home(i)``. An extra comes with its op: ``R[t,e] <=
R[t,op]``. A recompute reads no kept copy of an uncuttable op value ``i`` (it may have been
overwritten): ``R[t,k] <= R[t,i]`` for ``t != home(k)``. Memory as in the paper: ``U[t,first] =
R·m + Σ_i S[t,i]·m_i``, ``U[t,k] = U[t,k'] + R[t,k]·m_k - Σ_i m_i·F[t,i,k']`` for ``k'`` the
previous node that may run in stage ``t``, plus the transient bytes at ``U[t,t]``. The paper
bounds a binary ``FREE`` from both sides with a hazard count; here ``F`` is only bounded
above, one hazard a row: ``F[t,i,k] <= R[t,k]``, ``<= 1 - S[t+1,i]``, ``<= 1 - R[t,j]`` for
each reader ``j > k`` of ``i``. Freeing less only costs memory, so the optimum is the same
and the LP relaxation tighter. Dominance reductions that keep an optimum: nothing computed or
kept after :func:`last_use`; what stage ``t`` recomputes (ops with an extra aside) or holds
(kept nodes aside) is read in ``t`` or kept into ``t+1``; ``R[t,i] + S[t,i] <= 1`` for
``i < t`` (no recompute of a value in memory, but for an extra or a fresh uncuttable copy).

**Objective.** Minimise ``Σ_t Σ_i R[t,i]·flops_i`` over forward ops (backward nodes run once:
a constant). ``recompute_flops`` is that minus the forward's flops.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from passes.costgraph import graph_outputs, needs_grad, op_nodes, storage_root
from passes.kept_bytes import gradient_bytes
from passes.simulate import loss_working_bytes, trained_outputs

MAX_OPS = 60
Matrix = tuple[tuple[int, ...], ...]
FIELDS = ("names", "mem", "flops", "preds", "once", "kept", "fresh", "transient", "home")


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
    makers: frozenset[int] = field(init=False)  # ops with an extra

    def __post_init__(self) -> None:
        object.__setattr__(self, "makers", frozenset(h for i, h in enumerate(self.home) if h != i))

    @property
    def size(self) -> int:
        return len(self.names)

    def frees(self, k: int) -> tuple[int, ...]:
        """Nodes that may be freed right after ``k`` runs: its inputs, and itself for a maker."""
        return (*self.preds[k], k) if k in self.makers else self.preds[k]

    def readers(self) -> list[list[int]]:
        """For each node, the nodes that read it, ascending."""
        out: list[list[int]] = [[] for _ in self.names]
        for k, preds in enumerate(self.preds):
            for i in preds:
                out[i].append(k)
        return out


@dataclass(frozen=True)
class CheckmateResult:
    """The MILP's schedule: the forward recompute it costs and its peak in the memory model."""

    recompute_flops: int
    peak_bytes: float
    status: str  # "optimal", or "time_limit" for a feasible schedule not proven optimal
    solve_seconds: float
    stages: tuple[str, ...] = ()
    R: Matrix = ()
    S: Matrix = ()
    recompute_lower_bound: float = 0.0  # proven: no schedule under the budget recomputes less


def training_graph(graph: nx.DiGraph) -> TrainingGraph:
    """The forward ops and their extras, the gradient seeds and the backward nodes."""
    nodes: dict[str, list] = {name: [] for name in FIELDS}

    def add(name: str, mem: int, preds: Iterable[int], *, flops: int = 0, once: bool = True, kept: bool = False,
            fresh: tuple[int, ...] = (), transient: int = 0, home: int | None = None) -> int:
        index = len(nodes["names"])
        values = (name, mem, flops, tuple(sorted(set(preds))), once, kept, fresh, transient,
                  index if home is None else home)
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
            extra[k] = add(f"extra:{k}", attributes["saved_extra_bytes"], reads, once=once, home=len(nodes["names"]) + 1)
        fresh = tuple(index[u] for u in graph.predecessors(k) if u in index and not graph.nodes[u]["cuttable"])
        index[k] = add(k, attributes["bytes"], reads, flops=attributes["flops"], once=once, kept=k in kept, fresh=fresh)
    n_forward = len(nodes["names"])
    trained = trained_outputs(graph)
    loss = loss_working_bytes(graph)
    owner = {v: add(f"grad-seed:{v}", gradient_bytes(graph, v), (), kept=graph.nodes[v]["kind"] == "input",
                    transient=loss if v == trained[-1] else 0) for v in trained}  # v's gradient buffer
    for k in reversed(list(index)):
        gets_grad = k in owner and needs_grad(graph, k)
        inputs = [u for u in graph.predecessors(k) if gets_grad and needs_grad(graph, u)]
        reads = [owner[k]] if gets_grad else []
        reads += [owner[u] for u in inputs if u in owner] + ([extra[k]] if k in extra else [])
        reads += [index[r] for r in {storage_root(graph, v) for v in graph.nodes[k]["saved"]} if r in index]
        new = [u for u in inputs if u not in owner]
        moment = max(_partial_peak(graph, inputs, owner), _kernel_moment(graph, k, inputs, owner) if gets_grad else 0)
        for position, u in enumerate(new or [None]):
            node = add(f"backward:{k}" + (f":{u}" if position else ""), gradient_bytes(graph, u) if u else 0, reads,
                       kept=bool(u) and graph.nodes[u]["kind"] == "input",
                       transient=moment if position == max(len(new) - 1, 0) else 0)
            if u is not None:
                owner[u] = node
    return TrainingGraph(**{key: tuple(values) for key, values in nodes.items()}, n_forward=n_forward)


def _partial_peak(graph: nx.DiGraph, inputs: list[str], owner: dict[str, int]) -> int:
    """Bytes above "all new gradient buffers made" that adding into existing ones needs: each
    such gradient is made on its own first, before the new buffers of the inputs after it."""
    peak, made_after = 0, 0
    for u in reversed(inputs):
        if u in owner:
            peak = max(peak, gradient_bytes(graph, u) - made_after)
        else:
            made_after += gradient_bytes(graph, u)
    return peak


def _kernel_moment(graph: nx.DiGraph, name: str, inputs: list[str], owner: dict[str, int]) -> int:
    """Bytes above "all new gradient buffers made" while ``name``'s parameter gradients
    exist and, if it has any, its ``backward_extra_bytes`` with every gradient it returns
    (those to be added into existing buffers too), as :func:`passes.simulate` holds them."""
    extra = graph.nodes[name]["backward_extra_bytes"]
    partial = sum(gradient_bytes(graph, u) for u in inputs if u in owner)
    return graph.nodes[name]["param_grad_bytes"] + (extra and extra + partial)


def _forward_reads(graph: nx.DiGraph, name: str, index: dict[str, int]) -> set[int]:
    """The ops ``name`` reads, and the storage root of each view it reads."""
    return {index[v] for u in graph.predecessors(name) for v in (u, storage_root(graph, u)) if v in index}


def stage_peaks(training: TrainingGraph, R: Matrix, S: Matrix) -> list[float]:
    """Peak bytes of each stage of a schedule in the memory model above, freeing eagerly."""
    T, readers = training.size, training.readers()
    peaks = []
    for t in range(T):
        current = sum(training.mem[i] for i in range(t) if S[t][i])
        peak = current
        for k in (k for k in range(t + 1) if R[t][k]):
            current += training.mem[k]
            peak = max(peak, current + (training.transient[k] if k == t else 0))
            for i in (*training.preds[k], k):
                unread = i != k or not any(R[t][j] for j in readers[k] if j <= t)
                if unread and not (t + 1 < T and S[t + 1][i]) and not any(R[t][j] for j in readers[i] if j > k):
                    current -= training.mem[i]
        peaks.append(peak)
    return peaks


def no_recompute_schedule(training: TrainingGraph) -> tuple[Matrix, Matrix]:
    """Each node once, at home, kept while a later stage reads it."""
    T, readers, home = training.size, training.readers(), training.home
    R = tuple(tuple(int(home[i] == t) for i in range(T)) for t in range(T))
    S = tuple(tuple(int(home[i] < t and (training.kept[i] or any(home[j] >= t for j in readers[i])))
                    for i in range(T)) for t in range(T))
    return R, S


def no_recompute_peak(graph: nx.DiGraph) -> float:
    """Peak bytes without recompute (the simulator's eager peak): enough budget for no recompute."""
    training = training_graph(graph)
    return max(stage_peaks(training, *no_recompute_schedule(training)), default=0)


def last_use(training: TrainingGraph) -> list[int]:
    """The last stage at which each node can be of use: a once-only reader reads it at home,
    a recomputable one as late as it is itself of use, an op as late as its extra."""
    T, readers, home = training.size, training.readers(), training.home
    last = [T - 1 if kept else -1 for kept in training.kept]
    for i in reversed(range(T)):
        for j in readers[i]:
            last[i] = max(last[i], home[j] if training.once[j] else max(home[j], last[j]))
        last[home[i]] = max(last[home[i]], last[i])
    return [max(used, home[i]) for i, used in enumerate(last)]


class _Model:
    """MILP columns by key and sparse rows; terms of keys never made a column are zeros."""

    def __init__(self) -> None:
        self.columns: dict[tuple, int] = {}
        self.bounds: list[tuple[float, float, int]] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, key: tuple, lower: float, upper: float, integer: bool) -> None:
        self.columns[key] = len(self.bounds)
        self.bounds.append((lower, upper, int(integer)))

    def row(self, terms: list[tuple[tuple, float]], lower: float, upper: float) -> None:
        coefficients: dict[int, float] = {}
        for key, value in terms:
            if key in self.columns:
                coefficients[self.columns[key]] = coefficients.get(self.columns[key], 0.0) + value
        self.rows.append((coefficients, lower, upper))

    def solve(self, cost: np.ndarray, time_limit: float, relaxed: bool = False):
        """HiGHS's solution; ``relaxed``: of the LP relaxation (no variable integer)."""
        data = [(r, c, v) for r, (terms, _, _) in enumerate(self.rows) for c, v in terms.items()]
        rows, columns, values = zip(*data, strict=True) if data else ((), (), ())
        matrix = coo_array((values, (rows, columns)), shape=(len(self.rows), len(self.bounds))).tocsr()
        lower, upper, integer = zip(*self.bounds, strict=True)
        return milp(cost, constraints=LinearConstraint(matrix, [r[1] for r in self.rows], [r[2] for r in self.rows]),
                    integrality=np.zeros(len(integer)) if relaxed else np.array(integer), bounds=Bounds(lower, upper),
                    options={"time_limit": time_limit, "mip_rel_gap": 1e-9, "presolve": True})


def _build(training: TrainingGraph, budget: float) -> _Model:
    """The variables and constraints above; memory in units of the largest node size."""
    T, readers, last, home = training.size, training.readers(), last_use(training), training.home
    unit = max(max(training.mem, default=0), 1)
    mem = [m / unit for m in training.mem]
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
                terms += [(("U", t, previous), -1.0)] + [(("F", t, i, previous), mem[i]) for i in training.frees(previous)]
            transient = training.transient[k] / unit if k == t else 0.0
            model.row(terms, transient, transient)
            previous = k
    return model


def _schedule_rows(model: _Model, training: TrainingGraph, readers: list[list[int]], t: int) -> None:
    """Stage ``t``'s dependency, keep, free and dominance rows."""
    inf, after, home = -math.inf, ("S", t + 1), training.home
    for k in (k for k in range(t + 1) if ("R", t, k) in model.columns):
        recompute = training.fresh[k] if t != home[k] else ()
        for i in (*recompute, *((home[k],) if home[k] != k else ())):
            model.row([(("R", t, k), 1.0), (("R", t, i), -1.0)], inf, 0.0)
        for i in training.preds[k]:
            model.row([(("R", t, k), 1.0), (("R", t, i), -1.0), (("S", t, i), -1.0)], inf, 0.0)
        for i in training.frees(k) if k < t else ():
            free = ("F", t, i, k)
            model.row([(free, 1.0), (("R", t, k), -1.0)], inf, 0.0)
            model.row([(free, 1.0), ((*after, i), 1.0)], inf, 1.0)
            for j in readers[i]:
                if k < j <= t:
                    model.row([(free, 1.0), (("R", t, j), 1.0)], inf, 1.0)
    again = training.makers | {i for reads in training.fresh for i in reads}
    for i in range(t + 1):
        model.row([((*after, i), 1.0), (("S", t, i), -1.0), (("R", t, i), -1.0)], inf, 0.0)
        if i == t:
            continue
        if i not in again:
            model.row([(("S", t, i), 1.0), (("R", t, i), 1.0)], inf, 1.0)
        used = [(("R", t, j), -1.0) for j in readers[i] if j <= t] + [((*after, i), -1.0)]
        if i not in training.makers:
            model.row([(("R", t, i), 1.0), *used], inf, 0.0)
        if not training.kept[i]:
            model.row([(("S", t, i), 1.0), *used], inf, 0.0)


def _matrix(model: _Model, x: np.ndarray, name: str, T: int) -> Matrix:
    """Rounded 0/1 values of the ``R`` or ``S`` variables as a ``T x T`` matrix."""
    def value(t: int, i: int) -> int:
        column = model.columns.get((name, t, i))
        return 0 if column is None else int(x[column] > 0.5)
    return tuple(tuple(value(t, i) for i in range(T)) for t in range(T))


def _recompute_cost(model: _Model, training: TrainingGraph) -> np.ndarray:
    """The objective: each forward op's FLOPs per run, over their common divisor."""
    cost = np.zeros(len(model.bounds))
    divisor = math.gcd(*training.flops) or 1
    for (kind, _, i, *_), column in model.columns.items():
        if kind == "R" and i < training.n_forward:
            cost[column] = training.flops[i] / divisor
    return cost


def relaxed_holds(graph: nx.DiGraph, budget_bytes: float, *, time_limit: float = 5.0) -> dict[str, float] | None:
    """For each forward value, how much of it the LP relaxation of the MILP under
    ``budget_bytes`` holds from forward into backward (``S`` entering the first backward
    stage, in ``[0, 1]``): Checkmate's rounding starts from it, and it solves in a fraction
    of a second where the MILP takes seconds. ``None`` when the relaxation is infeasible
    or not solved in ``time_limit``; :class:`ValueError` above :data:`MAX_OPS` op nodes."""
    if len(op_nodes(graph)) > MAX_OPS:
        raise ValueError(f"relaxed_holds: {len(op_nodes(graph))} op nodes, more than {MAX_OPS}")
    training = training_graph(graph)
    model = _build(training, budget_bytes)
    solution = model.solve(_recompute_cost(model, training), time_limit, relaxed=True)
    if solution.status != 0 or solution.x is None:
        return None
    first = training.n_forward
    return {training.names[i]: float(solution.x[column]) for (kind, t, i, *_), column in model.columns.items()
            if kind == "S" and t == first and training.home[i] == i}  # values, not extras


def checkmate_schedule(graph: nx.DiGraph, budget_bytes: float, *, time_limit: float = 30.0) -> CheckmateResult | None:
    """Solve the MILP for ``graph`` under ``budget_bytes``; ``None`` when no schedule fits.

    Raises :class:`ValueError` above :data:`MAX_OPS` op nodes and :class:`TimeoutError` when
    the time limit passes before any schedule that fits is found.
    """
    n_ops = len(op_nodes(graph))
    if n_ops > MAX_OPS:
        raise ValueError(f"checkmate_schedule: {n_ops} op nodes, more than {MAX_OPS}; "
                         "the MILP grows as n^2 (use a heuristic strategy)")
    if budget_bytes < 0:
        return None
    training = training_graph(graph)
    model = _build(training, budget_bytes)
    cost = _recompute_cost(model, training)
    divisor = math.gcd(*training.flops) or 1
    started = time.perf_counter()
    solution = model.solve(cost, time_limit)
    seconds = time.perf_counter() - started
    if solution.status == 2:
        return None
    if solution.x is None:
        raise TimeoutError(f"checkmate_schedule: no schedule found within {time_limit}s ({solution.message})")
    T = training.size
    R, S = _matrix(model, solution.x, "R", T), _matrix(model, solution.x, "S", T)
    total = sum(training.flops[i] * R[t][i] for t in range(T) for i in range(training.n_forward))
    forward = sum(training.flops[: training.n_forward])
    bound = getattr(solution, "mip_dual_bound", None)  # HiGHS's proven bound, in cost units
    proven = total if solution.status == 0 else bound * divisor if bound is not None and math.isfinite(bound) else 0
    return CheckmateResult(
        recompute_flops=total - forward, recompute_lower_bound=min(max(proven - forward, 0.0), total - forward),
        peak_bytes=float(max(stage_peaks(training, R, S), default=0)),
        status="optimal" if solution.status == 0 else "time_limit",
        solve_seconds=seconds, stages=training.names, R=R, S=S,
    )
