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

from typing import Protocol

import networkx as nx

from passes.budget import Budget, parse_budget
from passes.budget_search import fit_budget, optimal_plan
from passes.heuristics import articulation_plan, auto_plan, blocks_plan, mincut_plan, sqrt_plan
from passes.plan import Plan, Progress
from passes.simulate import eager_peak


class Strategy(Protocol):
    """A checkpointing strategy: the plan it chooses for ``graph``. ``segments`` overrides
    the segment count where a strategy has one (the √n heuristics); ``progress`` hears how
    far a slow strategy is, ``(done, total)``."""

    def __call__(self, graph: nx.DiGraph, *, segments: int | None = None,
                 progress: Progress | None = None) -> Plan: ...


STRATEGIES: dict[str, Strategy] = {
    "sqrt": sqrt_plan,
    "articulation": articulation_plan,
    "mincut": mincut_plan,
    "blocks": blocks_plan,
    "auto": auto_plan,
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
                progress: Progress | None = None) -> Plan:
    """Run the named strategy; an unknown name raises ``ValueError`` listing the known ones."""
    return STRATEGIES[check_strategy(strategy)](graph, segments=segments, progress=progress)


def plan_graph(graph: nx.DiGraph, strategy: str = "auto", segments: int | None = None,
               budget: Budget | None = None, progress: Progress | None = None) -> Plan:
    """The plan for a cost graph: ``strategy``, or the optimal pass within ``budget`` (a
    fraction of this graph's eager peak, bytes, or a size string, :func:`parse_budget`).
    Raises ``ValueError`` for options :func:`check_request` refuses, and
    :class:`passes.budget.BudgetError` when no plan fits the budget."""
    check_request(strategy, segments, budget)
    if budget is not None:
        return fit_budget(graph, parse_budget(budget, eager_peak(graph)), progress)
    return STRATEGIES[strategy](graph, segments=segments, progress=progress)
