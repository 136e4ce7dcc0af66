"""The cheapest plan that fits a memory budget (:func:`fit_budget`, what ``budget=`` and
the ``optimal`` strategy run). How a budget is read and what a refusal says are
:mod:`passes.budget`; per-block checkpointing at a budget, for ``graphckpt.enable``, is
:mod:`passes.block_plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import networkx as nx

from passes.budget import BudgetError, unreachable
from passes.drop_scan import DROPS_MAX_OPS, drop_bases, drops_on_top
from passes.drops import drop_plan
from passes.exact import EXACT_TIME_LIMIT, exact_plan, exact_solvable, floors_below
from passes.flat_plans import THOROUGH_UP_TO, candidates, cheapest, cheapest_fitting, more_segments
from passes.graph_facts import op_nodes
from passes.heuristics import auto_plan, blocks_candidate
from passes.keeps import MANY_STARTS_UP_TO, best_with_keeps, best_without_keeps, filled_again, selective_start
from passes.kept_values import leaf_segments, least_with_keeps
from passes.optimal import DynamicPrograms
from passes.peak_queries import forward_floor
from passes.plan import Candidate, Plan, Progress, build_plan, simulated
from passes.recompute import cost_key
from passes.refusal import lower_refusal
from passes.relaxed import Rounded, lowest_relaxed, relaxed_plans, remakes_of
from passes.search import SEARCH_MAX_OPS, SEEDS_BELOW_FLOOR, search, search_seeds
from passes.segments import Segment
from passes.simulate import eager_peak, forward_flops
from passes.units import format_bytes, unit_of


def eager_fits(graph: nx.DiGraph, strategy: str, budget_bytes: int) -> Plan:
    """The plan that recomputes nothing, for a budget eager's peak already fits."""
    note = f"{strategy}: eager fits {format_bytes(budget_bytes, unit_of(eager_peak(graph)))}; nothing is recomputed"
    return build_plan(graph, strategy, [(op_nodes(graph), False)], [note])


def fit_budget(graph: nx.DiGraph, budget_bytes: int, progress: Progress | None = None,
               exact_seconds: float = EXACT_TIME_LIMIT) -> Plan:
    """The plan of least recompute whose simulated peak fits ``budget_bytes``: the dynamic
    program's nested plan (:mod:`passes.optimal`) or, where its estimates lead it astray,
    the best of the flat :func:`passes.flat_plans.candidates`; then the spare memory filled with values its
    recomputed segments keep, chosen one by one, or a plan nearly fitting brought under by
    giving up some of what it keeps (:mod:`passes.keeps`), and on small graphs a
    local search from there (:mod:`passes.search`), which also looks below the program's
    floor. On graphs of up to :data:`passes.exact.EXACT_MAX_OPS` ops the exact solver's
    schedule competes too, given ``exact_seconds`` (0: never). Its ``strategy`` is
    ``"optimal"``; a note says which plan won.

    Raises :class:`BudgetError` naming the smallest peak any plan reaches (of those planned
    for the budget and for budgets between it and their least peak:
    :func:`passes.refusal.lower_refusal`),
    the values its plan still keeps and, on small graphs, the true floor (:mod:`passes.floor`)
    when none fits.
    """
    try:
        return _fit_budget(graph, budget_bytes, progress, exact_seconds, floors=True)
    except BudgetError as refused:
        lower = lower_refusal(graph, refused, lambda budget: _fit_budget(graph, budget, None, 0, floors=False),
                              progress=progress)
        if isinstance(lower, Plan):
            return lower
        raise lower from None


def _fit_budget(graph: nx.DiGraph, budget_bytes: int, progress: Progress | None, exact_seconds: float,
                floors: bool) -> Plan:
    """:func:`fit_budget` for one budget; its refusal names the least peak of the plans for
    that budget, and with ``floors`` of what the exact solver and the relaxation find below
    them (:func:`passes.exact.floors_below`, :func:`passes.relaxed.lowest_relaxed`)."""
    if eager_peak(graph) <= budget_bytes:  # nothing to plan: eager fits and recomputes nothing
        return eager_fits(graph, "optimal", budget_bytes)
    program = DynamicPrograms(graph, progress=progress, within_bytes=budget_bytes)
    found = program.plan_for_budget(budget_bytes)
    flat = candidates(graph)
    chosen, tried = cheapest_fitting(graph, flat, budget_bytes, found)
    if len(op_nodes(graph)) > THOROUGH_UP_TO and (chosen is None or chosen.recompute_flops > forward_flops(graph)):
        # few flat plans were tried, and none fits or what fits reruns more than a flat plan could: try more
        simulated_already = {plan.segments for plan in tried}  # articulation may have fallen back to min-cut
        more = [c for c in more_segments(graph) if c.segments not in simulated_already]
        chosen, more_tried = cheapest_fitting(graph, more, budget_bytes, chosen)
        flat, tried = [*flat, *more], [*tried, *more_tried]
    origin = ("the dynamic program's plan" if chosen is found else
              f"a flat {chosen.strategy} plan with {len(chosen.segments)} segments" if chosen else "")
    searched_later = len(op_nodes(graph)) <= SEARCH_MAX_OPS  # a dearer dropping plan is a search's start there
    dropping = drop_plan(graph, budget_bytes) if searched_later else None
    scanned = len(op_nodes(graph)) <= DROPS_MAX_OPS
    kept_first: Plan | None = None
    if scanned and not searched_later and chosen is not None:  # filled first: the bound the drop scan stops at
        built = _to_fill(graph, program, tried, budget_bytes)
        kept_first = best_with_keeps(graph, [chosen, *built], budget_bytes)
    on_top = (drops_on_top(graph, drop_bases(graph, [*program.plans(), *tried], budget_bytes, chosen), budget_bytes,
                           None if kept_first is None else min(chosen.cost_key, kept_first.cost_key))
              if scanned else None)
    if on_top is not None and (dropping is None or on_top.cost_key < dropping.cost_key):
        dropping = on_top
    if dropping is not None and (chosen is None or dropping.cost_key < chosen.cost_key):
        chosen, origin = dropping, "a plan dropping values cheap to make again (passes.drops)"
    rounded: Rounded | None = None  # the relaxation is solved at most once
    below_floor = chosen is None or (chosen is found and not any(p.peak_bytes <= budget_bytes for p in tried)
                                     and program.only_tight_fits(budget_bytes))
    if below_floor:  # below the floor of the program (but for its deep nests) and the flat plans: search toward it
        smallest = sorted([*tried, program.smallest()], key=lambda p: p.peak_bytes)[:2]
        floor_solved = exact_solvable(graph, exact_seconds)  # else only searches go lower
        searched = search_seeds(graph, smallest, budget_bytes, 1 if floor_solved else SEEDS_BELOW_FLOOR)
        if (searched is not None and searched.peak_bytes <= budget_bytes
                and (chosen is None or searched.cost_key < chosen.cost_key)):
            chosen, origin = searched, "a searched plan below the dynamic program's floor"
        elif chosen is None:  # values made more than once reach lower (passes.relaxed)
            rounded = relaxed_plans(graph, budget_bytes)
            if rounded.searchable is None:
                exact = exact_plan(graph, budget_bytes, exact_seconds)  # the solver's schedule may reach lower still
                if exact is not None:
                    return _chosen(exact, budget_bytes, flat, tried, "the exact solver's schedule (passes.exact)")
                if not floors:
                    raise unreachable(graph, budget_bytes, [*tried, program.smallest(), *([searched] if searched else [])])
                # the floor of the widest plans: named if the refusal stands, the plan if it fits (the
                # solve for the least recompute may have found no schedule in its time); both floor
                # solves look only below the smallest peak of the plans in hand
                planned = [*tried, program.smallest(), *([searched] if searched else [])]
                lowest, floor = floors_below(graph, exact_seconds, min(p.peak_bytes for p in planned))
                if lowest is not None and lowest.peak_bytes <= budget_bytes:
                    return _chosen(lowest, budget_bytes, flat, tried, "the exact solver's schedule of least peak "
                                   "(passes.exact.floor_plan)")
                planned += [lowest] if lowest else []
                lower = None if rounded.timed_out else lowest_relaxed(  # one time-out says the rest would too
                    graph, max(budget_bytes, floor.lower_bound_bytes if floor else 0), min(p.peak_bytes for p in planned))
                if lower is not None and lower.peak_bytes <= budget_bytes:
                    return _chosen(lower, budget_bytes, flat, tried, _relaxed_origin(lower))
                planned += [lower] if lower else []
                floor = floor if lower is None or floor is None else floor.below(lower.peak_bytes)
                raise unreachable(graph, budget_bytes, planned,
                                  *((floor.peak_bytes, floor.lower_bound_bytes) if floor else ()))
            chosen, origin = rounded.searchable, _relaxed_origin(rounded.searchable)
    if kept_first is None:  # not filled yet (a search toward the floor may have added plans)
        built = _to_fill(graph, program, tried, budget_bytes)
        kept = best_with_keeps(graph, [chosen, *built], budget_bytes)
    else:  # filled before the drop scan; a dropping plan that won is filled too
        kept = cheapest([kept_first, *([best_with_keeps(graph, [chosen], budget_bytes)] if chosen is dropping else [])])
    if kept is not None and kept.cost_key < chosen.cost_key:
        if [s.nodes for s in kept.segments] != [s.nodes for s in chosen.segments]:  # keeps made another plan win
            origin = f"the {kept.strategy} plan with {len(kept.segments)} segments"
        chosen, origin = kept, _with_keeps_origin(kept, origin)
    trimmed = best_without_keeps(graph, built, budget_bytes, beat=chosen.cost_key)
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
    unsimulated = _unsimulated_filled(graph, flat, tried, budget_bytes, chosen.cost_key[0])
    if unsimulated is not None and unsimulated.cost_key < chosen.cost_key:
        start = f"the {unsimulated.strategy} plan with {len(unsimulated.segments)} segments"
        chosen, origin = unsimulated, f"{_with_keeps_origin(unsimulated, start)} (a flat plan rated dearer before its keeps)"
    again = filled_again(graph, chosen, budget_bytes)
    if again.cost_key < chosen.cost_key:
        chosen, origin = again, f"{origin}, then more of its values kept in the memory left"
    exact = exact_plan(graph, budget_bytes, exact_seconds, beat=chosen.cost_key[0], start=chosen.segments)
    if exact is not None and exact.cost_key < chosen.cost_key:
        chosen, origin = exact, f"the exact solver's schedule (passes.exact), recomputing less than {origin}"
    blocks = blocks_within_margin(graph, chosen, budget_bytes, tried)
    if blocks is not None:
        chosen, origin = blocks, (f"per-block checkpointing: {origin} was rated less than {BLOCKS_MARGIN:.0%} "
                                  "cheaper, within what the cost model gets wrong")
    return _chosen(chosen, budget_bytes, flat, tried, origin)


def _chosen(chosen: Plan, budget_bytes: int, flat: Sequence, tried: Sequence[Plan], origin: str) -> Plan:
    """``chosen`` as :func:`fit_budget`'s answer: strategy ``optimal``, a note saying why."""
    note = (f"optimal: least recompute for {format_bytes(budget_bytes, unit_of(chosen.eager_peak_bytes))} among the "
            "dynamic program's "
            f"plan and {len(flat)} flat plans ({len(tried)} simulated): {origin}")
    return replace(chosen, strategy="optimal", notes=(note, *chosen.notes))


def _to_fill(graph: nx.DiGraph, program: DynamicPrograms, tried: Sequence[Plan], budget_bytes: int) -> list[Plan]:
    """The plans to fill with kept values or trim of them: the program's plans built so far,
    the flat plans simulated, and the selective starts for this budget."""
    return [*program.plans(), *tried, *selective_start(graph, budget_bytes)]


UNSIMULATED_STARTS = 8  # flat plans not simulated by the budget search, filled with keeps: those that could end cheapest


def _unsimulated_filled(graph: nx.DiGraph, flat: Sequence[Candidate], tried: Sequence[Plan], budget_bytes: int,
                        beat: float) -> Plan | None:
    """:func:`passes.keeps.best_with_keeps` over the flat plans :func:`cheapest_fitting` did
    not simulate (it stops at the cheapest plan as it stands) whose forward floor fits: the
    :data:`UNSIMULATED_STARTS` that, keeping every value they could, would recompute least,
    if less than ``beat`` (:func:`passes.kept_values.least_with_keeps`); ``None`` on
    graphs over :data:`passes.keeps.MANY_STARTS_UP_TO` ops. A dearer plan can end cheaper
    once its spare memory keeps values: on Hugging Face LLaMA at 0.51 of eager a min-cut plan
    of 26 segments, rated dearer than the dynamic program's, ends a quarter cheaper keeping
    113 values (94 ms of extra step time predicted against 129). Tried after the local search
    (and before the exact solver), beside the plan the other steps chose: as one more start of
    the keeps before the search, it changed what the search found (:func:`passes.search.search`
    splits its moves between its starts), and U-Net at 0.7 of eager got a dearer plan."""
    if len(op_nodes(graph)) > MANY_STARTS_UP_TO:
        return None
    simulated_already = {plan.segments for plan in tried}
    bounded = [(bound, index) for index, c in enumerate(flat)  # the floor first: half the bound's price
               if c.segments not in simulated_already and forward_floor(graph, c.segments) <= budget_bytes
               and (bound := least_with_keeps(graph, c)) < beat]
    picked = _cheapest_per_cut(graph, flat, [index for _, index in sorted(bounded)])[:UNSIMULATED_STARTS]
    starts = [simulated(graph, flat[index]) for index in picked]
    return best_with_keeps(graph, starts, budget_bytes, starts=UNSIMULATED_STARTS)


def _cheapest_per_cut(graph: nx.DiGraph, flat: Sequence[Candidate], indices: Sequence[int]) -> list[int]:
    """Of the flat plans ``indices`` names (into ``flat``), the one recomputing least of each
    cut (the same segments recomputed, whatever they keep), in the order of each cut's first:
    a plan and its selective variant, filled with keeps, mostly end as one plan, since the
    fill keeps matmul outputs first. On ``scripts/planner_gap.py``'s 8 random DAGs of 500 ops
    the fills went from 13 to 7 at 0.5 of eager and from 23 to 12 at 0.7, for the same plans
    (0.17-0.21 s less a graph, of 1.3-1.6 s)."""
    picked: dict[tuple, tuple[tuple[int, int, int], int]] = {}  # cut -> (cost key, index) of its cheapest
    for index in indices:
        cut = tuple((segment.nodes, segment.recompute) for segment in flat[index].segments)
        key = cost_key(graph, flat[index].segments)
        if cut not in picked or key < picked[cut][0]:
            picked[cut] = (key, index)
    return [index for _, index in picked.values()]


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


def _with_keeps_origin(plan: Plan, start: str) -> str:
    """How ``plan``, ``start`` filled with kept values (:func:`passes.keeps.with_keeps`), came about."""
    return f"{start}, keeping {_kept_count(plan)} values of its recomputed segments chosen one by one"


def _kept_count(plan: Plan) -> int:
    return sum(len(segment.saved_inside) for _, segment in leaf_segments(plan.segments))


def optimal_plan(graph: nx.DiGraph, *, segments: int | None = None, progress: Progress | None = None,
                 exact_seconds: float = EXACT_TIME_LIMIT) -> Plan:
    """Least recompute for the peak :func:`passes.heuristics.auto_plan` reaches (without a
    budget, "optimal" keeps auto's memory and cuts its recompute): the ``"optimal"``
    :class:`passes.strategies.Strategy`. ``segments`` is ignored: the program chooses
    segments itself."""
    return fit_budget(graph, auto_plan(graph).peak_bytes, progress, exact_seconds)
