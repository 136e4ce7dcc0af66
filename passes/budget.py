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
from passes.plan import Plan
from passes.strategies import articulation_plan, build_plan, keep_expensive, mincut_plan, sqrt_plan

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


def partially_recomputed(graph: nx.DiGraph, plan: Plan) -> list[Plan]:
    """Variants of ``plan`` that recompute only its first r recomputed segments: less
    recompute for a budget that does not need them all."""
    recomputed = [i for i, s in enumerate(plan.segments) if s.recompute]
    variants = []
    for r in range(1, len(recomputed)):
        keep = set(recomputed[r:])
        groups = [(s.nodes, s.recompute and i not in keep) for i, s in enumerate(plan.segments)]
        variants.append(build_plan(graph, plan.strategy, groups, plan.notes))
    return variants


def candidate_plans(graph: nx.DiGraph) -> list[Plan]:
    """Plans of every strategy over a range of segment counts, their partially recomputed
    variants, and selective variants of all of these that keep matmul/convolution outputs
    (each simulated and validated)."""
    plans = [strategy(graph, count) for count in segment_counts(graph)
             for strategy in (sqrt_plan, articulation_plan, mincut_plan)]
    plans += [v for p in plans if len(p.segments) <= 17 for v in partially_recomputed(graph, p)]
    if any(graph.nodes[n]["expensive"] for n in graph):
        plans += [keep_expensive(graph, p) for p in plans if p.recomputed_segments]
    return plans


def fit_budget(graph: nx.DiGraph, budget_bytes: int) -> Plan:
    """The candidate plan of least recompute whose simulated peak fits ``budget_bytes``.

    Least recompute: fewest FLOPs, then fewest bytes recomputed (pointwise work, which the
    FLOP counter calls free), then the lower peak.

    Raises :class:`BudgetError` naming the smallest peak any candidate reaches and the
    values its plan still keeps when none fits.
    """
    plans = candidate_plans(graph)  # segments=1 is eager itself: no recompute
    eager = plans[0].eager_peak_bytes
    fitting = [p for p in plans if p.peak_bytes <= budget_bytes]
    if not fitting:
        best = min(plans, key=lambda p: p.peak_bytes)
        heaviest = sorted(best.checkpoints, key=lambda v: -graph.nodes[v]["bytes"])[:5]
        raise BudgetError(
            f"no plan fits {budget_bytes / 2**20:.2f} MiB; the smallest simulated peak is "
            f"{best.peak_bytes / 2**20:.2f} MiB ({best.peak_bytes / max(eager, 1):.2f}x eager, "
            f"strategy {best.strategy} with {len(best.segments)} segments), kept values include "
            f"{', '.join(heaviest) or 'none'}. Raise the budget."
        )
    chosen = min(fitting, key=lambda p: (p.recompute_flops, p.recompute_bytes, p.peak_bytes))
    note = f"budget {budget_bytes / 2**20:.2f} MiB: least recompute among {len(plans)} candidate plans"
    return replace(chosen, notes=(note, *chosen.notes))
