"""How far a plan's recompute is from the least any schedule needs (the Checkmate-style MILP).

Reported as Checkmate's paper does: total forward compute (forward + recompute) of the plan
over the optimum's. A solve stopped at its time limit leaves a range, not a number
(:class:`Gap`), and the report says which (:func:`cell`).

    >>> cell(Gap(1.0, 1.0)), cell(Gap(1.06, 1.25))
    ('1.00x', '1.06–1.25x*')
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from passes.checkmate import SolveTimeout, checkmate_schedule


@dataclass(frozen=True)
class Gap:
    """A plan's total forward compute over the optimum's, known to lie in ``[low, high]``."""

    low: float  # over the MILP's schedule (the optimum when proven, else feasible and unproven)
    high: float  # over the MILP's proven lower bound; equal to ``low`` when proven optimal

    @property
    def settled(self) -> bool:
        """Whether the ratio is known (to the report's two decimals), not a range."""
        return self.high - self.low < 5e-3

    def narrowed(self, other: Gap) -> Gap:
        """What two solves for the same plan know together: any schedule either found bounds
        the optimum from above, any bound either proved bounds it from below."""
        return Gap(max(self.low, other.low), min(self.high, other.high))


def gap_to_milp(graph: nx.DiGraph, budget_bytes: float, ours: int, time_limit: float) -> Gap:
    """A plan's :class:`Gap` to the least recompute of any schedule under ``budget_bytes``
    (the plan recomputes ``ours`` FLOPs and fits it). The MILP is asked only for schedules
    recomputing less (``beat=ours``): where none does it proves so, often in a fraction of
    a full solve, and the ratio is 1.00x; stopped at its time limit without one, the ratio
    lies between 1.00x and ``ours`` over HiGHS's proven bound."""
    forward = sum(f for _, f in graph.nodes(data="flops"))
    total = forward + ours
    try:
        best = checkmate_schedule(graph, budget_bytes, time_limit=time_limit, beat=ours)
    except SolveTimeout as stopped:
        return Gap(1.0, total / (forward + stopped.recompute_lower_bound))
    if best is None:
        return Gap(1.0, 1.0)
    return Gap(total / (forward + best.recompute_flops), total / (forward + best.recompute_lower_bound))


def cell(gap: Gap | None) -> str:
    """``1.23x`` when proven; ``1.06-1.25x*`` (the true ratio's range) when the MILP timed out;
    ``—`` for no gap (a model whose table has no such row)."""
    if gap is None:
        return "—"
    return f"{gap.low:.2f}x" if gap.settled else f"{gap.low:.2f}–{gap.high:.2f}x*"
