"""What a refused budget names: the least peak a plan reaches, looked for below the plans
planned for the budget by bisecting the budget they are planned for.

A plan family stops as soon as it has a plan under the budget it is asked for, so what it
reaches depends on that budget, and a budget none of it meets gives nothing to name. Both
looks below a refusal's plans bisect the same way (:func:`lowest_between`): the LP
relaxation's rounding (:func:`passes.relaxed.lowest_relaxed`) and the whole planner without
the exact solver (:func:`lower_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import networkx as nx

from passes.budget import BudgetError, unreachable
from passes.checkmate import MAX_OPS
from passes.floor import Floor
from passes.graph_facts import op_nodes
from passes.plan import Plan, Progress
from passes.units import format_bytes, unit_of

Probe = Callable[[float], "tuple[Plan | None, bool] | None"]
"""Plans for a budget: the plan of least peak found (``None``: none) and whether it meets
the budget; ``None`` to stop the bisection (a solve that says nothing of the budget)."""


def lowest_between(low: float, high: float, steps: int, probe: Probe) -> Plan | None:
    """The plan of least peak under ``high`` that ``probe`` finds for budgets bisected between
    ``low`` (known unreachable) and ``high`` (a peak in hand) over ``steps`` probes, or
    ``None``. A met budget's plan becomes the new ``high``, an unmet budget the new ``low``
    (its plans may still lie under ``high``); the bisection ends within 1% of ``high``.

    >>> from types import SimpleNamespace as Plan
    >>> met_from_40 = lambda budget: (Plan(peak_bytes=budget), True) if budget >= 40 else (None, False)
    >>> lowest_between(0, 100, 4, met_from_40).peak_bytes  # 50 met, 25 and 37.5 not, 43.75 met
    43.75
    """
    best: Plan | None = None
    for _ in range(steps):
        if high - low < 0.01 * high:
            break
        middle = (low + high) / 2
        answer = probe(middle)
        if answer is None:
            break
        found, met = answer
        if not met:
            low = middle
        if found is not None and found.peak_bytes < high:
            best, high = found, found.peak_bytes
    return best


REFUSAL_STEPS = (2, 4)  # budgets a refusal plans for between the refused one and the least peak planned: on
# graphs up to the relaxation's MAX_OPS (passes.checkmate), where it (and up to 40 ops the floor solves) looked below
# already, and above. 50- and 60-op random DAGs at 0.2 of eager: 0-8% lower peaks named with 2 steps or 4 alike,
# the refusals 9-21 s with 2, 13-22 s with 4, 6-10 s with none (stop 91)


def lower_refusal(graph: nx.DiGraph, refused: BudgetError, plan_for: Callable[[int], Plan],
                  steps: int | None = None, progress: Progress | None = None) -> BudgetError | Plan:
    """``refused`` naming the least peak a plan reaches, looked for with ``plan_for`` (the
    planner without the exact solver, raising :class:`BudgetError` as it does) at budgets
    bisected between the refused budget (or the solver's proven bound) and the least peak it
    names, over ``steps`` plannings (:data:`REFUSAL_STEPS`); or the plan found, should one fit
    the refused budget after all.

    On random DAGs of 100 and 200 ops refused at 0.1 of eager, the plans for the budget
    peaked at 0.25-0.36x of eager, but budgets 15% below that were met (by dropping values
    on top of a flat plan). A budget at the peak named is met, as before. ``progress`` is told
    each planning done, of ``steps`` (a refusal of a 60-op graph plans for up to 20 s more)."""
    budget_bytes = refused.budget_bytes
    if refused.smallest_plan is None or budget_bytes is None:
        return refused
    if steps is None:
        steps = REFUSAL_STEPS[len(op_nodes(graph)) > MAX_OPS]

    report = progress or (lambda done, total: None)
    planned = 0

    def probe(budget: float) -> tuple[Plan | None, bool]:
        nonlocal planned
        try:
            return plan_for(int(budget)), True
        except BudgetError as nested:  # its plans, made for a lower budget, may still reach lower
            return nested.smallest_plan, False
        finally:
            planned += 1
            report(planned, steps)

    report(0, steps)
    best = lowest_between(max(budget_bytes, refused.floor_bound_bytes or 0), refused.smallest_peak_bytes, steps, probe)
    if best is None:
        return refused
    if best.peak_bytes <= budget_bytes:
        return _fits_after_all(best, budget_bytes)
    floor = (None if refused.true_floor_bytes is None
             else Floor(refused.true_floor_bytes, refused.floor_bound_bytes or 0).below(best.peak_bytes))
    return unreachable(graph, budget_bytes, [best], *((floor.peak_bytes, floor.lower_bound_bytes) if floor else ()))


def _fits_after_all(plan: Plan, budget_bytes: int) -> Plan:
    """``plan``, found while planning for a budget above the refused ``budget_bytes``, which it
    fits after all: its first note says so (the notes after it say why it won where it was
    planned)."""
    unit = unit_of(plan.eager_peak_bytes)
    note = (f"{plan.strategy}: planned for {format_bytes(budget_bytes, unit)}, no plan fitted; this one, planned "
            f"while looking below that refusal, peaks at {format_bytes(plan.peak_bytes, unit)}")
    return replace(plan, notes=(note, *plan.notes))
