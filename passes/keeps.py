"""Per-value keeps: which values a recomputed segment keeps from forward, chosen value by value.

A recomputed segment's ``saved_inside`` used to be all or nothing: every matmul/convolution
output (selective checkpointing) or none. The exact optimum (:mod:`passes.checkmate`) keeps
what is cheap to hold and dear to recompute wherever it sits, a pointwise value as well as a
matmul, and recomputes the rest. This pass fills a plan's spare memory that way: with the
budget's slack after a plan fits, it keeps the values of its recomputed segments that save
the most recompute per byte (:func:`passes.kept_values.ranked_keeps`), as many as the *simulated* peak allows
(:func:`with_keeps`). A plan a little over the budget is trimmed the other way, giving up
the kept values that save least until it fits (:func:`without_keeps`), from the planner's
plans and from one selective segment over the whole graph (:func:`passes.kept_values.selective_whole`), which is
where torch.compile's min cut starts. The runtime keeps exactly the values named
(:func:`graphckpt.runtime.keep_begin`), so the plan runs as simulated.

The search simulates a bounded number of plans (``max_simulations``): a run of keeps is
tried at once and the run doubles while it fits and halves when it does not, so a plan of
hundreds of ops costs a few dozen simulations, not one per value. What a segment may keep,
the rankings and the plan edits these searches try are :mod:`passes.kept_values`.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from passes.graph_facts import op_nodes
from passes.kept_values import (
    Path,
    add_keeps,
    held_bytes,
    leaf_segments,
    least_with_keeps,
    ranked_keeps,
    ranked_removals,
    remat_still_valid,
    remove_keeps,
    selective_whole,
)
from passes.peak_queries import forward_floor, peak_within
from passes.plan import Plan, plan_of_segments
from passes.recompute import cost_key

MAX_SIMULATIONS = 40
SIMULATED_OPS = 8000  # ops x simulations one plan's search may replay: a 500-op plan gets 16
MANY_STARTS_UP_TO = 1000  # ops; larger graphs improve only the cheapest plan


def simulation_limit(graph: nx.DiGraph) -> int:
    """Simulations :func:`with_keeps` may run for one plan of ``graph``: :data:`MAX_SIMULATIONS`,
    fewer on large graphs (one replay of a 500-op step takes about 5 ms, of a 50k-op one
    about half a second), never fewer than 2."""
    return max(2, min(MAX_SIMULATIONS, SIMULATED_OPS // max(len(op_nodes(graph)), 1)))


NEARLY_FITS = 1.1  # how far over the budget a plan may be for :func:`best_without_keeps` to trim it
MIN_TRIM_SIMULATIONS = 4  # fewer allowed per plan (graphs over 2000 ops): no trimming


def keeps_within(graph: nx.DiGraph, keeps: Sequence[tuple[Path, str]], room: float) -> int:
    """How many of ``keeps``, from the first, hold at most ``room`` bytes together (at
    least one): the run :func:`with_keeps` tries next. A value held through the peak raises
    it by its bytes, so a longer run mostly goes over, and its simulation is one the search
    could have spent on a run that fits.

    >>> g = nx.DiGraph()
    >>> for name in "abc":
    ...     g.add_node(name, bytes=100, expensive=False, selective_extra_bytes=0)
    >>> keeps_within(g, [((0,), "a"), ((0,), "b"), ((0,), "c")], 250), keeps_within(g, [((0,), "a")], 10)
    (2, 1)
    """
    total = 0
    for count, (_, name) in enumerate(keeps):
        total += held_bytes(graph, name)
        if total > room:
            return max(count, 1)
    return max(len(keeps), 1)


def selective_start(graph: nx.DiGraph, budget_bytes: float) -> list[Plan]:
    """:func:`passes.kept_values.selective_whole` as a plan, when it could fit ``budget_bytes`` or be trimmed
    under it (:data:`NEARLY_FITS`): its lower bound on the peak
    (:func:`passes.peak_queries.forward_floor`) is checked before it is simulated, which on a
    50k-op graph takes a second."""
    segments = selective_whole(graph)
    if not segments or forward_floor(graph, segments) > NEARLY_FITS * budget_bytes:
        return []
    return [plan_of_segments(graph, "whole+selective", segments)]


def without_keeps(graph: nx.DiGraph, plan: Plan, budget_bytes: float, max_simulations: int | None = None,
                  beat: tuple | None = None) -> Plan | None:
    """``plan``, whose simulated peak is over ``budget_bytes``, brought under it by giving up
    kept values one at a time (:func:`passes.kept_values.ranked_removals`), each only if it lowers the simulated
    peak; ``None`` when the peak is still over after ``max_simulations`` (default
    :func:`simulation_limit`) simulations or when nothing is left to give up. With ``beat``
    (the :attr:`passes.plan.Plan.cost_key` of a plan in hand), a trial that recomputes no
    less is not simulated: giving up more kept values makes them again too, so no plan
    trimmed from it could be the cheaper one (on 500-op graphs at half of eager's peak the
    trimmed plans recomputed 1.3-4x the plan in hand and took a tenth of the planning time).

    :func:`with_keeps` fills a plan that fits; this trims one that nearly fits. A chain of
    layers kept whole but for its last matmul (torch.compile's plan for an MLP at half of
    eager's memory) is no plan of the dynamic program, which keeps every matmul of a
    selective segment or none, but is one removal away from one."""
    limit = simulation_limit(graph) if max_simulations is None else max_simulations
    segments, peak = plan.segments, plan.peak_bytes
    for simulation, removal in enumerate(ranked_removals(graph, plan.segments)):
        if simulation >= limit:
            break
        trial = remove_keeps(segments, [removal])
        if beat is not None and cost_key(graph, trial) >= beat:
            continue
        if not remat_still_valid(graph, trial):
            continue
        trial_peak = peak_within(graph, trial, peak - 1)
        if trial_peak is not None:
            segments, peak = trial, trial_peak
            if peak <= budget_bytes:
                return plan_of_segments(graph, plan.strategy, segments, plan.notes, peak)
    return None


def best_without_keeps(graph: nx.DiGraph, plans: Sequence[Plan], budget_bytes: float, starts: int = 4,
                       beat: tuple | None = None) -> Plan | None:
    """The least recompute of :func:`without_keeps` over the ``starts`` cheapest distinct
    plans of ``plans`` that keep values and are over ``budget_bytes`` by at most
    :data:`NEARLY_FITS` (one start on graphs over :data:`MANY_STARTS_UP_TO` ops); ``None``
    when none is brought under recomputing less than ``beat`` (a plan in hand's
    :attr:`passes.plan.Plan.cost_key`, when given), or when the graph is too large to afford
    :data:`MIN_TRIM_SIMULATIONS` simulations per plan (a 50k-op graph affords 2, a second each,
    and a plan keeping thousands of values is rarely brought under by two removals)."""
    if simulation_limit(graph) < MIN_TRIM_SIMULATIONS:
        return None
    starts = starts if len(op_nodes(graph)) <= MANY_STARTS_UP_TO else 1
    distinct = {plan.segments: plan for plan in plans
                if budget_bytes < plan.peak_bytes <= NEARLY_FITS * budget_bytes
                and any(segment.saved_inside for _, segment in leaf_segments(plan.segments))}
    over = sorted(distinct.values(), key=lambda plan: (*plan.cost_key, plan.peak_bytes))[:starts]
    trimmed = [found for plan in over if (found := without_keeps(graph, plan, budget_bytes, beat=beat)) is not None]
    return min(trimmed, key=lambda plan: (*plan.cost_key, plan.peak_bytes), default=None)


def with_keeps(graph: nx.DiGraph, plan: Plan, budget_bytes: float, max_simulations: int | None = None) -> Plan:
    """``plan`` with as many of :func:`passes.kept_values.ranked_keeps` kept from forward as its simulated peak
    allows under ``budget_bytes``, or ``plan`` itself when that recomputes no less
    (:attr:`passes.plan.Plan.cost_key`). Runs of keeps are tried whole, doubling while they
    fit and halving when they do not, and never holding more bytes than the last plan that
    fitted left under the budget (:func:`keeps_within`); at most ``max_simulations`` plans
    are simulated (default :func:`simulation_limit`).

    The cap spends the simulations on runs that may fit: a first run of a quarter of the
    values went over where the budget left a percent spare, and so did its halves. On 500-op
    random DAGs (``scripts/planner_gap.py``'s 8) the budget plans recompute 0.7% / 1.1% /
    0.5% less at 0.3 / 0.5 / 0.7 of eager, in as many simulations; Hugging Face LLaMA at 0.5
    of eager 7% less."""
    limit = simulation_limit(graph) if max_simulations is None else max_simulations
    ranked = ranked_keeps(graph, plan.segments)
    best, best_key, best_peak, chosen = plan.segments, plan.cost_key, plan.peak_bytes, []
    position, run, simulations, room = 0, max(1, len(ranked) // 4), 0, budget_bytes - plan.peak_bytes
    while position < len(ranked) and simulations < limit:
        run = min(run, keeps_within(graph, ranked[position:position + run], room))
        trial = [*chosen, *ranked[position:position + run]]
        segments = add_keeps(graph, plan.segments, trial)
        simulations += 1
        peak = peak_within(graph, segments, budget_bytes) if remat_still_valid(graph, segments) else None
        if peak is not None:
            chosen, position, run, room = trial, position + run, run * 2, budget_bytes - peak
            key = cost_key(graph, segments)
            if key < best_key:
                best, best_key, best_peak = segments, key, peak
        elif run > 1:
            run //= 2
        else:
            position += 1
    return plan if best is plan.segments else plan_of_segments(graph, plan.strategy, best, plan.notes, best_peak)


def best_with_keeps(graph: nx.DiGraph, plans: Sequence[Plan], budget_bytes: float, starts: int = 4) -> Plan | None:
    """The least recompute of :func:`with_keeps` over the ``starts`` cheapest distinct plans
    of ``plans`` that fit ``budget_bytes`` (``None`` when none fits; one start on graphs over
    :data:`MANY_STARTS_UP_TO` ops). A plan that recomputes more but leaves more memory spare
    can end up cheaper once that memory keeps values."""
    starts = starts if len(op_nodes(graph)) <= MANY_STARTS_UP_TO else 1
    distinct = {plan.segments: plan for plan in plans if plan.peak_bytes <= budget_bytes}
    fitting = sorted(distinct.values(), key=lambda plan: (*plan.cost_key, plan.peak_bytes))[:starts]
    improved: list[Plan] = []
    for plan in fitting:
        if improved and least_with_keeps(graph, plan) > min(p.cost_key[0] for p in improved):
            continue  # even keeping everything it could, it recomputes more than a plan found
        improved.append(with_keeps(graph, plan, budget_bytes))
    return min(improved, key=lambda plan: (*plan.cost_key, plan.peak_bytes), default=None)


REFILL_SLACK = 0.01  # of the budget: a plan leaving less spare is not filled again


def filled_again(graph: nx.DiGraph, plan: Plan, budget_bytes: float) -> Plan:
    """``plan`` with more of its values kept (:func:`with_keeps`) where it leaves more than
    :data:`REFILL_SLACK` of ``budget_bytes`` spare: the plan a budget search ends with may be
    one no fill was run on (a local search's, a rounded relaxation's), or one whose fill ran out
    of simulations before the memory did (Hugging Face LLaMA, 730 ops, at 453 MiB: filled, it
    peaked at 422 MiB with every one of 196 keeps left fitting alone; filled again, 4% less
    recompute). Not on graphs over :data:`MANY_STARTS_UP_TO` ops, where a replay costs most."""
    if len(op_nodes(graph)) > MANY_STARTS_UP_TO or budget_bytes - plan.peak_bytes <= REFILL_SLACK * budget_bytes:
        return plan
    return with_keeps(graph, plan, budget_bytes)

