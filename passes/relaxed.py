"""Plans rounded from the LP relaxation of the exact schedule (Checkmate's approach).

The exact optimum (:mod:`passes.checkmate`) keeps, at the start of backward, a set of
values that is rarely a prefix cut or "every matmul": it holds what is cheap to hold and dear
to make again, anywhere in the graph, and makes the rest again just before backward needs
it. One selective segment over the whole graph run by saved-tensor hooks (:mod:`passes.hooked`)
executes such a set: it keeps the values named, remakes each group of the others when
backward first needs one, and lets every value go after its last use. Which set is the
question; the MILP answers it in seconds on 40 ops, its LP relaxation in a fraction of one.

:func:`relaxed_plan` rounds the relaxation's holds (:func:`passes.checkmate.relaxation`)
at a few thresholds, brings each rounded plan to the budget by giving up or adding kept
values (:func:`passes.keeps.without_keeps`, :func:`passes.keeps.with_keeps`) and returns the
cheapest that fits. On the 40-op random DAGs of ``scripts/planner_gap.py`` at 0.7 of eager
it is where the exact optimum is on most graphs. Where backward must remake only part of a
group to fit (tighter budgets) whole-group remakes overshoot; a rounded set that does not fit
is tried again with each dropped value made at every use from its own recipe
(``remake_each_use``), as the exact schedule makes values more than once, and then with
values held once made where the budget allows (:func:`with_held`), as the exact schedule
keeps some of what it made alive across uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

import networkx as nx

from passes.checkmate import MAX_OPS, relaxation
from passes.graph_facts import op_nodes
from passes.hooked import holdable, keeps_by_hooks, remake_phrase
from passes.keeps import with_keeps, without_keeps
from passes.kept_values import keepable, keeping, whole_graph
from passes.peak_queries import peak_within
from passes.plan import Plan, plan_of_segments
from passes.recompute import cost_key
from passes.refusal import lowest_between
from passes.segments import Segment

RELAXED_MAX_OPS = MAX_OPS
RELAXED_SECONDS = 3.0  # the LP relaxation's limit: random DAGs of 60 ops solve it in 0.8-2.9 s on a 2-core
# EPYC (their rounded plans recompute up to 60% less at 0.3-0.7 of eager); the zoo ResNet's 56 ops (BatchNorm)
# need 6-10 s and its rounded plans lost to the dynamic program's: 5 s spent for nothing on every budget
THRESHOLDS = (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95)  # a value held at least this much is kept


def rounded_keeps(graph: nx.DiGraph, holds: dict[str, float]) -> list[set[str]]:
    """The distinct sets of keepable values held at least each of :data:`THRESHOLDS`."""
    found: list[set[str]] = []
    for threshold in THRESHOLDS:
        kept = {name for name, share in holds.items() if share >= threshold and keepable(graph, name)}
        if kept and kept not in found:
            found.append(kept)
    return found


def with_one_less(keep_sets: list[set[str]]) -> list[set[str]]:
    """``keep_sets`` and the smallest of them less each one of its values. The relaxation
    says what is alive through backward, not whether it was kept from forward or made once
    in backward and held (:func:`with_held`, which holds only values not kept): a value
    held fully may be better made again. On DenseNet at 0.5 of eager the loss's 8 bytes of
    scalars moved a dense layer's output from a half hold to a full one, and the plan
    keeping it cost 21% more than the one holding it once made."""
    smallest = min(keep_sets, key=len, default=set())
    fewer = (smallest - {name} for name in sorted(smallest))  # distinct: each lacks another value
    return keep_sets + [kept for kept in fewer if kept and kept not in keep_sets]


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


class Rounded(NamedTuple):
    """What :func:`relaxed_plans` found: ``plan``, the cheapest that fits, holding values once
    made again where that helps (:func:`with_held`); ``searchable``, the cheapest that fits
    holding none, which :func:`passes.search.search` can start from (its layouts say nothing
    of held values, so a start holding some would leave it nowhere to climb); ``timed_out``,
    whether the relaxation went unsolved in its time (then neither says the budget is out
    of reach)."""

    plan: Plan | None
    searchable: Plan | None
    timed_out: bool = False


NOTHING_ROUNDED = Rounded(None, None)


def relaxed_plan(graph: nx.DiGraph, budget_bytes: float) -> Plan | None:
    """The cheapest plan fitting ``budget_bytes`` among the relaxation's rounded keep sets,
    each kept by one hooked segment over the graph (:func:`relaxed_plans`)."""
    return relaxed_plans(graph, budget_bytes).plan


def relaxed_plans(graph: nx.DiGraph, budget_bytes: float) -> Rounded:
    """The cheapest plans fitting ``budget_bytes`` among the relaxation's rounded keep sets,
    each kept by one hooked segment over the graph, with and without held values
    (:class:`Rounded`); nothing on graphs over :data:`RELAXED_MAX_OPS` ops, where no segment
    would run by hooks, or when none fits."""
    fits, timed_out = fitting_roundings(graph, budget_bytes)
    best: Plan | None = None
    searchable: Plan | None = None
    for plan in fits:
        if searchable is None or plan.cost_key < searchable.cost_key:
            searchable = plan
        plan = with_held(graph, plan, budget_bytes)
        if best is None or plan.cost_key < best.cost_key:
            best = plan
    return Rounded(_noted(best), _noted(searchable), timed_out)


def fitting_roundings(graph: nx.DiGraph, budget_bytes: float) -> tuple[Iterator[Plan], bool]:
    """The plans of the relaxation's rounded keep sets that fit ``budget_bytes``, made one by
    one as they are asked for (each costs dozens of simulations), none holding values once
    made; and whether the relaxation went unsolved in its time. No plans on graphs over
    :data:`RELAXED_MAX_OPS` ops or where no segment would run by hooks."""
    if len(op_nodes(graph)) > RELAXED_MAX_OPS:
        return iter(()), False
    whole = whole_graph(graph)
    if not _any_hooked(graph, keeping(whole, {name for name in op_nodes(graph) if keepable(graph, name)})):
        return iter(()), False
    holds, status = relaxation(graph, budget_bytes, time_limit=RELAXED_SECONDS)
    if holds is None:
        return iter(()), status == "time_limit"
    return _fits(graph, whole, holds, budget_bytes), False


def _fits(graph: nx.DiGraph, whole: tuple[Segment, ...], holds: dict[str, float],
          budget_bytes: float) -> Iterator[Plan]:
    """Each rounded keep set of ``holds`` as a plan under ``budget_bytes``, remaking values at
    every use where remaking each group once does not fit; sets that fit neither way skipped."""
    for kept in with_one_less(rounded_keeps(graph, holds)):
        segments = keeping(whole, kept)
        if not _any_hooked(graph, segments):
            continue
        plan = fitted(graph, segments, budget_bytes)
        if plan is None or plan.peak_bytes > budget_bytes:  # make values again at each use instead
            plan = fitted(graph, tuple(replace(s, remake_each_use=True) for s in segments), budget_bytes)
        if plan is not None and plan.peak_bytes <= budget_bytes:
            yield plan


def _noted(plan: Plan | None) -> Plan | None:
    """A plan of :func:`relaxed_plans` named ``relaxed``, with a note of what it keeps."""
    if plan is None:
        return None
    each = remakes_of(plan)
    note = (f"relaxed: one segment run by saved-tensor hooks keeping {sum(len(s.saved_inside) for s in plan.segments)} "
            f"values{f' ({each})' if each else ''}, rounded from the LP relaxation of the exact schedule")
    return replace(plan, strategy="relaxed", notes=(note, *plan.notes))


def remakes_of(plan: Plan) -> str:
    """:func:`passes.hooked.remake_phrase` of a relaxed plan's segments."""
    return remake_phrase(any(s.remake_each_use for s in plan.segments), sum(len(s.remake_held) for s in plan.segments))


def with_held(graph: nx.DiGraph, plan: Plan, budget_bytes: float) -> Plan:
    """``plan`` with values its segments remaking each value at every use hold once made
    (``remake_held``: each recipe then starts from them) wherever that recomputes less and
    stays under ``budget_bytes``: tried one value at a time, the one saving most first.
    Between remaking every use and remaking each group once, which is where the exact
    schedule sits at tight budgets: it makes a value more than once but keeps some of what
    it made alive across uses."""
    segments, best = plan.segments, plan.cost_key
    for index, segment in enumerate(plan.segments):
        if not (segment.remake_each_use and keeps_by_hooks(graph, segment)):
            continue
        order = sorted(holdable(graph, segment),
                       key=lambda name, at=index: cost_key(graph, _holding(segments, at, (name,))))
        for name in order:
            held = tuple(n for n in segment.nodes if n in {*segments[index].remake_held, name})
            trial = _holding(segments, index, held)
            key = cost_key(graph, trial)
            if key < best and peak_within(graph, trial, budget_bytes) is not None:
                segments, best = trial, key
    if segments == plan.segments:
        return plan
    return replace(plan_of_segments(graph, plan.strategy, segments), notes=plan.notes)


def _holding(segments: tuple[Segment, ...], index: int, held: tuple[str, ...]) -> tuple[Segment, ...]:
    """``segments`` with the one at ``index`` holding ``held`` once made again."""
    return (*segments[:index], replace(segments[index], remake_held=held), *segments[index + 1:])


def lowest_relaxed(graph: nx.DiGraph, low: float, high: float, steps: int = 4) -> Plan | None:
    """The relaxed plan of least peak found under ``high`` (a refused budget's smallest plan
    in hand) and not under ``low`` (what is known unreachable: the budget, the exact
    solver's proven floor), by bisecting the budget :func:`relaxed_plans` rounds for over
    ``steps`` solves (:func:`passes.refusal.lowest_between`); ``None`` when none is found.

    A refusal names the smallest peak a plan reaches. The floor solves of
    :func:`passes.exact.floors_below` may stop at their time limit with none below the
    plans in hand while the relaxation's rounding reaches lower: on the zoo ResNet, refused
    at 0.5 of eager, the plans in hand peaked at 0.65x and their floor solves found nothing
    below in 5 s, but a relaxed plan peaks at 0.56x, the floor. On graphs of 41 to
    :data:`RELAXED_MAX_OPS` ops no floor solve runs, and this is the only look below the
    plans in hand. The bisection stops at the first relaxation not solved in its time: one
    that times out at one budget rarely solves at the next (the benchmarks' 56-op ResNet
    solves none in its 3 s). Each step takes the first rounded plan under its middle, and
    values are held once made (:func:`with_held`) only in the plan found last, under its own
    peak: what a rounding spends its time on lowers recompute, not the peak."""
    def probe(budget: float) -> tuple[Plan | None, bool] | None:
        fits, timed_out = fitting_roundings(graph, budget)
        if timed_out:
            return None
        found = next(fits, None)  # any plan under the budget halves the range
        return found, found is not None

    best = lowest_between(low, high, steps, probe)
    return None if best is None else _noted(with_held(graph, best, best.peak_bytes))
