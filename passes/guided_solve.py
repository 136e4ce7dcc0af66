"""How the recompute MILP of :mod:`passes.checkmate` is solved within a time limit: from
starts its LP relaxation points to (sub-MIPs with part of the columns fixed), then whole,
each solve asked only for schedules recomputing less than the best found. What the MILP
is, its variables and rows, is :mod:`passes.checkmate`'s; this is only the search."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import numpy as np

from passes.highs import Milp, Solved

FLOPS_PROVEN = 0.49  # objective gap proving a schedule's FLOPs least: they are whole units, the tie-break
# weighs less than half of one (zoo DenseNets' solves ran to a 10 s limit proving the bytes; now 2.4-9.1 s)
FREED_AT = ((0.5, 0.08), (0.3, 0.08), (0.1, 0.12))  # (an S the LP relaxation holds at most this is fixed at 0,
# the share of the time limit it may take on top of it): the smaller sub-MIPs, smallest first (freed_neighbourhoods)
GUIDED_SHARE = 0.9  # of the time left after the LP relaxation, what the sub-MIP it guides may take: the zoo
# DenseNet at its tightest planned peak needs 2.5-3 s of it for the schedule a 5 s full MILP never found (at
# 0.75 of a 5 s limit it found it in 1 of 3 runs, at 0.9 in 3 of 3); the whole MILP rarely improves on it later


def guided_solve(model: Milp, cost: np.ndarray, time_limit: float, cutoff: float | None) -> Solved:
    """The MILP solved from starts the LP relaxation points to: the sub-MIP with every ``S``
    the relaxation sets whole (0 or 1) fixed there, for :data:`GUIDED_SHARE` of the time,
    then smaller sub-MIPs (:func:`freed_neighbourhoods`, up to 28% of ``time_limit`` on
    top of it: :data:`FREED_AT`), then the whole MILP for the rest, each asked only for
    schedules recomputing less than the best found.

    At tight budgets HiGHS spends seconds in cuts at the root before it finds any schedule of
    the whole model; the sub-MIP, a fraction of its columns free, finds one in a second or
    two (40-op random DAGs at 0.5 of eager, zoo DenseNet at 0.54), and the whole MILP then
    improves on it or proves it least. (HiGHS's ``setSolution`` start is not used: after it,
    ``getSolution`` could return the start while the reported objective was a better
    schedule's. Giving the whole MILP a first 20% to prove a ``cutoff`` plan optimal, as it
    often does in under a second, lost the DenseNet schedule and a 40-op DAG's at 0.3 of
    eager: not done.)"""
    started = time.perf_counter()

    def left() -> float:
        return max(time_limit - (time.perf_counter() - started), 0.0)

    relaxation = model.solve(cost, time_limit, relaxed=True)
    if relaxation.x is None:  # infeasible: so is every schedule
        return relaxation
    if cutoff is not None and relaxation.objective > cutoff:  # its bound proves no schedule beats the cutoff
        return Solved("infeasible", None, math.inf, relaxation.objective)
    S = [column for key, column in model.columns.items() if key[0] == "S"]
    whole = {column: float(round(value)) for column in S if abs((value := relaxation.x[column]) - round(value)) < 1e-6}
    best = _better(None, model.fixed(whole).solve(cost, GUIDED_SHARE * left(), cutoff=cutoff, enough=FLOPS_PROVEN))
    rest = left()  # the whole MILP's, kept for after the smaller sub-MIPs
    for fixed, share in freed_neighbourhoods(S, relaxation.x):
        bar = cutoff if best is None else _below(best, cutoff)
        best = _better(best, model.fixed(fixed).solve(cost, share * time_limit, cutoff=bar, enough=FLOPS_PROVEN))
    if best is None:
        return model.solve(cost, rest, cutoff=cutoff, enough=FLOPS_PROVEN)
    full = model.solve(cost, rest, cutoff=_below(best, cutoff), enough=FLOPS_PROVEN)
    if full.x is not None and full.objective < best.objective:  # recomputes less
        return full
    if full.status in ("optimal", "infeasible"):  # proven: no schedule recomputes less than the best found
        return Solved("optimal", best.x, best.objective, best.objective)
    bounds = [relaxation.objective, *([full.bound] if math.isfinite(full.bound) else [])]  # both proven
    return Solved("time_limit", best.x, best.objective, min(max(bounds), best.objective))


def _better(best: Solved | None, found: Solved) -> Solved | None:
    """The solve of the two that found the schedule recomputing less."""
    if found.x is None or (best is not None and best.objective <= found.objective):
        return best
    return found


def _below(best: Solved, cutoff: float | None) -> float:
    """The cutoff asking only for schedules recomputing less than ``best``: FLOPs are whole
    units and the tie-break weighs under half of one."""
    better = best.objective - 0.5
    return better if cutoff is None else min(cutoff, better)


def freed_neighbourhoods(S: list[int], relaxed: np.ndarray) -> Iterator[tuple[dict[int, float], float]]:
    """The smaller sub-MIPs :func:`guided_solve` searches after the one the relaxation sets
    whole, as ``(columns fixed, share of the time limit)``: every ``S`` column the relaxation
    holds at most a threshold of :data:`FREED_AT` fixed at 0 (nothing held that the
    relaxation barely holds). Where the relaxation is fractional, as at 0.3 of eager, they
    find schedules the whole-set sub-MIP does not; where it is nearly whole they rarely find
    a better one and may still run to their limits (40-op DAGs at 0.7 of eager: the same
    plans, planning 2.0 -> 2.6 s median).

    Measured on the 13 random DAGs of 40 ops that a plan meets at 0.3 of eager
    (``scripts/planner_gap.py``'s, seeds 0 and 1), ``fit_budget`` with 5 s for the solver: 8%
    less recompute in all, up to 37% less on one graph, 1.5% more on one, in 1.4 s more."""
    for threshold, share in FREED_AT:
        yield {column: 0.0 for column in S if relaxed[column] <= threshold}, share
