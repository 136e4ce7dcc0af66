"""Flat plans: every heuristic strategy's segments over a range of counts, their partly
recomputed and selective variants, and the cheapest of them that fits a budget.

They are the budget planner's (:func:`passes.budget_search.fit_budget`) second source beside the
dynamic program, and where it looks when the program's estimates lead it astray. Pricing
a plan is cheap and simulating it is not, so :func:`cheapest_fitting` simulates them
cheapest first, only while one could still win.
"""

from __future__ import annotations

import math
from dataclasses import replace

import networkx as nx

from passes.cuts import op_layout
from passes.graph_facts import op_nodes
from passes.heuristics import articulation_candidate, blocks_candidate, mincut_candidate, sqrt_candidate
from passes.peak_queries import forward_floor
from passes.plan import Candidate, Plan, selective, simulated
from passes.recompute import cost_key
from passes.segments import make_segments


def segment_counts(graph: nx.DiGraph) -> list[int]:
    """Segment counts worth trying: every count up to 8, then geometrically up to √n·4."""
    ops = len(op_nodes(graph))
    counts = set(range(1, min(ops, 8) + 1))
    count = 8.0
    while count < min(ops, 4 * math.sqrt(ops) + 1):
        count *= 1.25
        counts.add(min(ops, round(count)))
    return sorted(counts)


def partially_recomputed(graph: nx.DiGraph, candidate: Candidate) -> list[Candidate]:
    """Variants of ``candidate`` that recompute only its first r recomputed segments: less
    recompute for a budget that does not need them all."""
    recomputed = [i for i, s in enumerate(candidate.segments) if s.recompute]
    variants = []
    for r in range(1, len(recomputed)):
        keep = set(recomputed[r:])
        groups = [(s.nodes, s.recompute and i not in keep) for i, s in enumerate(candidate.segments)]
        variants.append(replace(candidate, segments=make_segments(graph, groups)))
    return variants


THOROUGH_UP_TO = 400  # ops; larger graphs try fewer flat plans (the dynamic program covers them)


def candidates(graph: nx.DiGraph) -> list[Candidate]:
    """Flat plans of every heuristic strategy over a range of segment counts (their default
    √n count included), per-block checkpointing when the module tree names blocks
    (:mod:`passes.blocks`), their partially recomputed variants, and selective variants of all
    of these that keep matmul/convolution outputs; not yet simulated. Graphs over
    ``THOROUGH_UP_TO`` ops get only the default count of the two fast strategies."""
    if len(op_nodes(graph)) > THOROUGH_UP_TO:
        found = [sqrt_candidate(graph), articulation_candidate(graph)]
    else:
        heuristics = (sqrt_candidate, articulation_candidate, mincut_candidate)
        found = [strategy(graph, count) for count in [*segment_counts(graph)[1:], None] for strategy in heuristics]
        found += [v for c in found if len(c.segments) <= 9 for v in partially_recomputed(graph, c)]
    blocks = blocks_candidate(graph)
    if blocks is not None:
        found += [blocks, *partially_recomputed(graph, blocks)]
    return _with_selective(graph, found)


MORE_SEGMENTS = (1.0, 1.25, 1.6, 2.0)  # times the default √n count


def more_segments(graph: nx.DiGraph) -> list[Candidate]:
    """Flat plans for a graph over :data:`THOROUGH_UP_TO` ops whose :func:`candidates` all miss
    a budget: sqrt at more segments than its default count, min-cut (which those candidates
    try only where articulation points are too few) at :data:`MORE_SEGMENTS` times it, and
    their selective variants. More boundaries hold less each, so a plan recomputing every
    segment reaches lower, and min-cut boundaries hold least. On 500-op random DAGs at 0.3 of
    eager, where the default plans missed by 2-7% (articulation's by 3x: its cut points are
    few and far between), the planner's answer was a plan dropping hundreds of values at
    1.6-3.8x the forward's FLOPs; min-cut plans fit at 0.9x."""
    count = op_layout(graph).segment_count
    counts = sorted({max(1, round(factor * count)) for factor in MORE_SEGMENTS})
    found = [mincut_candidate(graph, c) for c in counts]
    found += [sqrt_candidate(graph, c) for c in counts if c != count]
    return _with_selective(graph, found)


def _with_selective(graph: nx.DiGraph, found: list[Candidate]) -> list[Candidate]:
    """``found`` and, when the graph has matmul/convolution outputs, the selective variant of
    each plan that recomputes something."""
    if any(graph.nodes[n]["expensive"] for n in graph):
        found += [selective(graph, c) for c in found if any(s.recompute for s in c.segments)]
    return found


def candidate_plans(graph: nx.DiGraph) -> list[Plan]:
    """Every one of :func:`candidates`, simulated."""
    return [simulated(graph, c) for c in candidates(graph)]


def cheapest(plans: list[Plan]) -> Plan:
    """Least recompute (:attr:`Plan.cost_key`: FLOPs, then bytes recomputed, then
    checkpoint calls), then the lower peak."""
    return min(plans, key=lambda p: (*p.cost_key, p.peak_bytes))


def cheapest_fitting(graph: nx.DiGraph, flat: list[Candidate], budget_bytes: int,
                     best: Plan | None) -> tuple[Plan | None, list[Plan]]:
    """The plan of least recompute that fits, from ``best`` (already simulated, or None)
    and the ``flat`` candidates, and the candidates it simulated.

    Simulating a plan is what costs; pricing it and bounding its peak from below
    (:func:`passes.peak_queries.forward_floor`) are cheap. So candidates are simulated cheapest
    first, only while they could still win and when their bound fits. When none fits,
    every candidate is simulated, so the error can name the smallest peak.
    """
    tried: list[Plan] = []
    skipped: list[Candidate] = []
    priced = sorted(((cost_key(graph, c.segments), index) for index, c in enumerate(flat)))
    for key, index in priced:
        candidate = flat[index]
        if best is not None and key > best.cost_key:
            break
        if forward_floor(graph, candidate.segments) > budget_bytes:
            skipped.append(candidate)
            continue
        plan = simulated(graph, candidate)
        tried.append(plan)
        if plan.peak_bytes <= budget_bytes:
            best = plan if best is None else cheapest([best, plan])
    if best is None:
        tried += [simulated(graph, c) for c in skipped]
    return best, tried
