"""An exact reference solver in the style of Checkmate (Jain et al. 2020, arXiv 1910.02653).

It measures how far the heuristic strategies are from optimal; it is not a strategy itself.
The MILP is solved by HiGHS (``highspy``, which takes a cutoff: see
:meth:`passes.highs.Milp.solve`), from a start the LP relaxation guides (:func:`passes.guided_solve.guided_solve`).

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
R[t,op]``. A view held holds its storage: ``S[t,v] <= S[t,root(v)]`` (the view's own size is 0; found
when a schedule kept ``chunk``'s views without the projection they are of, 18% under its measured
peak). A recompute reads no kept copy of an uncuttable op value ``i`` (it may have been
overwritten): ``R[t,k] <= R[t,i]`` for ``t != home(k)``. Memory as in the paper: ``U[t,first] =
R·m + Σ_i S[t,i]·m_i``, ``U[t,k] = U[t,k'] + R[t,k]·m_k - Σ_i m_i·F[t,i,k']`` for ``k'`` the
previous node that may run in stage ``t``, plus the transient bytes at ``U[t,t]`` (and there
an op's ``autocast_cache_bytes``, which stay to the end of forward: each forward stage's first
``U`` holds those of the ops before it). An op's ``forward_extra_bytes`` are on top whenever it
runs: at home in ``U[t,t]``, in a recompute ``U[t,k] + R[t,k]·extra_k <= budget``. So is its
extra ``e`` where the stage does not make it (made and let go inside the op):
``m_e·(1 - R[t,e])`` in ``U[t,t]``, ``m_e·(R[t,k] - R[t,e])`` in a recompute's row; and in a
recompute its ``autocast_cache_bytes`` (a step runs with the cache off). The paper
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
forward op or the extra of one (no recompute in forward, at a seed, or between the gradient
buffers one backward node makes; an extra, max-pool's indices, is made again by running its
op with autograd on: :mod:`graphckpt.exact`; never under autocast: :func:`extras_stay`).
What such a schedule lets
go where no hook fires the runtime lets go at the next hook: :func:`passes.exact.schedule_of`
prices it so.

**Objective.** Minimise ``Σ_t Σ_i R[t,i]·flops_i`` over forward ops (backward nodes run once:
a constant). ``recompute_flops`` is that minus the forward's flops.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import networkx as nx
import numpy as np

from passes.graph_facts import op_nodes, pure_ops
from passes.guided_solve import guided_solve
from passes.highs import Milp, Solved
from passes.plan_start import start_columns
from passes.training_graph import Matrix, TrainingGraph, hooked_stages, last_use, stage_peaks, training_graph

MAX_OPS = 60



class SolveTimeout(TimeoutError):
    """The time limit passed before HiGHS found a schedule (with ``beat``: one recomputing
    less); ``recompute_lower_bound`` is what it proved no schedule recomputes less than."""

    def __init__(self, message: str, recompute_lower_bound: float) -> None:
        super().__init__(message)
        self.recompute_lower_bound = recompute_lower_bound


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


def build_milp(training: TrainingGraph, budget: float) -> Milp:
    """The variables and constraints above; memory in units of the largest node size."""
    T, readers, last, home = training.size, training.readers(), last_use(training), training.home
    unit = max(max(training.mem, default=0), 1)
    mem = [m / unit for m in training.mem]
    runs = [[i for i in range(t + 1) if t == home[i] or (not training.once[i] and home[i] < t <= last[i])]
            for t in range(T)]
    model = Milp()
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
            moment = training.transient[k] + training.cached[k] + training.run_extra[k] if k == t else 0
            extra = training.extra_node(k) if k == t else None
            if extra is not None:  # its extra, when forward drops it, held for a moment all the same
                terms.append((("R", t, extra), mem[extra]))
                moment += training.mem[extra]
            held = moment + (training.cache_entering(t) if previous is None else 0)
            model.row(terms, held / unit, held / unit)
            previous = k
    for terms in recompute_temporaries(training, model.columns, unit):
        model.row(terms, -math.inf, budget / unit)
    return model


def recompute_temporaries(training: TrainingGraph, columns: Mapping[tuple, int],
                          unit: float) -> Iterator[list[tuple[tuple, float]]]:
    """The terms of ``U[t,k]`` plus what op ``k`` holds for a moment while stage ``t`` runs
    it again, for each op with forward temporaries, casts or an extra: the memory after it
    runs plus its temporaries, its casts (autocast's cache is off in a step) and its extra
    when the stage does not make it (made and let go inside the op,
    :meth:`passes.training_graph.TrainingGraph.extra_node`), is what the budget (or the
    floor's peak, :mod:`passes.floor`) must hold."""
    for key in columns:
        if key[0] != "R" or key[1] == key[2]:
            continue
        t, k = key[1:]
        extra = training.extra_node(k)
        extra_bytes = 0 if extra is None else training.mem[extra]
        moment = training.run_extra[k] + training.cached[k]  # a step runs with autocast's cache off
        if not moment and not extra_bytes:
            continue
        terms = [(("U", t, k), 1.0), (key, (moment + extra_bytes) / unit)]
        if extra_bytes and ("R", t, extra) in columns:
            terms.append((("R", t, extra), -extra_bytes / unit))
        yield terms


def _schedule_rows(model: Milp, training: TrainingGraph, readers: list[list[int]], t: int) -> None:
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
    for i in range(t):  # a view held holds its storage (its root's bytes; the view counts none)
        if training.root[i] != i and ("S", t, i) in model.columns:  # else no row: nothing holds the view
            model.row([(("S", t, i), 1.0), (("S", t, training.root[i]), -1.0)], inf, 0.0)
    for i in range(t + 1):
        model.row([((*after, i), 1.0), (("S", t, i), -1.0), (("R", t, i), -1.0)], inf, 0.0)
        if i == t:
            continue
        if i not in training.remade:
            model.row([(("S", t, i), 1.0), (("R", t, i), 1.0)], inf, 1.0)
        used = [(("R", t, j), -1.0) for j in readers[i] if j <= t] + [((*after, i), -1.0)]
        if i not in training.makers:
            model.row([(("R", t, i), 1.0), *used], inf, 0.0)
        if not training.kept[i]:
            model.row([(("S", t, i), 1.0), *used], inf, 0.0)


def pin_executable(model: Milp, training: TrainingGraph, graph: nx.DiGraph, extras: bool = True) -> None:
    """Restrict ``model`` to schedules :mod:`passes.exact` can run (see the module's docstring):
    a hooked stage may make a pure op's value again, and its extra with it (the runtime runs
    that op with autograd on and keeps what it saves beyond values; not with ``extras``
    false: :func:`remakeable_extras`)."""
    names, home = training.names, training.home
    hooks = hooked_stages(graph, training)
    pure = pure_ops(graph)  # no random op among them: a draw made again would differ
    with_extra = remakeable_extras(graph) if extras else frozenset()
    remakeable = {i for i in range(training.n_forward)
                  if (names[i] in pure if home[i] == i else names[home[i]] in with_extra)}
    for (kind, t, i, *_), column in model.columns.items():
        if kind == "R" and t != home[i] and not (t in hooks and i in remakeable):
            model.bounds[column] = (0.0, 0.0, model.bounds[column][2])


def extras_stay(graph: nx.DiGraph) -> bool:
    """Whether no extra of ``graph`` may be made again: on a graph captured under autocast.
    An extra there may hold casts autocast's cache keeps to the end of forward, which
    dropping it in forward does not free, and a step running an op with autograd on under
    autocast held more than its schedule's model: SelfAttention under bf16 at 0.8 of eager
    measured 12% over its simulated peak with two Linear layers' extras (their weights'
    bf16 copies) made again, and 6.8% over with only attention's (its log-sum-exp), while
    the schedule holding every extra measured its simulated peak exactly."""
    return bool(graph.graph.get("autocast"))


def remakeable_extras(graph: nx.DiGraph) -> frozenset[str]:
    """The ops whose extra an executable schedule may make again: pure ops with one (the
    runtime runs the op again with autograd on: :mod:`graphckpt.exact`), none on a graph
    captured under autocast (:func:`extras_stay`)."""
    if extras_stay(graph):
        return frozenset()
    return frozenset(name for name in pure_ops(graph) if graph.nodes[name]["saved_extra_bytes"])


def matrix_of(model: Milp, x: np.ndarray, name: str, T: int) -> Matrix:
    """Rounded 0/1 values of the ``R`` or ``S`` variables as a ``T x T`` matrix."""
    def value(t: int, i: int) -> int:
        column = model.columns.get((name, t, i))
        return 0 if column is None else int(x[column] > 0.5)
    return tuple(tuple(value(t, i) for i in range(T)) for t in range(T))


def recompute_objective(model: Milp, training: TrainingGraph, tie_break: bool = False) -> np.ndarray:
    """The objective: each forward op's FLOPs per run, over their common divisor; with
    ``tie_break``, plus its bytes scaled so that all of them weigh less than half a unit: of
    schedules recomputing the same FLOPs, one writing less (FLOPs-free ops such as ``cat``
    take time too). The solve stops once the FLOPs are proven least (:data:`passes.polish.FLOPS_PROVEN`),
    not when the bytes are too."""
    cost = np.zeros(len(model.bounds))
    divisor = math.gcd(*training.flops) or 1
    weight = 0.5 / (1 + training.size * sum(training.mem[: training.n_forward])) if tie_break else 0.0
    for (kind, _, i, *_), column in model.columns.items():
        if kind == "R" and i < training.n_forward:
            cost[column] = training.flops[i] / divisor + weight * training.mem[i]
    return cost


class Relaxation(NamedTuple):
    """What the LP relaxation under a budget answered: ``holds``, for each forward value how
    much of it the relaxation holds from forward into backward (``S`` entering the first
    backward stage, in ``[0, 1]``: Checkmate's rounding starts from it, and it solves in a
    fraction of a second where the MILP takes seconds), ``None`` when it has none; and
    ``status``, HiGHS's word for why (``"optimal"``, ``"infeasible"``, ``"time_limit"``): an
    infeasible relaxation says the budget is below every schedule, a timed-out one says nothing."""

    holds: dict[str, float] | None
    status: str


def relaxation(graph: nx.DiGraph, budget_bytes: float, *, time_limit: float = 5.0) -> Relaxation:
    """The LP relaxation of the MILP under ``budget_bytes``, solved in ``time_limit``
    seconds: its holds and status (:class:`Relaxation`); :class:`ValueError` above
    :data:`MAX_OPS` op nodes."""
    if len(op_nodes(graph)) > MAX_OPS:
        raise ValueError(f"relaxation: {len(op_nodes(graph))} op nodes, more than {MAX_OPS}")
    training = training_graph(graph)
    model = build_milp(training, budget_bytes)
    solution = model.solve(recompute_objective(model, training), time_limit, relaxed=True)
    if solution.status != "optimal" or solution.x is None:
        return Relaxation(None, solution.status)
    first = training.n_forward
    return Relaxation({training.names[i]: float(solution.x[column]) for (kind, t, i, *_), column
                       in model.columns.items() if kind == "S" and t == first and training.home[i] == i},  # not extras
                      solution.status)


def checkmate_schedule(graph: nx.DiGraph, budget_bytes: float, *, time_limit: float = 30.0,
                       executable: bool = False, beat: float | None = None,
                       extras: bool = True, polish_start: bool = True,
                       start: tuple[Matrix, Matrix] | None = None) -> CheckmateResult | None:
    """Solve the MILP for ``graph`` under ``budget_bytes``; ``None`` when no schedule fits;
    ``executable``: among the schedules :mod:`passes.exact` runs only (with ``extras``
    false, those holding every extra from forward); ``beat``: only schedules recomputing
    fewer FLOPs than that (a plan in hand's), ``None`` when none does.

    Raises :class:`ValueError` above :data:`MAX_OPS` op nodes and :class:`SolveTimeout` (a
    :class:`TimeoutError`) when the time limit passes before any schedule that fits (and
    recomputes less than ``beat``) is found.
    On one CPU the solve may take up to 28% more than ``time_limit`` (:data:`passes.guided_solve.FREED_AT`),
    and 15% more where no schedule beat ``beat`` before the polish and ``polish_start``
    (:data:`passes.guided_solve.START_SHARE`: a start for the polish); a polish still bettering
    its schedule at the limit goes on, up to ``time_limit`` more
    (:data:`passes.polish.POLISH_OVERTIME`). ``start``: a schedule in hand (``R``,
    ``S``; :mod:`passes.plan_start`), the search's first best where it fits.
    """
    n_ops = len(op_nodes(graph))
    if n_ops > MAX_OPS:
        raise ValueError(f"checkmate_schedule: {n_ops} op nodes, more than {MAX_OPS}; "
                         "the MILP grows as n^2 (use a heuristic strategy)")
    if budget_bytes < 0:
        return None
    training = training_graph(graph)
    model = build_milp(training, budget_bytes)
    if executable:
        pin_executable(model, training, graph, extras)
    cost = recompute_objective(model, training, tie_break=executable)
    divisor = math.gcd(*training.flops) or 1
    forward = sum(training.flops[: training.n_forward])
    cutoff = None if beat is None else (beat + forward) / divisor - 0.5  # FLOPs are whole multiples of the
    started = time.perf_counter()  # divisor, and the tie-break weighs less than half of one
    fixed = None if start is None else start_columns(model, *start)
    solution = guided_solve(model, cost, time_limit, cutoff, polish_start, fixed)
    seconds = time.perf_counter() - started
    if solution.status == "infeasible":
        return None
    if solution.x is None:
        raise _timeout(solution, time_limit, divisor, forward, beat)
    T = training.size
    R, S = matrix_of(model, solution.x, "R", T), matrix_of(model, solution.x, "S", T)
    total = sum(training.flops[i] * R[t][i] for t in range(T) for i in range(training.n_forward))
    above_beat = beat is not None and total - forward >= beat  # the polish's start, or HiGHS's before pruning
    if above_beat and solution.status != "optimal":
        raise _timeout(solution, time_limit, divisor, forward, beat)
    if above_beat:  # proven: no schedule beats it, though the solve answers with one above it
        return None
    proven = total if solution.status == "optimal" else solution.bound * divisor  # HiGHS's bound, in cost units
    return CheckmateResult(
        recompute_flops=total - forward, recompute_lower_bound=min(max(proven - forward, 0.0), total - forward),
        peak_bytes=float(max(stage_peaks(training, R, S), default=0)),
        status="optimal" if solution.status == "optimal" else "time_limit",
        solve_seconds=seconds, stages=training.names, R=R, S=S,
    )


def _timeout(solution: Solved, time_limit: float, divisor: int, forward: int, beat: float | None) -> SolveTimeout:
    """What :func:`checkmate_schedule` raises when ``solution`` stopped at its time limit with
    no schedule (recomputing less than ``beat``): what it proved, in FLOPs of recompute."""
    proven = max(solution.bound * divisor - forward, 0.0) if math.isfinite(solution.bound) else 0.0
    return SolveTimeout(f"checkmate_schedule: no schedule{'' if beat is None else ' beating the cutoff'} "
                        f"found within {time_limit}s ({solution.status})", proven if beat is None else min(proven, beat))
