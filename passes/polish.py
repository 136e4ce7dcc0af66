"""Polishing a schedule of the recompute MILP (:mod:`passes.checkmate`) window by window: the
MILP solved again with every column fixed at the schedule's values but those of a few
consecutive forward values, window after window, each solve asked only for a schedule
recomputing less (a large-neighbourhood search); and the best schedule the solves of one
search share (:class:`Incumbent`), with the clock that says how long the polish goes on.
The search that finds the schedules it starts from is :mod:`passes.guided_solve`'s."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from passes.highs import Milp, Solved

FLOPS_PROVEN = 0.49  # objective gap proving a schedule's FLOPs least: they are whole units, the tie-break
# weighs less than half of one (zoo DenseNets' solves ran to a 10 s limit proving the bytes; now 2.4-9.1 s)
POLISH_WIDTH = 8  # values whose columns one window frees at first; a pass that betters nothing widens it by half
POLISH_SECONDS = 1.0  # the most one window's sub-MIP may take: most are solved (proved) in less. fit_budget at
# 0.3 of eager with 5 s for the solver, recomputed FLOPs in all over planner_gap's 8 random DAGs of 40 ops (3 runs
# each): 0.3 s 9216/8777/9082, 0.6 s 8607/8958/8658, 1.0 s 8544/8682/8630, 2.0 s 8561 (one run); seed 1's graphs
# 5993/5995 at 0.3 s and 0.6 s, 6086/6096 at 1.0 s (one graph 6% more); the zoo MLP (20 ops) recomputes 15
# matmuls at 1.0 s in 5 of 5 runs, 17 at 0.3 s in 5 of 5
POLISH_OVERTIME = 1.0  # of a guided solve's time limit: how long the polish may go on past the limit while it
# still betters the schedule (POLISH_STALL), so that a solve stopped in mid-descent finishes it and one that stalled
# ends on time. The exact solve alone (executable, 5 s) on the 7 random DAGs of 40 ops that a plan meets at 0.3 of
# eager (scripts/planner_gap.py's, seed 0), one run each on a 2-core AMD EPYC VM, recomputed FLOPs in all: 9788
# without overtime (5.3 s a graph), 8784 with it (7.7 s mean, 5.7-10.3 s), 8702 given a plain 10 s (10.3 s).
# fit_budget at 0.3 over all 8: 10433 -> 8916 FLOPs, planning 12.4 -> 14.0 s mean; at 0.5 and 0.7 the same plans
POLISH_STALL = 1.0  # seconds without a better schedule that end the overtime: as long as one window may take
# (POLISH_SECONDS); 2.0 found 8593 FLOPs in 10.0 s mean, as a plain 10 s limit does


def polish(model: Milp, cost: np.ndarray, found: Incumbent, clock: PolishClock, shifted: bool = False,
           own: bool = False) -> None:
    """Better ``found``'s best schedule while ``clock`` says so: the MILP solved again with every
    ``R`` and ``S`` column fixed at that schedule's values but those of a window of
    consecutive forward values (:func:`value_windows`), window after window, each solve
    asked only for a schedule recomputing less (a large-neighbourhood search). Once a whole
    pass of windows proves nothing better in any, the windows widen by half. ``shifted``: the
    windows start a quarter of a window later (the second lane's). ``own``: each window is
    asked to beat the best schedule only, not the guided solve's cutoff as well: the start
    was found above the cutoff (:func:`passes.guided_solve.guided_solve`), and the windows better it a little at
    a time; from any other start they are asked to beat both, as before.

    Branch and bound on the whole model improves a schedule found at a tight budget slowly:
    HiGHS's proven bound stays far below it (a 40-op DAG at 0.3 of eager: a schedule of 2001
    FLOPs after 2 s, 1488 after 5 s, 1182 after 20 s). A window's sub-MIP, a few hundred
    columns free, is mostly solved in a fraction of a second (each may take
    :data:`POLISH_SECONDS`), and where a value is kept or made again is decided for a few
    values at a time, with everything else as the schedule has it: from the 2 s schedule,
    3 s of windows of 8 values found one of 1044 FLOPs (one run)."""
    width = POLISH_WIDTH
    fixable = [column for key, column in model.columns.items() if key[0] in ("R", "S")]
    by_value = value_columns(model, cost)
    while clock.going(found) and found.best is not None:
        windows = value_windows(by_value, width, width // 4 if shifted else 0)
        if len(windows) < 2:  # one window frees the whole model: nothing smaller to solve
            return
        _polish_pass(model, cost, found, clock, windows, fixable, own)
        width += width // 2


def _polish_pass(model: Milp, cost: np.ndarray, found: Incumbent, clock: PolishClock, windows: list[list[int]],
                 fixable: list[int], own: bool = False) -> None:
    """Windows solved in turn, around and around, until every one in a row proves that
    nothing in it beats the best schedule (or ``clock`` ends the polish); ``fixable``: the
    ``R`` and ``S`` columns, those a window does not free fixed."""
    proven_in_a_row, turn = 0, 0
    while proven_in_a_row < len(windows) and clock.going(found):
        best = found.best
        if best is None or best.x is None:  # (polish starts from a schedule: never so)
            return
        free = set(windows[turn % len(windows)])
        held = [column for column in fixable if column not in free]
        fixed = dict(zip(held, np.round(best.x[held]).tolist(), strict=True))
        sub = model.fixed(fixed).solve(cost, min(POLISH_SECONDS, clock.left()), cutoff=found.bar(own),
                                       enough=FLOPS_PROVEN)
        found.offer(sub)
        proven = found.best is best and sub.status in ("optimal", "infeasible")
        proven_in_a_row = proven_in_a_row + 1 if proven else 0
        turn += 1


def value_columns(model: Milp, cost: np.ndarray) -> list[list[int]]:
    """The ``R`` and ``S`` columns of each forward value (those whose ``R`` costs something,
    and the extras among them), in the forward's order: what :func:`value_windows` frees."""
    forward = 1 + max((key[2] for key, column in model.columns.items() if key[0] == "R" and cost[column] > 0),
                      default=-1)
    by_value: list[list[int]] = [[] for _ in range(forward)]
    for key, column in model.columns.items():
        if key[0] in ("R", "S") and key[2] < forward:
            by_value[key[2]].append(column)
    return by_value


def value_windows(by_value: list[list[int]], width: int, offset: int = 0) -> list[list[int]]:
    """The columns of ``width`` consecutive forward values (``by_value``: :func:`value_columns`),
    one list a window, windows half a window apart from value ``offset`` on: what
    :func:`polish` frees at a time.

    Consecutive values, not a window of stages: whether a value is kept from forward is its
    ``S`` columns over every stage from its op to its last use, so freeing a window of
    stages cannot drop or keep any value (tried: from the same 2 s schedule, 3 s of
    stage windows found 1468 FLOPs, value windows 1044)."""
    step = max(width // 2, 1)
    return [[column for columns in by_value[start:start + width] for column in columns]
            for start in range(offset, max(len(by_value) - step, offset + 1), step)]


class Incumbent:
    """The schedule recomputing least that any solve of one guided solve has found, shared
    by its lanes, and the cutoff the next solve is asked to beat."""

    def __init__(self, cutoff: float | None) -> None:
        self.cutoff = cutoff
        self.best: Solved | None = None
        self.bettered_at = time.perf_counter()  # when best last changed (or the search began)
        self._lock = threading.Lock()

    def offer(self, found: Solved) -> None:
        """Keep ``found`` if it recomputes less than the best so far."""
        with self._lock:
            better = _better(self.best, found)
            if better is not self.best:
                self.best, self.bettered_at = better, time.perf_counter()

    def stalled(self, seconds: float) -> bool:
        """Whether the last ``seconds`` brought no better schedule."""
        return time.perf_counter() - self.bettered_at >= seconds

    def bar(self, own: bool = False) -> float | None:
        """The cutoff for the next solve: below the best so far and the caller's cutoff;
        ``own``: below the best so far only."""
        with self._lock:
            cutoff = None if own else self.cutoff
            return cutoff if self.best is None else _below(self.best, cutoff)


@dataclass(frozen=True)
class PolishClock:
    """How long a polish goes on: until ``deadline``, then until ``overtime_end`` (not before
    ``deadline``) at most while its search still betters the schedule (:data:`POLISH_OVERTIME`,
    :data:`POLISH_STALL`).

    >>> import math
    >>> found = Incumbent(None)
    >>> PolishClock(0.0, math.inf).going(found)  # past its deadline, and the search just began
    True
    >>> PolishClock(0.0, 0.0).going(found)  # no overtime
    False
    >>> found.bettered_at -= POLISH_STALL  # nothing better for that long: the overtime ends
    >>> PolishClock(0.0, math.inf).going(found), PolishClock(math.inf, math.inf).going(found)
    (False, True)
    """

    deadline: float
    overtime_end: float

    def going(self, found: Incumbent) -> bool:
        """Whether to solve another window now, ``found`` the search's best so far."""
        now = time.perf_counter()
        return now < self.deadline or (now < self.overtime_end and not found.stalled(POLISH_STALL))

    def left(self) -> float:
        """The most a window begun now may take."""
        return seconds_left(self.overtime_end)


def seconds_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.perf_counter``), none once it has passed."""
    return max(deadline - time.perf_counter(), 0.0)


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
