"""An exact reference solver in the style of Checkmate (Jain et al. 2020, arXiv 1910.02653).

It measures how far the heuristic strategies are from optimal; it is not a strategy itself.
The MILP is solved by HiGHS through :func:`scipy.optimize.milp`.

The graph it schedules, one stage per forward op, seed and backward node, is
:mod:`passes.training_graph`.

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

**Executable schedules** (``executable=True``, what :mod:`passes.exact` runs): recompute
only where the runtime can act, just before an op's backward (a hook on its ``grad_fn``),
and only of pure ops: ``R[t,i] = 0`` for ``t != home(i)`` unless ``t`` is the first backward
node of an op the runtime hooks (:func:`passes.schedule.hooked_ops`) and ``i`` a pure
forward op (no recompute in forward, at a
seed, or between the gradient buffers one backward node makes). What such a schedule lets
go where no hook fires the runtime lets go at the next hook: :func:`passes.exact.schedule_of`
prices it so.

**Objective.** Minimise ``Σ_t Σ_i R[t,i]·flops_i`` over forward ops (backward nodes run once:
a constant). ``recompute_flops`` is that minus the forward's flops.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import networkx as nx
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from passes.graph_facts import op_nodes, pure_ops
from passes.schedule import hooked_ops
from passes.training_graph import Matrix, TrainingGraph, last_use, stage_peaks, training_graph

MAX_OPS = 60

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


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence what HiGHS's C++ code prints to the process's stdout and stderr while it
    solves (on this model its MIP heuristics print debug lines), so a BudgetError or a
    budget plan does not come with a screen of solver chatter: every solve runs under it."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as devnull:
        try:
            os.dup2(devnull.fileno(), 1)
            os.dup2(devnull.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)



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
        with quiet():  # its MIP heuristics print debug lines from C++
            return milp(cost, constraints=LinearConstraint(matrix, [r[1] for r in self.rows], [r[2] for r in self.rows]),
                        integrality=np.zeros(len(integer)) if relaxed else np.array(integer),
                        bounds=Bounds(lower, upper),
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


def _pin_executable(model: _Model, training: TrainingGraph, graph: nx.DiGraph) -> None:
    """Restrict ``model`` to schedules :mod:`passes.exact` can run (see the module's docstring)."""
    names, home = training.names, training.home
    hooks = {f"backward:{k}" for k in hooked_ops(graph)}
    remakeable = {i for i in range(training.n_forward) if home[i] == i and names[i] in pure_ops(graph)}
    for (kind, t, i, *_), column in model.columns.items():
        if kind == "R" and t != home[i] and not (names[t] in hooks and i in remakeable):
            model.bounds[column] = (0.0, 0.0, model.bounds[column][2])


def _matrix(model: _Model, x: np.ndarray, name: str, T: int) -> Matrix:
    """Rounded 0/1 values of the ``R`` or ``S`` variables as a ``T x T`` matrix."""
    def value(t: int, i: int) -> int:
        column = model.columns.get((name, t, i))
        return 0 if column is None else int(x[column] > 0.5)
    return tuple(tuple(value(t, i) for i in range(T)) for t in range(T))


def _recompute_cost(model: _Model, training: TrainingGraph, tie_break: bool = False) -> np.ndarray:
    """The objective: each forward op's FLOPs per run, over their common divisor; with
    ``tie_break``, plus its bytes scaled so that all of them weigh less than one unit: of
    schedules recomputing the same FLOPs, the one writing least (FLOPs-free ops such as
    ``cat`` take time too)."""
    cost = np.zeros(len(model.bounds))
    divisor = math.gcd(*training.flops) or 1
    weight = 0.5 / (1 + training.size * sum(training.mem[: training.n_forward])) if tie_break else 0.0
    for (kind, _, i, *_), column in model.columns.items():
        if kind == "R" and i < training.n_forward:
            cost[column] = training.flops[i] / divisor + weight * training.mem[i]
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


def executable_bound(graph: nx.DiGraph, budget_bytes: float, *, time_limit: float = 5.0) -> float | None:
    """A lower bound on what any executable schedule (``executable=True``) under
    ``budget_bytes`` recomputes: the LP relaxation's optimum, solved in a fraction of the
    MILP's time, so that a caller holding a plan at least this cheap need not solve the MILP;
    ``None`` when the relaxation finds no schedule (none fits) or is not solved in time."""
    training = training_graph(graph)
    model = _build(training, budget_bytes)
    _pin_executable(model, training, graph)
    solution = model.solve(_recompute_cost(model, training), time_limit, relaxed=True)
    if solution.status != 0 or solution.x is None:
        return None
    divisor = math.gcd(*training.flops) or 1
    return float(solution.fun) * divisor - sum(training.flops[: training.n_forward])


def checkmate_schedule(graph: nx.DiGraph, budget_bytes: float, *, time_limit: float = 30.0,
                       executable: bool = False) -> CheckmateResult | None:
    """Solve the MILP for ``graph`` under ``budget_bytes``; ``None`` when no schedule fits;
    ``executable``: among the schedules :mod:`passes.exact` runs only.

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
    if executable:
        _pin_executable(model, training, graph)
    cost = _recompute_cost(model, training, tie_break=executable)
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
