"""The heuristic strategies: few segments placed by rules of thumb, fast on any graph.

* :func:`sqrt_plan` — Chen et al. 2016: about √n segments of equal bytes, cut wherever
  the execution order allows.
* :func:`articulation_plan` — boundaries only at articulation points (one value every
  input-to-output path goes through), chosen √n-style; falls back to min-cut when a graph
  has too few (U-Net skips, dense blocks).
* :func:`mincut_plan` — at each balanced position, the minimum-bytes vertex cut in the
  window around it, so a boundary may be several tensors.
* :func:`blocks_plan` — per-block checkpointing from the module tree, as
  ``gradient_checkpointing_enable()`` does (:mod:`passes.blocks`).
* :func:`auto_plan` — runs sqrt, articulation and mincut and keeps the lowest simulated peak.

Each ``*_candidate`` function returns segments not yet simulated (the budget search prices
many of them, :mod:`passes.budget_search`); each ``*_plan`` function is a
:class:`passes.strategies.Strategy` of the registry there, next to ``optimal``.

Every segment except the last is recomputed: the last one's backward runs right after
forward, so recomputing it would save nothing.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace
from weakref import WeakKeyDictionary

import networkx as nx

from passes.blocks import block_segments
from passes.cuts import (
    INF,
    Frontiers,
    articulation_points,
    balanced_targets,
    min_cut_between,
    nearest_positions,
    op_layout,
    prefix_costs,
)
from passes.peak_queries import peak_exceeds
from passes.plan import Candidate, Plan, Progress, from_positions, plan_of_segments, simulated
from passes.segments import make_segments, validate_plan
from passes.simulate import eager_segments


def sqrt_candidate(graph: nx.DiGraph, segments: int | None = None) -> Candidate:
    """About √n segments balanced by bytes, each boundary at an allowed prefix cut."""
    layout = op_layout(graph)
    count = segments or layout.segment_count
    costs = prefix_costs(graph)
    allowed = [i for i, cost in enumerate(costs[:-1]) if cost < INF]
    positions = nearest_positions(layout.cumulative, allowed, balanced_targets(layout.weights, count))
    return from_positions(graph, "sqrt", positions)


def articulation_candidate(graph: nx.DiGraph, segments: int | None = None) -> Candidate:
    """√n-style boundaries chosen among articulation points; min-cut when there are none."""
    layout = op_layout(graph)
    ops, position = layout.ops, layout.position
    count = segments or layout.segment_count
    costs = prefix_costs(graph)
    candidates = [position[n] for n in articulation_points(graph)
                  if position[n] < len(ops) - 1 and costs[position[n]] < INF]
    if len(candidates) < min(count - 1, 2):
        fallback = mincut_candidate(graph, segments)
        note = (f"articulation: only {len(candidates)} articulation point(s); "
                "used min-cut boundaries instead")
        return replace(fallback, notes=(note, *fallback.notes))
    targets = balanced_targets(layout.weights, count)
    return from_positions(graph, "articulation", nearest_positions(layout.cumulative, candidates, targets))


_MINCUTS: WeakKeyDictionary[nx.DiGraph, dict[tuple[int, int | None], Candidate]] = WeakKeyDictionary()


def mincut_candidate(graph: nx.DiGraph, segments: int | None = None) -> Candidate:
    """Minimum-bytes vertex cuts, one per window between balanced positions; found once per
    cost graph and segment count (a flow per window, the slowest heuristic, and articulation
    falls back to it on graphs without articulation points)."""
    found = _MINCUTS.setdefault(graph, {})
    key = (len(graph), segments)  # like passes.graph_facts.per_graph: a graph still gaining nodes is cut again
    if key not in found:
        found[key] = _mincut_candidate(graph, segments)
    return found[key]


def _mincut_candidate(graph: nx.DiGraph, segments: int | None) -> Candidate:
    """:func:`mincut_candidate`, not memoised."""
    layout = op_layout(graph)
    ops, position, last = layout.ops, layout.position, layout.last
    count = segments or layout.segment_count
    marks = nearest_positions(layout.cumulative, list(range(len(ops))), balanced_targets(layout.weights, count))
    reach = max(1, len(ops) // (4 * count))
    cuts, notes, previous_high = [], [], 0
    frontiers = Frontiers(position, last)
    for mark in marks:
        low, high = max(previous_high, mark - reach + 1), min(mark + reach + 1, len(ops) - 1)
        if high <= low:
            continue
        previous_high = high
        found = min_cut_between(graph, ops, position, last, low, high, mark, frontiers.at(low), layout.keep)
        if found is None:
            notes.append(f"mincut: no allowed boundary between {ops[low]} and {ops[high - 1]}")
            continue
        cuts.append((low, found[1]))
    return Candidate("mincut", make_segments(graph, groups_from_windows(ops, cuts)), tuple(notes))


def groups_from_windows(ops: list[str], cuts: list[tuple[int, set[str]]]) -> list[tuple[list[str], bool]]:
    """Segments ``(nodes, recompute)`` from the nested before-sets ``ops[:low] | found`` of
    ``cuts`` (windows in increasing order, ``found`` inside ``ops[low:high]``), in one pass:
    an op belongs to the cut whose ``found`` holds it, else to the first cut starting after
    it. Building every before-set made the min-cut heuristic grow as n^1.5."""
    lows = [low for low, _ in cuts]
    found_in = {name: index for index, (_, found) in enumerate(cuts) for name in found}
    groups: list[list[str]] = [[] for _ in range(len(cuts) + 1)]
    for index, name in enumerate(ops):
        groups[found_in.get(name, bisect_right(lows, index))].append(name)
    return [(group, True) for group in groups[:-1]] + [(groups[-1], False)]


def blocks_candidate(graph: nx.DiGraph) -> Candidate | None:
    """Every block of the module tree recomputed (:func:`passes.blocks.block_segments`);
    ``None`` when the graph names no blocks."""
    found = block_segments(graph)
    return None if found is None else Candidate("blocks", found)


def no_worse_than_eager(graph: nx.DiGraph, plan: Plan) -> Plan:
    """``plan``, or eager execution when ``plan`` would peak higher than doing nothing
    (tiny segments whose kept boundaries outweigh what they free): a strategy never hands
    back a plan worse than no checkpointing. The notes say what happened. A graph costed
    without example inputs counts nodes, not bytes, and keeps the strategy's plan."""
    if plan.peak_bytes <= plan.eager_peak_bytes or not graph.graph.get("measured", False):
        return plan
    ratio = plan.peak_bytes / max(plan.eager_peak_bytes, 1)
    note = (f"{plan.strategy}: its plan simulated {ratio:.2f}x eager's peak, above doing nothing; "
            "kept eager execution (try strategy='optimal' or a budget)")
    return plan_of_segments(graph, plan.strategy, eager_segments(graph), (*plan.notes, note))


def sqrt_plan(graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None) -> Plan:
    """:func:`sqrt_candidate`, simulated (eager if that is no better); fast, so no ``progress``."""
    return no_worse_than_eager(graph, simulated(graph, sqrt_candidate(graph, segments)))


def articulation_plan(graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None) -> Plan:
    """:func:`articulation_candidate`, simulated (eager if that is no better)."""
    return no_worse_than_eager(graph, simulated(graph, articulation_candidate(graph, segments)))


def mincut_plan(graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None) -> Plan:
    """:func:`mincut_candidate`, simulated (eager if that is no better)."""
    return no_worse_than_eager(graph, simulated(graph, mincut_candidate(graph, segments)))


def blocks_plan(graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None) -> Plan:
    """:func:`blocks_candidate`, simulated (eager if that is no better); :func:`sqrt_candidate`
    with a note when the graph names no blocks."""
    candidate = blocks_candidate(graph)
    if candidate is None:
        fallback = sqrt_candidate(graph, segments)
        note = "blocks: no repeated blocks in the module tree to recompute; used sqrt segments instead"
        candidate = replace(fallback, notes=(note, *fallback.notes))
    return no_worse_than_eager(graph, simulated(graph, candidate))


def auto_plan(graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None) -> Plan:
    """The plan of lowest simulated peak among sqrt, articulation and mincut (less
    recompute breaks ties); its ``strategy`` names the winner. Candidates with the same
    segments (on a chain of blocks the three often agree) are simulated once, and one whose
    replay goes above the best peak so far is dropped there (:func:`peak_exceeds`).
    ``progress`` hears ``(done, 3)`` as each candidate is made and simulated (seconds each at
    50k nodes)."""
    simulated_by_segments: dict[tuple, Plan] = {}
    plans: list[Plan] = []
    makers = (mincut_candidate, articulation_candidate, sqrt_candidate)
    for done, make in enumerate(makers):
        if progress is not None:
            progress(done, len(makers))
        candidate = make(graph, segments)
        if candidate.segments not in simulated_by_segments:
            # Dropped early when it peaks above the best so far, unless that best is at eager's
            # peak: then the candidate would become eager execution, which ties it with no recompute.
            if plans and _beaten_below_eager(graph, candidate, plans):
                continue
            simulated_by_segments[candidate.segments] = simulated(graph, candidate)
        plan = replace(simulated_by_segments[candidate.segments], strategy=candidate.strategy, notes=candidate.notes)
        plans.append(no_worse_than_eager(graph, plan))
    if progress is not None:
        progress(len(makers), len(makers))
    best = min(plans, key=lambda p: (p.peak_bytes, p.recompute_flops))
    return replace(best, notes=(f"auto: chose {best.strategy}", *best.notes))


def _beaten_below_eager(graph: nx.DiGraph, candidate: Candidate, plans: list[Plan]) -> bool:
    """Whether a valid ``candidate`` peaks above the best of ``plans`` while that best is
    below eager's peak, so that neither it nor the eager execution it would fall back to
    (:func:`no_worse_than_eager`) can win."""
    best_peak = min(p.peak_bytes for p in plans)
    if best_peak >= plans[0].eager_peak_bytes:
        return False
    validate_plan(graph, candidate.segments)
    return peak_exceeds(graph, candidate.segments, best_peak)
