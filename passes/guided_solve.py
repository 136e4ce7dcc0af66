"""How the recompute MILP of :mod:`passes.checkmate` is solved within a time limit: from
starts its LP relaxation points to (sub-MIPs with part of the columns fixed), then whole,
each solve asked only for schedules recomputing less than the best found. What the MILP
is, its variables and rows, is :mod:`passes.checkmate`'s; this is only the search. The polish
that ends it, and the best schedule its solves share, are :mod:`passes.polish`'s.

On a machine with two CPUs or more the search runs in two lanes at once (HiGHS lets go of
Python's lock while it solves): the sub-MIP the relaxation sets whole and then the whole
MILP in one, the freed neighbourhoods in the other, each telling the other the best it
found. One lane runs them one after the other."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import numpy as np

from passes.highs import Milp, Solved, at_once, lanes, quiet
from passes.polish import FLOPS_PROVEN, POLISH_OVERTIME, Incumbent, PolishClock, polish, seconds_left

FREED_AT = ((0.5, 0.08), (0.3, 0.08), (0.1, 0.12))  # (an S the LP relaxation holds at most this is fixed at 0,
# the share of the time limit it may take on top of it): the smaller sub-MIPs, smallest first (freed_neighbourhoods)
POLISH_SHARE = 0.3  # of a guided solve's time limit, kept for polishing the best schedule found where no solve
# proved it least: fit_budget on the 8 random DAGs of 40 ops at 0.3 of eager of scripts/planner_gap.py (seed 0),
# 5 s for the solver: 8% less recompute in all (9418 -> 8641-8662 FLOPs in two runs), less on 6 of 7 graphs (up
# to 18%), 1.5% more on one; seed 1's: 3% less; at 0.5 and 0.7 the same plans (those solves prove theirs least).
# A share of 0.5 left the guided solves too little time to beat the plan in hand (the cutoff) on one graph
LANE_FREED_AT = ((0.5, 0.15), (0.3, 0.25), (0.1, 1.0))  # the same in a lane of their own, ending with the time
# limit: the least fixed of them needs seconds at 0.3 of eager (a 40-op DAG: 2.4 s for a schedule recomputing 33%
# less than the one found in 0.4 s), which one lane never gives it after the whole-set sub-MIP's 90%
START_SHARE = 0.15  # of the time limit, on top of it: the most the polish's start may take where no solve beat the
# cutoff (a 40-op DAG at 0.3 of eager: the least fixed sub-MIP of FREED_AT finds a schedule in 0.5 s without one)
GUIDED_SHARE = 0.9  # of the time left after the LP relaxation, what the sub-MIP it guides may take: the zoo
# DenseNet at its tightest planned peak needs 2.5-3 s of it for the schedule a 5 s full MILP never found (at
# 0.75 of a 5 s limit it found it in 1 of 3 runs, at 0.9 in 3 of 3); the whole MILP rarely improves on it later


def guided_solve(model: Milp, cost: np.ndarray, time_limit: float, cutoff: float | None,
                 polish_start: bool = True, start: dict[int, float] | None = None) -> Solved:
    """The MILP solved from starts the LP relaxation points to: the sub-MIP with every ``S``
    the relaxation sets whole (0 or 1) fixed there, for :data:`GUIDED_SHARE` of the time,
    then the whole MILP for the rest; and smaller sub-MIPs (:func:`freed_neighbourhoods`),
    alongside in a second lane where the machine has a second CPU (:func:`passes.highs.lanes`), else
    between the two (up to 28% of ``time_limit`` on top: :data:`FREED_AT`). Each solve is
    asked only for schedules recomputing less than the best found (and than ``cutoff``).

    At tight budgets HiGHS spends seconds in cuts at the root before it finds any schedule of
    the whole model; the sub-MIP, a fraction of its columns free, finds one in a second or
    two (40-op random DAGs at 0.5 of eager, zoo DenseNet at 0.54), and the whole MILP then
    improves on it or proves it least. Where the whole-set sub-MIP has no schedule (40-op
    DAGs at 0.3 of eager) it spends its share learning so, and the freed neighbourhoods find
    the schedules. (HiGHS's ``setSolution`` start is not used: after it, ``getSolution``
    could return the start while the reported objective was a better schedule's. Giving the
    whole MILP a first 20% to prove a ``cutoff`` plan optimal, as it often does in under a
    second, lost the DenseNet schedule and a 40-op DAG's at 0.3 of eager: not done.)

    All this takes the first ``1 -`` :data:`POLISH_SHARE` of ``time_limit``. Where it ends
    without proving the best schedule least, the rest polishes that schedule (:func:`polish`),
    in both lanes where there are two, each from windows of its own, and goes on past
    ``time_limit`` (up to :data:`POLISH_OVERTIME` of it more) while it still betters the
    schedule: where the clock stopped a polish in mid-descent, a few seconds more took away
    recompute it had left (on a slower CPU most of all). Where no solve beat
    ``cutoff`` by then, the polish starts from ``start`` (the plan in hand read as a schedule,
    its ``R`` and ``S`` columns: :mod:`passes.plan_start`; its ``F`` and ``U`` solved at the
    outset), where its rows hold. Without one, and with ``polish_start``, the least fixed freed sub-MIP
    is asked for any schedule (up to :data:`START_SHARE` of ``time_limit`` on top) and the
    polish betters it (``own``), the result coming back even if it recomputes no less than
    ``cutoff`` (:func:`passes.checkmate.checkmate_schedule` drops it). Before, nothing was
    polished there: ``fit_budget`` on a 40-op random DAG at 0.3 of eager got no schedule in
    3.6 s and kept its plan of 1489 FLOPs, where the same solve without ``cutoff`` found one
    of 1227; now 1220-1376 (4 runs), the other 7 DAGs of ``scripts/planner_gap.py``'s budget
    table as before. ``polish_start`` false: the solve ends there, leaving the time to a
    search that follows (:func:`passes.exact.exact_plan`'s wider one, which found the zoo
    U-Net's schedule at 0.7 of eager: polishing instead kept a plan recomputing 10% more).

    The plan in hand as the start: on ``scripts/planner_gap.py``'s 8 random DAGs of 40 ops at
    0.3 of eager (seed 0; 5 s for the solver, ``fit_budget``, a 2-core AMD EPYC VM), 8766 /
    8739 / 9038 FLOPs in all in three runs against 9317 / 8897 without it (one graph 978 ->
    837-918; one 1033-1066 -> 1176, where the solver's own start had found another basin);
    the zoo DenseNet at 0.5 of eager 71.4M -> 47.8-51.3M, where no solve had beaten the plan.
    Polishing both, the plan in one lane and the solver's own start in the other, sharing one
    best, recomputed more in all than polishing the plan alone (9010 / 9004): each got half the
    windows. Now, on two CPUs, each lane polishes a best of its own there (:func:`polish_two_basins`)."""
    started = time.perf_counter()
    deadline = started + (1 - POLISH_SHARE) * time_limit
    relaxation = model.solve(cost, time_limit, relaxed=True)
    if relaxation.x is None:  # infeasible: so is every schedule
        return relaxation
    if cutoff is not None and relaxation.objective > cutoff:  # its bound proves no schedule beats the cutoff
        return Solved("infeasible", None, math.inf, relaxation.objective)
    S = [column for key, column in model.columns.items() if key[0] == "S"]
    found = Incumbent(cutoff)
    if start is not None:  # a schedule in hand (its R and S): the first best, where its rows hold
        found.offer(model.fixed(start).solve(cost, time_limit))

    def whole_set() -> None:
        whole = {c: float(round(value)) for c in S if abs((value := relaxation.x[c]) - round(value)) < 1e-6}
        found.offer(model.fixed(whole).solve(cost, GUIDED_SHARE * seconds_left(deadline), cutoff=found.bar(),
                                             enough=FLOPS_PROVEN))

    def freed(shares: tuple[tuple[float, float], ...], until: float) -> None:
        for fixed, share in freed_neighbourhoods(S, relaxation.x, shares):
            seconds = min(share * time_limit, seconds_left(until))
            if seconds <= 0:
                return
            found.offer(model.fixed(fixed).solve(cost, seconds, cutoff=found.bar(), enough=FLOPS_PROVEN))

    def whole_model(seconds: float) -> Solved:
        full = model.solve(cost, seconds, cutoff=found.bar(), enough=FLOPS_PROVEN)
        found.offer(full)
        return full

    def whole_set_then_model() -> Solved:
        whole_set()
        return whole_model(seconds_left(deadline))

    if lanes() > 1:
        with quiet():  # once around both lanes: each solve's own is nested in it
            full, _ = at_once(whole_set_then_model, lambda: freed(LANE_FREED_AT, deadline))
    else:
        whole_set()
        rest = seconds_left(deadline)  # the whole MILP's, kept for after the smaller sub-MIPs
        freed(FREED_AT, math.inf)
        full = whole_model(rest)
    answer = _answer(relaxation, found.best, full)
    if answer.status in ("optimal", "infeasible"):  # proven: least, or none beats the cutoff
        return answer
    until = started + time_limit
    own = found.best is None or (cutoff is not None and found.best.objective > cutoff)  # none beat the cutoff
    plan_basin = own and start is not None and found.best is not None  # the best is the plan in hand
    if own and not polish_start:
        return answer

    def own_start(seconds: float) -> Solved:
        """Any schedule of the least fixed freed sub-MIP, asked without the cutoff."""
        fixed, _ = next(freed_neighbourhoods(S, relaxation.x, FREED_AT))
        return model.fixed(fixed).solve(cost, seconds, enough=FLOPS_PROVEN)

    if found.best is None:  # a start for the polish, found in time on top of the limit
        begun = time.perf_counter()
        found.offer(own_start(START_SHARE * time_limit))
        until += time.perf_counter() - begun
        if found.best is None:
            return answer
    clock = PolishClock(until, until + POLISH_OVERTIME * time_limit)
    if lanes() > 1 and plan_basin:  # no solve beat the plan in hand: two basins
        polish_two_basins(model, cost, found, clock, lambda: own_start(min(START_SHARE * time_limit, clock.left())))
    elif lanes() > 1:
        with quiet():
            at_once(lambda: polish(model, cost, found, clock, own=own),
                    lambda: polish(model, cost, found, clock, shifted=True, own=own))
    else:
        polish(model, cost, found, clock, own=own)
    return _answer(relaxation, found.best, full)


def polish_two_basins(model: Milp, cost: np.ndarray, found: Incumbent, clock: PolishClock,
                      own_start: Callable[[], Solved]) -> None:
    """Polish ``found``'s best (the plan in hand, which no solve beat) in one lane, on the
    shifted windows, and in the other the schedule ``own_start`` finds (the solver's own,
    without the cutoff), each lane bettering its own best; the better of the two ends in
    ``found``.

    A polish stays in the basin it starts from. One 40-op DAG of ``scripts/planner_gap.py`` at
    0.3 of eager (seed 0, graph 7: 5 s for the solver, two CPUs) polished from the plan in both
    lanes recomputed 1176-1186 FLOPs in six runs; in two basins 1012-1055 in five of nine and
    1186 in four (the solver's start polished no lower than the plan's); the 60 s reference
    solve finds 985. One of seed 1's at 0.5: 224 in three runs, 213-217 in four. The plan's lane
    takes the shifted windows: on the unshifted ones alone it stopped at 1376 on that graph in
    each of six runs, on the shifted ones at 1186, as the two lanes did (one graph: which
    windows suit a basin is not known in general). Of 65 budgets asked of such DAGs (16 and 40
    ops, seeds 0-3) and the zoo graphs, only these two and the zoo MLP at 0.3 (the same plan)
    get here: elsewhere a solve beats the plan first. Stop 82 tried the two starts with one best
    shared by the lanes (:func:`guided_solve`, not kept); here each lane keeps its own."""
    other = Incumbent(None)

    def from_own_start() -> None:
        other.offer(own_start())
        polish(model, cost, other, clock, own=True)

    with quiet():
        at_once(lambda: polish(model, cost, found, clock, shifted=True, own=True), from_own_start)
    if other.best is not None:
        found.offer(other.best)


def _answer(relaxation: Solved, best: Solved | None, full: Solved) -> Solved:
    """The guided solve's answer from the best schedule any solve found and the whole
    MILP's solve, asked to beat what was best when it started: proven least when that
    solve proved no schedule recomputes less (a later find of another lane recomputes no
    less than its cutoff, or it would not have proved that)."""
    if best is None:
        return full
    if full.status in ("optimal", "infeasible"):  # proven: no schedule recomputes less than the best found
        return Solved("optimal", best.x, best.objective, best.objective)
    bounds = [relaxation.objective, *([full.bound] if math.isfinite(full.bound) else [])]  # both proven
    return Solved("time_limit", best.x, best.objective, min(max(bounds), best.objective))


def freed_neighbourhoods(S: list[int], relaxed: np.ndarray,
                         shares: tuple[tuple[float, float], ...] = FREED_AT) -> Iterator[tuple[dict[int, float], float]]:
    """The smaller sub-MIPs :func:`guided_solve` searches besides the one the relaxation sets
    whole, as ``(columns fixed, share of the time limit)``: every ``S`` column the relaxation
    holds at most a threshold of ``shares`` (:data:`FREED_AT`, or :data:`LANE_FREED_AT` in a
    lane of their own) fixed at 0 (nothing held that the relaxation barely holds). Where the
    relaxation is fractional, as at 0.3 of eager, they find schedules the whole-set sub-MIP
    does not; where it is nearly whole they rarely find a better one and may still run to
    their limits (40-op DAGs at 0.7 of eager: the same plans, planning 2.0 -> 2.6 s median).

    Measured on the 13 random DAGs of 40 ops that a plan meets at 0.3 of eager
    (``scripts/planner_gap.py``'s, seeds 0 and 1), ``fit_budget`` with 5 s for the solver: 8%
    less recompute in all, up to 37% less on one graph, 1.5% more on one, in 1.4 s more."""
    for threshold, share in shares:
        yield {column: 0.0 for column in S if relaxed[column] <= threshold}, share
