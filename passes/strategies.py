"""Every strategy behind one interface, and the one way in: a name, or a memory budget.

A :class:`Strategy` turns a cost graph into a :class:`passes.plan.Plan`; :data:`STRATEGIES`
holds each one by name:

* ``sqrt``, ``articulation``, ``mincut``, ``blocks``, ``auto``: the heuristics of
  :mod:`passes.heuristics` (``blocks``: per-block checkpointing from the module tree);
* ``optimal``: least recompute at auto's peak, nested segments allowed
  (:func:`passes.budget_search.optimal_plan`).

:func:`plan_graph` is what the torch side calls: a strategy by name, or with a ``budget``
the optimal pass within it (:func:`passes.budget_search.fit_budget`); both are checked by
:func:`check_request` first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import networkx as nx

from passes.budget import Budget, parse_budget
from passes.budget_search import fit_budget, optimal_plan
from passes.exact import EXACT_TIME_LIMIT
from passes.heuristics import articulation_plan, auto_plan, blocks_plan, mincut_plan, sqrt_plan
from passes.plan import Plan, Progress
from passes.simulate import eager_peak


class Strategy(Protocol):
    """A checkpointing strategy: the plan it chooses for ``graph``. ``segments`` overrides
    the segment count where a strategy has one (the √n heuristics); ``progress`` hears how
    far a slow strategy is, ``(done, total)``; ``exact_seconds`` is how long it may spend in
    the exact solver (:mod:`passes.exact`; 0: never), where it runs one."""

    def __call__(self, graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None,
                 exact_seconds: float = EXACT_TIME_LIMIT) -> Plan: ...


def _heuristic(plan: Callable[..., Plan]) -> Strategy:
    """``plan`` (a heuristic of :mod:`passes.heuristics`) as a :class:`Strategy`: it runs no
    solver, so ``exact_seconds`` does not concern it."""
    @functools.wraps(plan)
    def strategy(graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None,
                 exact_seconds: float = EXACT_TIME_LIMIT) -> Plan:
        return plan(graph, segments=segments, progress=progress)
    return strategy


STRATEGIES: dict[str, Strategy] = {
    "sqrt": _heuristic(sqrt_plan),
    "articulation": _heuristic(articulation_plan),
    "mincut": _heuristic(mincut_plan),
    "blocks": _heuristic(blocks_plan),
    "auto": _heuristic(auto_plan),
    "optimal": optimal_plan,
}
BUDGET_STRATEGIES = ("auto", "optimal")  # a budget runs the optimal pass; these names allow one


def check_strategy(name: str) -> str:
    """``name`` if :data:`STRATEGIES` has it, else ``ValueError`` listing the known ones."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    return name


def check_request(strategy: str = "auto", segments: int | None = None, budget: Budget | None = None) -> None:
    """Refuse an unknown strategy, a budget given with a strategy or segment count, and an
    unreadable budget, before any work is done."""
    check_strategy(strategy)
    if budget is not None and (strategy not in BUDGET_STRATEGIES or segments is not None):
        raise ValueError("budget= picks the segments itself with the optimal pass; leave strategy='auto' "
                         "(or 'optimal') and segments=None, or drop the budget")
    if budget is not None:
        parse_budget(budget, 1)


def choose_plan(graph: nx.DiGraph, strategy: str = "auto", segments: int | None = None, *,
                progress: Progress | None = None, exact_seconds: float = EXACT_TIME_LIMIT) -> Plan:
    """Run the named strategy; an unknown name raises ``ValueError`` listing the known ones."""
    return STRATEGIES[check_strategy(strategy)](graph, segments=segments, progress=progress,
                                                exact_seconds=exact_seconds)


def plan_graph(graph: nx.DiGraph, strategy: str = "auto", segments: int | None = None,
               budget: Budget | None = None, progress: Progress | None = None,
               exact_seconds: float = EXACT_TIME_LIMIT) -> Plan:
    """The plan for a cost graph: ``strategy``, or the optimal pass within ``budget`` (a
    fraction of this graph's eager peak, bytes, or a size string, :func:`parse_budget`);
    either may spend up to ``exact_seconds`` in the exact solver (0: never).
    Raises ``ValueError`` for options :func:`check_request` refuses, and
    :class:`passes.budget.BudgetError` when no plan fits the budget."""
    check_request(strategy, segments, budget)
    if budget is not None:
        return fit_budget(graph, parse_budget(budget, eager_peak(graph)), progress, exact_seconds)
    return choose_plan(graph, strategy, segments, progress=progress, exact_seconds=exact_seconds)
