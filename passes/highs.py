"""A MILP by keyed columns and sparse rows, solved by HiGHS (``highspy``) in silence: the
one place :mod:`passes.checkmate` and :mod:`passes.floor` reach the solver.

Columns are named by tuples (``("R", t, i)``); a row's terms name columns, and a term whose
column was never made is a zero, so a formulation can write its rows without asking which
variables exist. HiGHS lets go of Python's lock while it solves: :func:`at_once` runs two
solves side by side where :func:`lanes` says the process has two CPUs.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import highspy
import numpy as np

HEURISTIC_EFFORT = 0.3
"""The share of a MIP solve HiGHS gives its primal heuristics (RINS, RENS, feasibility jump;
its default is 0.05). At tight budgets the hard part of a recompute MILP is finding any
schedule at all. ``fit_budget`` on 16 random DAGs of 40 ops at 0.3 of eager, with its 5 s
for the solver: 12% less recompute in all, 41% and 14% less on two graphs, the same plans
on the rest, in the same planning time; the same or better at 0.5 and 0.7 of eager and on
the zoo graphs at 0.3-0.7 (``scripts/planner_gap.py``'s graphs). A solve that finds its first
schedule near its time limit still finds it or not with the machine's speed."""


_QUIET_LOCK = threading.Lock()
_quiet_depth = 0
_saved_fds: list[int] = []


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence what HiGHS's C++ code prints to the process's stdout and stderr while it
    solves (on this model its MIP heuristics print debug lines), so a BudgetError or a
    budget plan does not come with a screen of solver chatter: every solve runs under it.
    Nested, and across threads (the lanes of :func:`passes.guided_solve.guided_solve`), the
    first to enter silences and the last to leave restores."""
    global _quiet_depth
    with _QUIET_LOCK:
        if _quiet_depth == 0:
            sys.stdout.flush()
            sys.stderr.flush()
            _saved_fds[:] = [os.dup(1), os.dup(2)]
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.close(devnull)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                os.dup2(_saved_fds[0], 1)
                os.dup2(_saved_fds[1], 2)
                for fd in _saved_fds:
                    os.close(fd)


First = TypeVar("First")
Second = TypeVar("Second")


def lanes() -> int:
    """How many solves to run at once: 2 where this process may run on two CPUs or more,
    else 1. HiGHS lets go of Python's lock while it solves, so two solves in two threads
    run side by side."""
    available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return 2 if len(available) >= 2 else 1


def at_once(first: Callable[[], First], second: Callable[[], Second]) -> tuple[First, Second]:
    """``first()`` and ``second()``, the second in another thread meanwhile (its error
    raised here): two solves, or two chains of them, side by side (:func:`lanes`)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphckpt-solve") as pool:
        other = pool.submit(second)
        answer = first()
        return answer, other.result()


class Milp:
    """MILP columns by key and sparse rows; terms of keys never made a column are zeros."""

    def __init__(self) -> None:
        self.columns: dict[tuple, int] = {}
        self.bounds: list[tuple[float, float, int]] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self._rows_lp = RowsLp()  # the rows as HiGHS takes them, shared with fixed copies

    def var(self, key: tuple, lower: float, upper: float, integer: bool) -> None:
        self.columns[key] = len(self.bounds)
        self.bounds.append((lower, upper, int(integer)))

    def row(self, terms: list[tuple[tuple, float]], lower: float, upper: float) -> None:
        coefficients: dict[int, float] = {}
        for key, value in terms:
            if key in self.columns:
                coefficients[self.columns[key]] = coefficients.get(self.columns[key], 0.0) + value
        self.rows.append((coefficients, lower, upper))

    def fixed(self, values: dict[int, float]) -> Milp:
        """This model with each column of ``values`` fixed at its value (rows shared)."""
        copy = Milp()
        bounds = list(self.bounds)
        for column, value in values.items():
            bounds[column] = (value, value, bounds[column][2])
        copy.columns, copy.rows, copy.bounds, copy._rows_lp = self.columns, self.rows, bounds, self._rows_lp
        return copy

    def solve(self, cost: np.ndarray, time_limit: float, relaxed: bool = False,
              cutoff: float | None = None, enough: float = 0.0) -> Solved:
        """HiGHS's solution; ``relaxed``: of the LP relaxation (no variable integer);
        ``cutoff``: HiGHS prunes every branch whose bound is above it (a plan in hand's
        cost) and proves quickly when no solution is below it (a 40-op graph at 0.5 of
        eager: 0.4-0.8 s where the full solve took 4-5 s); it may still answer with one
        above it that it found first, which callers compare themselves. ``enough``: a
        solution within that much of the proven bound is optimal enough (HiGHS's absolute gap)."""
        lower, upper, integer = np.array(self.bounds, dtype=float).reshape(-1, 3).T
        integrality = [] if relaxed else [_VAR_TYPES[flag] for flag in integer.astype(bool).tolist()]
        with quiet():  # its banner, and MIP heuristics' debug lines, come from C++
            solver = highspy.Highs()
            solver.setOptionValue("output_flag", False)
            solver.setOptionValue("time_limit", float(time_limit))
            solver.setOptionValue("mip_rel_gap", 1e-9)
            solver.setOptionValue("mip_abs_gap", float(enough))
            solver.setOptionValue("mip_heuristic_effort", HEURISTIC_EFFORT)
            if cutoff is not None and not relaxed:
                solver.setOptionValue("objective_bound", float(cutoff))
            self._rows_lp.pass_model(solver, self.rows, np.asarray(cost, dtype=float), lower, upper, integrality)
            solver.run()
        return _solved(solver)


_VAR_TYPES = {False: highspy.HighsVarType.kContinuous, True: highspy.HighsVarType.kInteger}


class RowsLp:
    """A model's rows as one ``HighsLp`` (the row-wise matrix and the row bounds), made at
    its first solve and given to every later one with that solve's columns: a guided solve
    (:mod:`passes.guided_solve`) solves the same rows dozens of times with other column
    bounds, and converting them took about 45 ms a solve on a 40-op graph (33k rows, 78k
    terms), a tenth of a polish window's solve, with Python's lock held against the other
    lane. Rows are only ever appended: a model that grew since is converted again. Its lanes
    share it, one solve at a time between setting its columns and HiGHS copying it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lp: highspy.HighsLp | None = None
        self._rows = -1

    def pass_model(self, solver: highspy.Highs, rows: list[tuple[dict[int, float], float, float]],
                   cost: np.ndarray, lower: np.ndarray, upper: np.ndarray,
                   integrality: list[highspy.HighsVarType]) -> None:
        """Give ``solver`` the model of ``rows`` with these columns (``integrality`` empty: an LP)."""
        with self._lock:
            if self._lp is None or self._rows != len(rows):
                self._lp, self._rows = _rows_lp(rows), len(rows)
            lp = self._lp
            lp.num_col_ = len(cost)
            lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, lower, upper
            lp.integrality_ = integrality
            solver.passModel(lp)  # a copy: the next solve may set other columns at once


def _rows_lp(rows: list[tuple[dict[int, float], float, float]]) -> highspy.HighsLp:
    """A ``HighsLp`` holding ``rows`` (row-wise), its columns still to set."""
    lp = highspy.HighsLp()
    lp.num_row_ = len(rows)
    lp.row_lower_ = np.array([row[1] for row in rows], dtype=float)
    lp.row_upper_ = np.array([row[2] for row in rows], dtype=float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.cumsum([0, *(len(terms) for terms, _, _ in rows)], dtype=np.int32)
    lp.a_matrix_.index_ = np.array([c for terms, _, _ in rows for c in terms], dtype=np.int32)
    lp.a_matrix_.value_ = np.array([v for terms, _, _ in rows for v in terms.values()], dtype=float)
    return lp


@dataclass(frozen=True)
class Solved:
    """What a HiGHS solve found: ``status`` ``"optimal"``, ``"infeasible"`` (no solution;
    with a cutoff, none below it), ``"time_limit"`` or HiGHS's own word for another end;
    ``x`` the best solution (``None`` when none was found), ``objective`` its value and
    ``bound`` the proven lower bound on the optimum (a MIP's; the objective for an LP)."""

    status: str
    x: np.ndarray | None
    objective: float
    bound: float


def _solved(solver: highspy.Highs) -> Solved:
    status = solver.getModelStatus()
    info = solver.getInfo()
    found = info.primal_solution_status == 2  # kSolutionStatusFeasible
    words = {highspy.HighsModelStatus.kOptimal: "optimal", highspy.HighsModelStatus.kInfeasible: "infeasible",
             highspy.HighsModelStatus.kTimeLimit: "time_limit"}
    word = words.get(status, solver.modelStatusToString(status))
    x = np.array(solver.getSolution().col_value) if found else None
    objective = info.objective_function_value if found else math.inf
    bound = info.mip_dual_bound if info.mip_node_count >= 0 and math.isfinite(info.mip_dual_bound) else objective
    return Solved(word, x, objective, bound if word != "optimal" else objective)
