"""Plans rounded from the LP relaxation of the exact schedule (Checkmate's approach).

The exact optimum (:mod:`passes.checkmate`) keeps, at the start of backward, a set of
values that is rarely a prefix cut or "every matmul": it holds what is cheap to hold and dear
to make again, anywhere in the graph, and makes the rest again just before backward needs
it. One selective segment over the whole graph run by saved-tensor hooks (:mod:`passes.hooked`)
executes such a set: it keeps the values named, remakes each group of the others when
backward first needs one, and lets every value go after its last use. Which set is the
question; the MILP answers it in seconds on 40 ops, its LP relaxation in a fraction of one.

:func:`relaxed_plan` rounds the relaxation's holds (:func:`passes.checkmate.relaxed_holds`)
at a few thresholds, brings each rounded plan to the budget by giving up or adding kept
values (:func:`passes.keeps.without_keeps`, :func:`passes.keeps.with_keeps`) and returns the
cheapest that fits. On the 40-op random DAGs of ``scripts/planner_gap.py`` at 0.7 of eager
it is where the exact optimum is on most graphs. Where backward must remake only part of a
group to fit (tighter budgets) whole-group remakes overshoot; a rounded set that does not fit
is tried again with each dropped value made at every use from its own recipe
(``remake_each_use``), as the exact schedule makes values more than once.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from passes.checkmate import MAX_OPS, relaxed_holds
from passes.graph_facts import op_nodes
from passes.hooked import keeps_by_hooks
from passes.keeps import keepable, keeping, whole_graph, with_keeps, without_keeps
from passes.plan import Plan, plan_of_segments
from passes.segments import Segment

RELAXED_MAX_OPS = MAX_OPS
THRESHOLDS = (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95)  # a value held at least this much is kept


def rounded_keeps(graph: nx.DiGraph, holds: dict[str, float]) -> list[set[str]]:
    """The distinct sets of keepable values held at least each of :data:`THRESHOLDS`."""
    found: list[set[str]] = []
    for threshold in THRESHOLDS:
        kept = {name for name, share in holds.items() if share >= threshold and keepable(graph, name)}
        if kept and kept not in found:
            found.append(kept)
    return found


def fitted(graph: nx.DiGraph, segments: tuple[Segment, ...], budget_bytes: float) -> Plan | None:
    """The plan of ``segments`` brought under ``budget_bytes`` by giving up kept values, or
    its spare memory filled with more of them; ``None`` when it cannot be brought under."""
    plan = plan_of_segments(graph, "relaxed", segments)
    if plan.peak_bytes > budget_bytes:
        return without_keeps(graph, plan, budget_bytes)
    return with_keeps(graph, plan, budget_bytes)


def _any_hooked(graph: nx.DiGraph, segments: tuple[Segment, ...]) -> bool:
    """Whether any of ``segments`` runs by saved-tensor hooks. Asked first of the whole graph
    keeping every value it may: false on graphs costed without inputs, drawing random
    numbers everywhere, or planned for :func:`graphckpt.enable`, and then the relaxation is
    not solved at all."""
    return any(segment.recompute and keeps_by_hooks(graph, segment) for segment in segments)


def relaxed_plan(graph: nx.DiGraph, budget_bytes: float) -> Plan | None:
    """The cheapest plan fitting ``budget_bytes`` among the relaxation's rounded keep sets,
    each kept by one hooked segment over the graph; ``None`` on graphs over
    :data:`RELAXED_MAX_OPS` ops, where no segment would run by hooks, or when none fits."""
    if len(op_nodes(graph)) > RELAXED_MAX_OPS:
        return None
    whole = whole_graph(graph)
    if not _any_hooked(graph, keeping(whole, {name for name in op_nodes(graph) if keepable(graph, name)})):
        return None
    holds = relaxed_holds(graph, budget_bytes)
    if holds is None:
        return None
    best: Plan | None = None
    for kept in rounded_keeps(graph, holds):
        segments = keeping(whole, kept)
        if not _any_hooked(graph, segments):
            continue
        plan = fitted(graph, segments, budget_bytes)
        if plan is None or plan.peak_bytes > budget_bytes:  # make values again at each use instead
            plan = fitted(graph, tuple(replace(s, remake_each_use=True) for s in segments), budget_bytes)
        if plan is not None and plan.peak_bytes <= budget_bytes and (best is None or plan.cost_key < best.cost_key):
            best = plan
    if best is None:
        return None
    each = " (each dropped value made again at every use)" if any(s.remake_each_use for s in best.segments) else ""
    note = (f"relaxed: one segment run by saved-tensor hooks keeping {sum(len(s.saved_inside) for s in best.segments)} "
            f"values{each}, rounded from the LP relaxation of the exact schedule")
    return replace(best, strategy="relaxed", notes=(note, *best.notes))
