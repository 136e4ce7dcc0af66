"""Memory budgets: what users say ("a quarter", "2GiB") and the cheapest plan that fits.

A budget bounds the *simulated peak* of a training step (:mod:`passes.simulate`), not just
the bytes saved for backward.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import networkx as nx

from passes.costgraph import op_nodes
from passes.optimal import DynamicProgram, Progress, plan_for_budget
from passes.plan import Plan, cost_key, make_segments
from passes.simulate import eager_peak, forward_floor
from passes.strategies import (
    Candidate,
    articulation_candidate,
    auto_plan,
    build_plan,
    mincut_candidate,
    selective,
    simulated,
    sqrt_candidate,
)

Budget = float | int | str
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class BudgetError(ValueError):
    """A budget cannot be read, or no plan of this graph fits it."""


def parse_budget(budget: Budget, eager_peak_bytes: int) -> int:
    """Bytes allowed for the peak, from a fraction of eager's peak (``0 < float <= 1``),
    an ``int`` of bytes, or a string such as ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``, ``"25%"``.

    >>> parse_budget(0.25, 1000), parse_budget("1KiB", 0), parse_budget("50%", 1000)
    (250, 1024, 500)
    """
    if isinstance(budget, bool):
        raise BudgetError(f"budget {budget!r}: give a fraction, bytes or a size like '2GiB'")
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise BudgetError(f"budget {budget}: a float is a fraction of eager's peak, 0 < b <= 1; "
                              "give bytes as an int or a string like '2GiB'")
        return int(budget * eager_peak_bytes)
    if isinstance(budget, int):
        if budget <= 0:
            raise BudgetError(f"budget {budget}: bytes must be positive")
        return budget
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        if text.endswith("%"):
            return parse_budget(float(text[:-1]) / 100, eager_peak_bytes)
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]i?b|b)?", text)
        if match is None:
            raise BudgetError(f"budget {budget!r}: expected e.g. '512MiB', '2GiB', '1.5GB' or '25%'")
        return int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    raise BudgetError(f"budget {budget!r}: expected a float fraction, int bytes or a string size")


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
    √n count included), their partially recomputed variants, and selective variants of all
    of these that keep matmul/convolution outputs; not yet simulated. Graphs over
    ``THOROUGH_UP_TO`` ops get only the default count of the two fast strategies."""
    if len(op_nodes(graph)) > THOROUGH_UP_TO:
        found = [sqrt_candidate(graph), articulation_candidate(graph)]
    else:
        heuristics = (sqrt_candidate, articulation_candidate, mincut_candidate)
        found = [strategy(graph, count) for count in [*segment_counts(graph)[1:], None] for strategy in heuristics]
        found += [v for c in found if len(c.segments) <= 9 for v in partially_recomputed(graph, c)]
    if any(graph.nodes[n]["expensive"] for n in graph):
        found += [selective(graph, c) for c in found if any(s.recompute for s in c.segments)]
    return found


def candidate_plans(graph: nx.DiGraph) -> list[Plan]:
    """Every one of :func:`candidates`, simulated."""
    return [simulated(graph, c) for c in candidates(graph)]


def _cheapest(plans: list[Plan]) -> Plan:
    """Least recompute (:attr:`Plan.cost_key`: FLOPs, then bytes recomputed, then
    checkpoint calls), then the lower peak."""
    return min(plans, key=lambda p: (*p.cost_key, p.peak_bytes))


def cheapest_fitting(graph: nx.DiGraph, flat: list[Candidate], budget_bytes: int,
                     best: Plan | None) -> tuple[Plan | None, list[Plan]]:
    """The plan of least recompute that fits, from ``best`` (already simulated, or None)
    and the ``flat`` candidates, and the candidates it simulated.

    Simulating a plan is what costs; pricing it and bounding its peak from below
    (:func:`passes.simulate.forward_floor`) are cheap. So candidates are simulated cheapest
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
            best = plan if best is None else _cheapest([best, plan])
    if best is None:
        tried += [simulated(graph, c) for c in skipped]
    return best, tried


def fit_budget(graph: nx.DiGraph, budget_bytes: int, progress: Progress | None = None) -> Plan:
    """The plan of least recompute whose simulated peak fits ``budget_bytes``: the dynamic
    program's nested plan (:mod:`passes.optimal`) or, where its estimates lead it astray,
    the best of the flat :func:`candidates`. Its ``strategy`` is ``"optimal"``; a note
    says which plan won.

    Raises :class:`BudgetError` naming the smallest peak any plan reaches and the values
    its plan still keeps when none fits.
    """
    if eager_peak(graph) <= budget_bytes:  # nothing to plan: eager fits and recomputes nothing
        note = f"optimal: eager fits {budget_bytes / 2**20:.2f} MiB; nothing is recomputed"
        return build_plan(graph, "optimal", [(op_nodes(graph), False)], [note])
    program = DynamicProgram(graph, progress=progress)
    found = plan_for_budget(program, budget_bytes)
    flat = candidates(graph)
    chosen, tried = cheapest_fitting(graph, flat, budget_bytes, found)
    if chosen is None:
        raise _unreachable(graph, budget_bytes, [*tried, program.smallest()])
    origin = ("the dynamic program's plan" if chosen is found else
              f"a flat {chosen.strategy} plan with {len(chosen.segments)} segments")
    note = (f"optimal: least recompute for {budget_bytes / 2**20:.2f} MiB among the dynamic program's "
            f"plan and {len(flat)} flat plans ({len(tried)} simulated): {origin}")
    return replace(chosen, strategy="optimal", notes=(note, *chosen.notes))


def _unreachable(graph: nx.DiGraph, budget_bytes: int, plans: list[Plan]) -> BudgetError:
    best = min(plans, key=lambda p: p.peak_bytes)
    eager = best.eager_peak_bytes
    heaviest = sorted(best.checkpoints, key=lambda v: -graph.nodes[v]["bytes"])[:5]
    return BudgetError(
        f"no plan fits {budget_bytes / 2**20:.2f} MiB; the smallest simulated peak is "
        f"{best.peak_bytes / 2**20:.2f} MiB ({best.peak_bytes / max(eager, 1):.2f}x eager, "
        f"strategy {best.strategy} with {len(best.segments)} segments), kept values include "
        f"{', '.join(heaviest) or 'none'}. Raise the budget."
    )


def optimal_plan(graph: nx.DiGraph, segments: int | None = None, progress: Progress | None = None) -> Plan:
    """Least recompute for the peak :func:`passes.strategies.auto_plan` reaches (without a
    budget, "optimal" keeps auto's memory and cuts its recompute). ``segments`` is ignored:
    the program chooses segments itself."""
    return fit_budget(graph, auto_plan(graph).peak_bytes, progress)
