"""The true floor: the least peak any schedule reaches, by the MILP of :mod:`passes.checkmate`.

A plan's floor (the smallest peak of the plans a strategy can build) can sit above what any
recompute schedule reaches: Checkmate's schedules recompute a value from several kept ones
just before each use, which segments do not express. :class:`passes.budget.BudgetError`
names both, so a user knows whether a lower budget is out of reach of every schedule or
only of graphckpt's plans.

The MILP is the one of :mod:`passes.checkmate` with the budget left free: one more variable
``P`` bounds the memory after every step (``U[t,k] <= P``) and the objective is ``P``. It is
solved only for small graphs (:data:`FLOOR_MAX_OPS`) and within a time limit; a solve stopped
there gives the smallest peak it found and the bound it proved.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np

from passes.checkmate import build_milp, matrix_of, pin_executable, recompute_objective, recompute_temporaries
from passes.graph_facts import op_nodes
from passes.highs import Milp, Solved
from passes.training_graph import Matrix, TrainingGraph, no_recompute_peak, training_graph

FLOOR_MAX_OPS = 40
FLOOR_TIME_LIMIT = 5.0


@dataclass(frozen=True)
class Floor:
    """The least peak of any schedule: ``peak_bytes`` reached by the schedule found, and
    ``lower_bound_bytes`` proven (equal when the solve finished)."""

    peak_bytes: float
    lower_bound_bytes: float

    @property
    def proven(self) -> bool:
        return self.peak_bytes - self.lower_bound_bytes < 1

    def below(self, peak_bytes: float) -> Floor:
        """This floor, lowered to ``peak_bytes`` where a plan is known to reach less than the
        schedule found (its bound with it, where it proved more than that plan shows).

        >>> Floor(100, 80).below(90), Floor(100, 80).below(120)
        (Floor(peak_bytes=90, lower_bound_bytes=80), Floor(peak_bytes=100, lower_bound_bytes=80))
        >>> Floor(100, 95).below(90)
        Floor(peak_bytes=90, lower_bound_bytes=90)
        """
        if peak_bytes >= self.peak_bytes:
            return self
        return Floor(peak_bytes, min(self.lower_bound_bytes, peak_bytes))


def true_floor(graph: nx.DiGraph, time_limit: float = FLOOR_TIME_LIMIT, below: float | None = None) -> Floor | None:
    """The least peak any recompute schedule of ``graph`` reaches in the simulator's model of
    memory, or ``None`` for graphs over :data:`FLOOR_MAX_OPS` ops or a solve that found no
    schedule in ``time_limit`` seconds and proved nothing. With ``below``, the peak of a plan
    in hand, only schedules peaking less are sought (:func:`least_peak_schedule`): where
    none is found, the floor is that plan's peak, with what the solve proved of it."""
    found = least_peak_schedule(graph, time_limit, below=below)
    return None if found is None else found.floor


@dataclass(frozen=True)
class LeastPeak:
    """The schedule of least peak the solver found (``R``, ``S``, as
    :class:`passes.checkmate.CheckmateResult` gives them; ``None`` when it found none below
    the plan in hand) and its :class:`Floor`."""

    floor: Floor
    R: Matrix | None = None
    S: Matrix | None = None


def least_peak_schedule(graph: nx.DiGraph, time_limit: float = FLOOR_TIME_LIMIT,
                        executable: bool = False, below: float | None = None) -> LeastPeak | None:
    """The schedule of ``graph`` of least peak found in ``time_limit`` seconds, among every
    recompute schedule or, ``executable``, among those :mod:`passes.exact` runs (the floor
    of graphckpt's widest plans); ``None`` over :data:`FLOOR_MAX_OPS` ops or when the solve
    found none in time and proved nothing.

    With ``below``, the peak of a plan in hand, only schedules peaking less are sought
    (:func:`_solve_below`); where none is found, the answer has no schedule and its floor is
    ``below``, with the bound the solve proved. On a refused budget the zoo ResNet's two
    floor solves found nothing below the plans' floor in their 5 s each (stop 66)."""
    if len(op_nodes(graph)) > FLOOR_MAX_OPS:
        return None
    training = training_graph(graph)
    ceiling = no_recompute_peak(graph)  # every schedule fits under eager's own peak
    model = build_milp(training, ceiling)
    if executable:
        pin_executable(model, training, graph)
    recompute = _least_recompute_among_least_peaks(model, training) if executable else np.zeros(len(model.bounds))
    weight = RECOMPUTE_WEIGHT if executable else 0.0  # at most what recompute adds to the objective
    unit = max(max(training.mem, default=0), 1)
    memory_columns = [key for key in model.columns if key[0] == "U"]
    model.var(("P",), 0.0, ceiling / unit, False)
    for key in memory_columns:
        model.row([(key, 1.0), (("P",), -1.0)], -np.inf, 0.0)
    for terms in recompute_temporaries(training, model.columns, unit):
        model.row([*terms, (("P",), -1.0)], -np.inf, 0.0)
    cost = np.append(recompute, 1.0)  # P, the last column
    solution = _solve_below(model, cost, time_limit, None if below is None else below / unit + weight)
    bound = (float(solution.bound) - weight) * unit  # less what recompute adds
    peak = math.inf if solution.x is None else float(solution.x[model.columns[("P",)]]) * unit
    if below is not None and peak >= below:  # none below the plan in hand
        if solution.status == "infeasible":  # proven: none peaks less
            return LeastPeak(Floor(peak_bytes=below, lower_bound_bytes=below))
        if not math.isfinite(bound):
            return None
        return LeastPeak(Floor(peak_bytes=below, lower_bound_bytes=min(max(bound, 0.0), below)))
    if solution.x is None:
        return None
    lower = peak if solution.status == "optimal" else min(peak, max(bound, 0.0))
    T = training.size
    return LeastPeak(Floor(peak_bytes=peak, lower_bound_bytes=lower),
                     matrix_of(model, solution.x, "R", T), matrix_of(model, solution.x, "S", T))


CUTOFF_SHARE = 0.4  # of a floor solve's time, what its first try, pruned by the plan in hand, may take


def _solve_below(model: Milp, cost: np.ndarray, time_limit: float, cutoff: float | None) -> Solved:
    """``model`` solved for ``cost`` in ``time_limit`` seconds; with ``cutoff`` (the objective
    of a plan in hand), first for :data:`CUTOFF_SHARE` of the time pruned by it (HiGHS often
    proves in a second that nothing is lower: the zoo ResNet's executable floor in 1.3 s
    where the plain solve ran its 5 s), then, where that proved nothing, without it for the
    rest: pruned for the whole time, a 16-op DAG's executable floor went unfound that the
    plain solve finds in the same 5 s (stop 66). The answer is the better schedule of the
    two solves, its bound the better of what either proved."""
    if cutoff is None:
        return model.solve(cost, time_limit)
    started = time.perf_counter()
    pruned = model.solve(cost, CUTOFF_SHARE * time_limit, cutoff=cutoff)
    if pruned.status in ("infeasible", "optimal"):  # proven: nothing below the cutoff, or the least
        return pruned
    plain = model.solve(cost, max(time_limit - (time.perf_counter() - started), 0.0))
    proven = min(pruned.bound, cutoff) if math.isfinite(pruned.bound) else -math.inf  # pruned nodes: >= cutoff
    bound = max(proven, plain.bound if math.isfinite(plain.bound) else -math.inf)
    if pruned.x is not None and (plain.x is None or pruned.objective < plain.objective):
        return replace(pruned, bound=bound)  # found first, not proven least
    return replace(plain, bound=bound)


RECOMPUTE_WEIGHT = 1e-3  # what all recompute may weigh in the executable floor's objective, in units of its peak


def _least_recompute_among_least_peaks(model: Milp, training: TrainingGraph) -> np.ndarray:
    """An objective, beside the peak's, that makes of schedules peaking alike the one
    recomputing least: the floor's schedule is a plan a user may run (the peak alone leaves
    the solver free to recompute anything that does not raise it). All of it weighs at most
    :data:`RECOMPUTE_WEIGHT` of the unit the peak is counted in, so the peak found is within
    that of the least."""
    cost = recompute_objective(model, training)
    most = float(cost.sum())  # every R column at 1: more than any schedule recomputes
    return cost * (RECOMPUTE_WEIGHT / max(most, 1.0))
