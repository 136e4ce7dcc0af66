"""Memory budgets: what users say ("a quarter", "2GiB"), and what a budget no plan fits
says (:class:`BudgetError`). The search for the cheapest plan that fits is
:mod:`passes.budget_search`.

A budget bounds the *simulated peak* of a training step (:mod:`passes.simulate`), not just
the bytes saved for backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx

from passes.graph_facts import storage_root
from passes.kept_bytes import storage_bytes
from passes.plan import Plan
from passes.schedule import plan_schedule
from passes.sim_peak import PeakBreakdown, peak_breakdown
from passes.units import format_bytes, parse_size, unit_of

Budget = float | int | str


class BudgetError(ValueError):
    """A budget cannot be read, or no plan of this graph fits it.

    When no plan fits, the fields say why, for programs to read rather than the message:
    ``budget_bytes`` asked for, ``smallest_peak_bytes`` the smallest simulated peak any plan
    reaches (the floor), ``eager_peak_bytes``, ``strategy`` and ``segment_count`` of that
    smallest plan, and ``kept_values``: the heaviest values it still keeps; ``smallest_plan``
    that plan itself, which a caller that must go on (the compile backend, one graph of many)
    runs to come nearest the budget. A budget that cannot be read leaves them ``None`` (``()``
    for ``kept_values``).

    ``smallest_peak_bytes`` is the floor of graphckpt's plans; ``true_floor_bytes`` the least
    peak any recompute schedule reaches (:func:`passes.floor.true_floor`, the exact MILP, on
    graphs small enough to solve; ``None`` otherwise). Between the two lie budgets that a
    schedule meets and no plan graphckpt builds yet does. ``floor_bound_bytes`` is what that
    solve proved: no schedule peaks below it (``floor_proven`` when it is the true floor
    itself; a solve stopped at its time limit proves less). ``at_peak`` is what is alive at
    the smallest plan's peak (:func:`passes.sim_peak.peak_breakdown`, replayed when first
    asked: a caller trying budgets until one fits never pays for it): what to shrink
    (``graphckpt inspect --budget ... --peak`` prints it, naming nodes from ``cost_graph``).
    """

    def __init__(self, message: str, *, budget_bytes: int | None = None, smallest_peak_bytes: int | None = None,
                 eager_peak_bytes: int | None = None, strategy: str | None = None,
                 segment_count: int | None = None, kept_values: Sequence[str] = (),
                 true_floor_bytes: int | None = None, floor_bound_bytes: int | None = None,
                 cost_graph: nx.DiGraph | None = None, smallest_plan: Plan | None = None) -> None:
        super().__init__(message)
        self.true_floor_bytes = true_floor_bytes
        self.floor_bound_bytes = floor_bound_bytes
        self.cost_graph = cost_graph
        self.smallest_plan = smallest_plan
        self._at_peak: PeakBreakdown | None = None
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest_peak_bytes
        self.eager_peak_bytes = eager_peak_bytes
        self.strategy = strategy
        self.segment_count = segment_count
        self.kept_values = tuple(kept_values)

    @property
    def at_peak(self) -> PeakBreakdown | None:
        """What is alive at the smallest plan's simulated peak; ``None`` for an unreadable budget."""
        if self._at_peak is None and self.cost_graph is not None and self.smallest_plan is not None:
            self._at_peak = peak_breakdown(self.cost_graph, self.smallest_plan.segments)
        return self._at_peak

    @property
    def floor_proven(self) -> bool:
        """The exact solver proved ``true_floor_bytes`` least (``False`` when it is unknown)."""
        return (self.true_floor_bytes is not None and self.floor_bound_bytes is not None
                and self.floor_bound_bytes >= self.true_floor_bytes)

    @property
    def reason(self) -> str:
        """What no plan reaches and the smallest peak one does, in a line (the message
        without the values kept and the advice); the message itself for an unreadable budget."""
        if self.smallest_peak_bytes is None or self.budget_bytes is None:
            return str(self)
        return _reason(self.budget_bytes, self.smallest_peak_bytes, self.eager_peak_bytes or 0, self.strategy,
                       self.segment_count)


def _reason(budget_bytes: int, smallest_peak_bytes: int, eager_peak_bytes: int, strategy: str | None,
            segment_count: int | None) -> str:
    ratio = smallest_peak_bytes / max(eager_peak_bytes, 1)
    unit = unit_of(eager_peak_bytes or smallest_peak_bytes)  # every size of a refusal in eager's unit
    return (f"no plan fits {format_bytes(budget_bytes, unit)}; the smallest simulated peak is "
            f"{format_bytes(smallest_peak_bytes, unit)} ({ratio:.2f}x eager, "
            f"strategy {strategy} with {segment_count} segment{'' if segment_count == 1 else 's'})")


def parse_budget(budget: Budget, eager_peak_bytes: int) -> int:
    """Bytes allowed for the peak, from a fraction of eager's peak (``0 < float <= 1``),
    an ``int`` of bytes, or a string as :func:`read_budget` reads it: ``"512MiB"``,
    ``"1.5GB"``, ``"25%"``, ``"0.3"`` (a fraction), ``"1000000"`` (bytes).

    >>> parse_budget(0.25, 1000), parse_budget("1KiB", 0), parse_budget("50%", 1000), parse_budget("0.3", 1000)
    (250, 1024, 500, 300)
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
        value = read_budget(budget)
        return parse_budget(parse_size(value) if isinstance(value, str) else value, eager_peak_bytes)
    raise BudgetError(f"budget {budget!r}: expected a float fraction, int bytes or a string size")


def read_budget(text: str) -> Budget:
    """A budget written as text (a command line's ``--budget``), read into what
    :func:`parse_budget` takes: ``"0.5"`` a fraction (a plain number up to 1), ``"1000000"``
    bytes (a whole number above 1), ``"25%"`` a fraction, ``"2MiB"`` kept as the size string.
    Raises :class:`BudgetError` for anything else.

    >>> read_budget("0.5"), read_budget("1000000"), read_budget("25%"), read_budget("2MiB")
    (0.5, 1000000, 0.25, '2MiB')
    """
    compact = text.strip().lower().replace(" ", "")
    percent = compact.endswith("%")
    try:
        number = float(compact[:-1] if percent else compact)
    except ValueError:
        if parse_size(compact) is None:
            raise BudgetError(f"budget {text!r}: expected e.g. '512MiB', '2GiB', '1.5GB', '25%', "
                              "a fraction like 0.3 or bytes") from None
        return text
    if percent or 0 < number <= 1:
        fraction = number / 100 if percent else number
        parse_budget(fraction, 1)  # a fraction out of range says so
        return fraction
    if number > 1 and number.is_integer():
        return int(number)
    raise BudgetError(f"budget {text!r}: give a fraction 0 < b <= 1, bytes, or a size like '2GiB' or '25%'")


def unreachable(graph: nx.DiGraph, budget_bytes: int, plans: list[Plan],
                true_floor_bytes: float | None = None, floor_bound_bytes: float | None = None) -> BudgetError:
    """The error for a budget below every plan's peak: the smallest of ``plans``, the
    heaviest values it keeps, the true floor when it is known and lower, and what the exact
    solver proved no schedule peaks below (``floor_bound_bytes``)."""
    best = min(plans, key=lambda p: p.peak_bytes)
    heaviest = _heaviest_held(graph, best)
    reason = _reason(budget_bytes, best.peak_bytes, best.eager_peak_bytes, best.strategy, len(best.segments))
    floor = None if true_floor_bytes is None else math.ceil(true_floor_bytes)
    bound = _proven_below(true_floor_bytes, floor_bound_bytes)
    notes = (_floor_note(floor, best.peak_bytes, best.eager_peak_bytes, budget_bytes)
             + _bound_note(bound, floor, best.eager_peak_bytes, budget_bytes))
    return BudgetError(f"{reason}, kept values include {', '.join(heaviest) or 'none'}.{notes} Raise the budget.",
                       budget_bytes=budget_bytes, smallest_peak_bytes=best.peak_bytes,
                       eager_peak_bytes=best.eager_peak_bytes, strategy=best.strategy,
                       segment_count=len(best.segments), kept_values=heaviest, true_floor_bytes=floor,
                       floor_bound_bytes=bound, cost_graph=graph, smallest_plan=best)


def _proven_below(true_floor_bytes: float | None, floor_bound_bytes: float | None) -> int | None:
    """The solver's proven bound in whole bytes: the floor itself (rounded up, as it is named)
    when the bound is within a byte of it, else the bound rounded down, still a bound."""
    if true_floor_bytes is None or floor_bound_bytes is None:
        return None
    if floor_bound_bytes >= true_floor_bytes - 1:
        return math.ceil(true_floor_bytes)
    return math.floor(floor_bound_bytes)


def _heaviest_held(graph: nx.DiGraph, plan: Plan) -> list[str]:
    """The five largest storages of the values ``plan`` keeps from forward, each named once
    (a kept view by the value owning its storage), of those alive at its peak when a
    schedule runs it (:mod:`passes.exact`: it lets some go in backward, before its peak).
    What holds no activation memory (a ``size`` an op returned, a view of an input) is
    not named: a refusal of the zoo GPT listed ``size`` beside ``ln_f``."""
    kept = plan.checkpoints
    if plan_schedule(plan.segments) is not None:
        alive = {storage.name for storage in peak_breakdown(graph, plan.segments).storages}
        kept = [value for value in kept if value in alive]
    weight = {root: storage_bytes(graph, [root]) for root in {storage_root(graph, value) for value in kept}}
    return sorted((r for r, nbytes in weight.items() if nbytes), key=lambda r: (-weight[r], graph.nodes[r]["order"]))[:5]


def _floor_note(floor: int | None, plan_floor: int, eager_peak_bytes: int, budget_bytes: int) -> str:
    """A sentence on the true floor when it is below the plans' floor."""
    if floor is None or floor >= plan_floor:
        return ""
    fits = "meets" if floor <= budget_bytes else "does not meet"
    return (f" The true floor (the least peak of any recompute schedule, passes.floor) is lower: a schedule "
            f"reaches {format_bytes(floor, unit_of(eager_peak_bytes))} "
            f"({floor / max(eager_peak_bytes, 1):.2f}x eager), which {fits} "
            "this budget, by recomputing values from several kept ones just before each use, "
            "which graphckpt's plans express only in part (each value made again at every use, with a "
            "whole segment's keep set).")


def _bound_note(bound: int | None, floor: int | None, eager_peak_bytes: int, budget_bytes: int) -> str:
    """A sentence on what the exact solver proved: that no schedule meets the budget, or,
    its solve stopped at its time limit below the floor it named, that one it did not find
    may; nothing where it proved nothing, or the floor named already meets the budget."""
    if bound is None or floor is None or bound <= 0 or floor <= budget_bytes:
        return ""
    below = f"{format_bytes(bound, unit_of(eager_peak_bytes))} ({bound / max(eager_peak_bytes, 1):.2f}x eager)"
    if bound > budget_bytes:
        return f" No recompute schedule meets this budget: the exact solver proved none peaks below {below}."
    return (f" The exact solver stopped at its time limit having proved only that no schedule peaks below "
            f"{below}: one it did not find may meet this budget.")
