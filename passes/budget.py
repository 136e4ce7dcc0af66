"""Memory budgets: what users say ("a quarter", "2GiB") and the cheapest plan that fits.

A budget bounds the *simulated peak* of a training step (:mod:`passes.simulate`), not just
the bytes saved for backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import networkx as nx

from passes.blocks import block_mixes
from passes.drop_scan import DROPS_MAX_OPS, drop_bases, drops_on_top
from passes.drops import drop_plan
from passes.flat_plans import THOROUGH_UP_TO, candidates, cheapest, cheapest_fitting, more_segments, partially_recomputed
from passes.floor import true_floor
from passes.graph_facts import op_nodes
from passes.heuristics import auto_plan, blocks_candidate
from passes.keeps import best_with_keeps, best_without_keeps, leaf_segments, selective_start
from passes.optimal import DynamicProgram, plan_for_budget
from passes.plan import Plan, Progress, build_plan, simulated
from passes.recompute import cost_key
from passes.relaxed import Rounded, relaxed_plans, remakes_of
from passes.search import SEARCH_MAX_OPS, search
from passes.segments import PlanError, Segment
from passes.sim_peak import PeakBreakdown, peak_breakdown
from passes.simulate import eager_peak, forward_floor
from passes.units import format_bytes, parse_size

Budget = float | int | str


class BudgetError(ValueError):
    """A budget cannot be read, or no plan of this graph fits it.

    When no plan fits, the fields say why, for programs to read rather than the message:
    ``budget_bytes`` asked for, ``smallest_peak_bytes`` the smallest simulated peak any plan
    reaches (the floor), ``eager_peak_bytes``, ``strategy`` and ``segment_count`` of that
    smallest plan, and ``kept_values``: the heaviest values it still keeps. A budget that
    cannot be read leaves them ``None`` (``()`` for ``kept_values``).

    ``smallest_peak_bytes`` is the floor of graphckpt's plans; ``true_floor_bytes`` the least
    peak any recompute schedule reaches (:func:`passes.floor.true_floor`, the exact MILP, on
    graphs small enough to solve; ``None`` otherwise). Between the two lie budgets that a
    schedule meets and no plan graphckpt builds yet does. ``at_peak`` is what is alive at
    the smallest plan's peak (:func:`passes.sim_peak.peak_breakdown`, replayed when first
    asked: a caller trying budgets until one fits never pays for it): what to shrink
    (``graphckpt inspect --budget ... --peak`` prints it, naming nodes from ``cost_graph``).
    """

    def __init__(self, message: str, *, budget_bytes: int | None = None, smallest_peak_bytes: int | None = None,
                 eager_peak_bytes: int | None = None, strategy: str | None = None,
                 segment_count: int | None = None, kept_values: Sequence[str] = (),
                 true_floor_bytes: int | None = None, cost_graph: nx.DiGraph | None = None,
                 smallest_segments: Sequence[Segment] = ()) -> None:
        super().__init__(message)
        self.true_floor_bytes = true_floor_bytes
        self.cost_graph = cost_graph
        self._smallest_segments = tuple(smallest_segments)
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
        if self._at_peak is None and self.cost_graph is not None:
            self._at_peak = peak_breakdown(self.cost_graph, self._smallest_segments)
        return self._at_peak

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
    return (f"no plan fits {format_bytes(budget_bytes, 'MiB')}; the smallest simulated peak is "
            f"{format_bytes(smallest_peak_bytes, 'MiB')} ({ratio:.2f}x eager, "
            f"strategy {strategy} with {segment_count} segments)")


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


def _eager_fits(graph: nx.DiGraph, strategy: str, budget_bytes: int) -> Plan:
    """The plan that recomputes nothing, for a budget eager's peak already fits."""
    note = f"{strategy}: eager fits {format_bytes(budget_bytes, 'MiB')}; nothing is recomputed"
    return build_plan(graph, strategy, [(op_nodes(graph), False)], [note])


def fit_budget(graph: nx.DiGraph, budget_bytes: int, progress: Progress | None = None) -> Plan:
    """The plan of least recompute whose simulated peak fits ``budget_bytes``: the dynamic
    program's nested plan (:mod:`passes.optimal`) or, where its estimates lead it astray,
    the best of the flat :func:`passes.flat_plans.candidates`; then the spare memory filled with values its
    recomputed segments keep, chosen one by one, or a plan nearly fitting brought under by
    giving up some of what it keeps (:mod:`passes.keeps`), and on small graphs a
    local search from there (:mod:`passes.search`), which also looks below the program's
    floor. Its ``strategy`` is ``"optimal"``; a note says which plan won.

    Raises :class:`BudgetError` naming the smallest peak any plan reaches, the values its
    plan still keeps and, on small graphs, the true floor (:mod:`passes.floor`) when none fits.
    """
    if eager_peak(graph) <= budget_bytes:  # nothing to plan: eager fits and recomputes nothing
        return _eager_fits(graph, "optimal", budget_bytes)
    program = DynamicProgram(graph, progress=progress)
    found = plan_for_budget(program, budget_bytes)
    flat = candidates(graph)
    chosen, tried = cheapest_fitting(graph, flat, budget_bytes, found)
    if chosen is None and len(op_nodes(graph)) > THOROUGH_UP_TO:  # few flat plans were tried: try more
        simulated_already = {plan.segments for plan in tried}  # articulation may have fallen back to min-cut
        more = [c for c in more_segments(graph) if c.segments not in simulated_already]
        chosen, more_tried = cheapest_fitting(graph, more, budget_bytes, None)
        flat, tried = [*flat, *more], [*tried, *more_tried]
    origin = ("the dynamic program's plan" if chosen is found else
              f"a flat {chosen.strategy} plan with {len(chosen.segments)} segments" if chosen else "")
    dropping = drop_plan(graph, budget_bytes) if len(op_nodes(graph)) <= SEARCH_MAX_OPS else None
    searched_later = len(op_nodes(graph)) <= SEARCH_MAX_OPS  # a dearer dropping plan is a search's start there
    scanned = len(op_nodes(graph)) <= DROPS_MAX_OPS
    kept_first: Plan | None = None
    if scanned and not searched_later and chosen is not None:  # filled first: the bound the drop scan stops at
        built = [*program.plans(), *tried, *selective_start(graph, budget_bytes)]  # plans to fill or trim
        kept_first = best_with_keeps(graph, [chosen, *built], budget_bytes)
    on_top = (drops_on_top(graph, drop_bases(graph, [*program.plans(), *tried], budget_bytes, chosen), budget_bytes,
                           None if kept_first is None else min(chosen.cost_key, kept_first.cost_key))
              if scanned else None)
    if on_top is not None and (dropping is None or on_top.cost_key < dropping.cost_key):
        dropping = on_top
    if dropping is not None and (chosen is None or dropping.cost_key < chosen.cost_key):
        chosen, origin = dropping, "a plan dropping values cheap to make again (passes.drops)"
    rounded: Rounded | None = None  # the relaxation is solved at most once
    if chosen is None:  # below the floor of the program and the flat plans: search toward it
        smallest = sorted([*tried, program.smallest()], key=lambda p: p.peak_bytes)[:2]
        searched = search(graph, smallest, budget_bytes)
        if searched is not None and searched.peak_bytes <= budget_bytes:
            chosen, origin = searched, "a searched plan below the dynamic program's floor"
        else:  # values made more than once reach lower (passes.relaxed)
            rounded = relaxed_plans(graph, budget_bytes)
            if rounded.searchable is None:
                floor = true_floor(graph)
                raise _unreachable(graph, budget_bytes,
                                   [*tried, program.smallest(), *([searched] if searched else [])],
                                   None if floor is None else floor.peak_bytes)
            chosen, origin = rounded.searchable, _relaxed_origin(rounded.searchable)
    if kept_first is None:  # not filled yet (a search toward the floor may have added plans)
        built = [*program.plans(), *tried, *selective_start(graph, budget_bytes)]
        kept = best_with_keeps(graph, [chosen, *built], budget_bytes)
    else:  # filled before the drop scan; a dropping plan that won is filled too
        kept = cheapest([kept_first, *([best_with_keeps(graph, [chosen], budget_bytes)] if chosen is dropping else [])])
    if kept is not None and kept.cost_key < chosen.cost_key:
        if [s.nodes for s in kept.segments] != [s.nodes for s in chosen.segments]:  # keeps made another plan win
            origin = f"the {kept.strategy} plan with {len(kept.segments)} segments"
        chosen, origin = kept, f"{origin}, keeping {_kept_count(kept)} values of its recomputed segments chosen one by one"
    trimmed = best_without_keeps(graph, built, budget_bytes)
    if trimmed is not None and trimmed.cost_key < chosen.cost_key:
        chosen, origin = trimmed, (f"a {trimmed.strategy} plan brought under the budget by giving up kept values one "
                                   f"by one, {_kept_count(trimmed)} left")
    rounded = rounded if rounded is not None else relaxed_plans(graph, budget_bytes)  # solved at most once
    unrounded = chosen
    if rounded.searchable is not None and rounded.searchable.cost_key < chosen.cost_key:
        chosen, origin = rounded.searchable, _relaxed_origin(rounded.searchable)
    others = [plan for plan in (dropping, unrounded) if plan is not None and plan is not chosen]
    searched = search(graph, [chosen, *others], budget_bytes)  # from the plan dropping values too
    if searched is not None and searched.peak_bytes <= budget_bytes and searched.cost_key < chosen.cost_key:
        chosen, origin = searched, (f"{origin}, then bettered by a local search over segments and kept values "
                                    "from it and the plans before it")
    if rounded.plan is not None and rounded.plan.cost_key < chosen.cost_key:  # values held once made again
        chosen, origin = rounded.plan, _relaxed_origin(rounded.plan)
    blocks = blocks_within_margin(graph, chosen, budget_bytes, tried)
    if blocks is not None:
        chosen, origin = blocks, (f"per-block checkpointing: {origin} was rated less than {BLOCKS_MARGIN:.0%} "
                                  "cheaper, within what the cost model gets wrong")
    note = (f"optimal: least recompute for {format_bytes(budget_bytes, 'MiB')} among the dynamic program's "
            f"plan and {len(flat)} flat plans ({len(tried)} simulated): {origin}")
    return replace(chosen, strategy="optimal", notes=(note, *chosen.notes))


def _relaxed_origin(plan: Plan) -> str:
    """How a plan of :func:`passes.relaxed.relaxed_plan` came about, for the plan's note."""
    each = remakes_of(plan)
    return (f"one segment run by hooks keeping {_kept_count(plan)} values rounded from the exact schedule's LP "
            f"relaxation (passes.relaxed){f', {each}' if each else ''}")


BLOCKS_MARGIN = 0.02


def blocks_within_margin(graph: nx.DiGraph, chosen: Plan, budget_bytes: int,
                         simulated_already: Sequence[Plan] = ()) -> Plan | None:
    """Per-block checkpointing (:func:`passes.heuristics.blocks_candidate`) in place of
    ``chosen`` when it fits the budget and ``chosen`` is rated less than :data:`BLOCKS_MARGIN`
    cheaper; else ``None``. Per-block's plan is taken from ``simulated_already`` when it is
    there (the flat candidates a budget search simulated).

    Near per-block's memory the planner's other plans differ from it by a percent or two of
    predicted recompute, less than the cost model's error there: on Hugging Face LLaMA at
    per-block's peak a plan rated 1.9% cheaper in FLOPs stepped 1.014x per-block's, one
    rated cheaper in measured op time 1.058x, while graphckpt's ``blocks`` stepped 0.996x
    (docs/per_block.md). Per-block checkpointing is the plan whose step is known.
    """
    candidate = blocks_candidate(graph)
    if candidate is None:
        return None
    rated = cost_key(graph, candidate.segments)  # priced before simulating: simulating is what costs
    if chosen.cost_key >= rated or chosen.cost_key[0] < (1 - BLOCKS_MARGIN) * rated[0]:
        return None
    if forward_floor(graph, candidate.segments) > budget_bytes:
        return None
    layout = _layout(candidate.segments)
    plan = next((p for p in simulated_already if _layout(p.segments) == layout), None) or simulated(graph, candidate)
    return plan if plan.peak_bytes <= budget_bytes else None


def _layout(segments: Sequence[Segment]) -> list[tuple]:
    """What a plan runs: each segment's nodes, whether it is recomputed, what it keeps and
    its nested segments (a selective variant of a plan is another plan)."""
    return [(s.nodes, s.recompute, s.saved_inside, _layout(s.children)) for s in segments]


def _kept_count(plan: Plan) -> int:
    return sum(len(segment.saved_inside) for _, segment in leaf_segments(plan.segments))


def _unreachable(graph: nx.DiGraph, budget_bytes: int, plans: list[Plan],
                 true_floor_bytes: float | None = None) -> BudgetError:
    """The error for a budget below every plan's peak: the smallest of ``plans``, the
    heaviest values it keeps, and the true floor when it is known and lower."""
    best = min(plans, key=lambda p: p.peak_bytes)
    heaviest = sorted(best.checkpoints, key=lambda v: -graph.nodes[v]["bytes"])[:5]
    reason = _reason(budget_bytes, best.peak_bytes, best.eager_peak_bytes, best.strategy, len(best.segments))
    floor = None if true_floor_bytes is None else math.ceil(true_floor_bytes)
    return BudgetError(f"{reason}, kept values include {', '.join(heaviest) or 'none'}."
                       f"{_floor_note(floor, best.peak_bytes, best.eager_peak_bytes, budget_bytes)} Raise the budget.",
                       budget_bytes=budget_bytes, smallest_peak_bytes=best.peak_bytes,
                       eager_peak_bytes=best.eager_peak_bytes, strategy=best.strategy,
                       segment_count=len(best.segments), kept_values=heaviest, true_floor_bytes=floor,
                       cost_graph=graph, smallest_segments=best.segments)


def _floor_note(floor: int | None, plan_floor: int, eager_peak_bytes: int, budget_bytes: int) -> str:
    """A sentence on the true floor when it is below the plans' floor."""
    if floor is None or floor >= plan_floor:
        return ""
    fits = "meets" if floor <= budget_bytes else "does not meet"
    return (f" The true floor (the least peak of any recompute schedule, passes.floor) is lower: a schedule "
            f"reaches {format_bytes(floor, 'MiB')} ({floor / max(eager_peak_bytes, 1):.2f}x eager), which {fits} "
            "this budget, by recomputing values from several kept ones just before each use, "
            "which graphckpt's plans express only in part (each value made again at every use, with a "
            "whole segment's keep set).")


def block_plan(graph: nx.DiGraph, budget_bytes: int | None = None) -> Plan:
    """Per-block checkpointing that a module tree can carry out in place: every block
    recomputed, or for ``budget_bytes`` the plan of least recompute that fits it among
    recomputing the first r blocks whole and the next s selectively
    (:func:`passes.blocks.block_mixes`; eager when eager fits). Each recomputed segment is
    one block's run, so ``graphckpt.enable`` can checkpoint the block's own ``forward``.

    Raises :class:`passes.segments.PlanError` when the graph names no blocks, and
    :class:`BudgetError` naming the smallest peak when no such plan fits.
    """
    every = blocks_candidate(graph)
    if every is None:
        raise PlanError("no blocks to checkpoint in place: the model has no repeated child modules "
                        "(a ModuleList or Sequential of same-class layers); name them with blocks=[...]")
    if budget_bytes is None:
        return simulated(graph, every)
    if eager_peak(graph) <= budget_bytes:
        return _eager_fits(graph, "blocks", budget_bytes)
    flat = [every, *partially_recomputed(graph, every), *block_mixes(graph, every)]
    chosen, tried = cheapest_fitting(graph, flat, budget_bytes, None)
    if chosen is None:
        raise _unreachable(graph, budget_bytes, tried)
    return chosen


def optimal_plan(graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None) -> Plan:
    """Least recompute for the peak :func:`passes.heuristics.auto_plan` reaches (without a
    budget, "optimal" keeps auto's memory and cuts its recompute): the ``"optimal"``
    :class:`passes.strategies.Strategy`. ``segments`` is ignored: the program chooses
    segments itself."""
    return fit_budget(graph, auto_plan(graph).peak_bytes, progress)
