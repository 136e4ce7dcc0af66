"""Dropped values: plans that keep what eager keeps but the values cheap to make again.

Near eager's peak the exact optimum (:mod:`passes.checkmate`) keeps every expensive value and
drops a few cheap ones after forward, making each again from kept values just before the
backward that reads it. Segments over prefix cuts reach that only by recomputing whole runs of
ops. With rematerialized inputs (:mod:`passes.remat`) a plan can say it directly: a value ``v``
is *dropped* when every op that saved it for backward becomes a one-op recomputed segment that
rematerializes ``v`` (and keeps its own output from forward, :attr:`Segment.saved_inside`, so
it does not run again), and ``v``'s own op, when it saved its output, is recomputed too.

:func:`drop_plan` chooses the dropped values greedily, two ways (the value that lowers the
simulated peak most per unit of recompute first; or cheapest to make again per byte first), and
takes the cheaper. Each try is one simulation, so it is for small graphs (the local search's,
:data:`passes.search.SEARCH_MAX_OPS`); on graphs of any size values are dropped on top of
other plans by a lazy scan (:mod:`passes.drop_scan`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import networkx as nx

from passes.graph_facts import node_attribute, op_nodes
from passes.kept_values import keepable
from passes.peak_queries import peak_within
from passes.plan import Plan, plan_of_segments
from passes.recompute import cost_key
from passes.remat import rematerializable, with_remat
from passes.segments import PlanError, Segment, make_segments
from passes.simulate import eager_segments, simulate


def dropped_segments(graph: nx.DiGraph, dropped: Iterable[str], base: Sequence[Segment] = ()) -> tuple[Segment, ...]:
    """The segments dropping ``dropped`` (see the module's docstring) on top of ``base``, a
    plan's segments (default: everything kept): its recomputed segments stay, rematerializing
    a dropped value they read, and its kept ones are split around the ops that saved a
    dropped value. :class:`PlanError` when that cannot be (an op that saved it is recomputed
    by ``base`` or may not be recomputed, an impure chain)."""
    dropped = set(dropped)
    saved = node_attribute(graph, "saved")
    isolated = {name for name in op_nodes(graph)
                if not dropped.isdisjoint(saved[name])}  # the savers, the value's own op included
    segments: list[Segment] = []
    for segment in base or eager_segments(graph):
        if segment.recompute:
            if isolated & set(segment.nodes):
                raise PlanError("an op that saved a dropped value is recomputed by the plan under it")
            segments.append(segment)
            continue
        for piece in make_segments(graph, _isolating(segment.nodes, isolated)):
            if not piece.recompute:
                if not isolated.isdisjoint(piece.nodes):
                    raise PlanError("an op that saved a dropped value may not be recomputed")
                segments.append(piece)
                continue
            name = piece.nodes[0]
            own = name not in dropped and keepable(graph, name)
            saves_output = graph.nodes[name]["saves_from"] == "outputs"
            segments.append(replace(piece, saved_inside=(name,)) if own and saves_output else piece)
    picks = [(index, value) for index, segment in enumerate(segments) if segment.recompute
             for value in segment.inputs if value in dropped]
    return with_remat(graph, segments, picks, PlanError)


def _isolating(nodes: Sequence[str], isolated: set[str]) -> list[tuple[list[str], bool]]:
    """``(nodes, recompute)`` groups of a kept run: each ``isolated`` op alone and recomputed,
    the ops between them one kept group (one segment each, not one per op: the drop search
    splits every kept segment of a plan for each set of values it tries)."""
    groups: list[tuple[list[str], bool]] = [([], False)]
    for name in nodes:
        if name in isolated:
            groups += [([name], True), ([], False)]
        else:
            groups[-1][0].append(name)
    return groups


def dropped_or_none(graph: nx.DiGraph, dropped: list[str], base: Sequence[Segment] = ()) -> tuple[Segment, ...] | None:
    """:func:`dropped_segments`, or ``None`` when the values cannot be dropped together."""
    try:
        return dropped_segments(graph, dropped, base)
    except PlanError:
        return None


def drop_order(graph: nx.DiGraph) -> list[str]:
    """Values that could be dropped, cheapest to make again per byte first (ties: in order)."""
    options = [name for name in op_nodes(graph) if rematerializable(graph, name)]
    return sorted(options, key=lambda name: (graph.nodes[name]["flops"] / graph.nodes[name]["bytes"],
                                             graph.nodes[name]["order"]))


def drop_plan(graph: nx.DiGraph, budget_bytes: float, max_simulations: int = 300) -> Plan | None:
    """The cheaper fitting plan of two greedy choices of dropped values (:func:`_best_first`,
    :func:`_in_order`), each with the values no longer needed put back (:func:`_pruned`), at
    most ``max_simulations`` simulations each; ``None`` when neither fits ``budget_bytes``.
    Neither greedy wins everywhere: on the 40-op budget table at 0.7 of eager the first is
    1.09x the optimum on one graph where the second is 1.02x."""
    found = []
    for greedy in (_best_first, _in_order):
        chosen = greedy(graph, budget_bytes, max_simulations)
        if chosen is not None:
            chosen = _pruned(graph, chosen, budget_bytes, max_simulations)
            found.append((cost_key(graph, dropped_segments(graph, chosen)), len(found), chosen))
    if not found:
        return None
    chosen = min(found)[2]
    return plan_of_segments(graph, "dropped values", dropped_segments(graph, chosen),
                            [f"dropped values: {len(chosen)} values made again before their backward"])



def _best_first(graph: nx.DiGraph, budget_bytes: float, max_simulations: int) -> list[str] | None:
    """Drop, step by step, the value of :func:`drop_order` that lowers the simulated peak most
    per unit of recompute it adds, until the plan fits (``None`` if it never does)."""
    chosen: list[str] = []
    segments = dropped_segments(graph, ())
    peak, cost, simulations = simulate(graph, segments).peak_bytes, cost_key(graph, segments)[0], 0
    while peak > budget_bytes and simulations < max_simulations:
        best: tuple[float, str, int, int] | None = None
        for name in drop_order(graph):
            trial = None if name in chosen or simulations >= max_simulations else dropped_or_none(graph, [*chosen, name])
            if trial is None:
                continue
            simulations += 1
            trial_peak, trial_cost = simulate(graph, trial).peak_bytes, cost_key(graph, trial)[0]
            gain = (peak - trial_peak) / max(trial_cost - cost, 0.5)
            if trial_peak < peak and (best is None or gain > best[0]):
                best = (gain, name, trial_peak, trial_cost)
        if best is None:
            break
        chosen, peak, cost = [*chosen, best[1]], best[2], best[3]
    return chosen if peak <= budget_bytes else None


def _in_order(graph: nx.DiGraph, budget_bytes: float, max_simulations: int) -> list[str] | None:
    """Drop the values of :func:`drop_order` in that order, each kept in the set only when it
    lowers the simulated peak, until the plan fits (two passes at most; ``None`` if it never
    does)."""
    chosen: list[str] = []
    peak, simulations = simulate(graph, dropped_segments(graph, ())).peak_bytes, 0
    for name in [*drop_order(graph), *drop_order(graph)]:
        if peak <= budget_bytes or simulations >= max_simulations:
            break
        trial = None if name in chosen else dropped_or_none(graph, [*chosen, name])
        if trial is None:
            continue
        simulations += 1
        trial_peak = peak_within(graph, trial, peak - 1)
        if trial_peak is not None:
            chosen, peak = [*chosen, name], trial_peak
    return chosen if peak <= budget_bytes else None


def _pruned(graph: nx.DiGraph, chosen: list[str], budget_bytes: float, max_simulations: int) -> list[str]:
    """``chosen`` without the values, last chosen first, whose drop the fitting plan no longer
    needs: a value dropped early lowered the peak then, and a later one may have done more."""
    best = cost_key(graph, dropped_segments(graph, chosen))
    for name in reversed(chosen[:]):
        if max_simulations <= 0:
            break
        trial = [c for c in chosen if c != name]
        segments = dropped_or_none(graph, trial)
        if segments is None or cost_key(graph, segments) >= best:
            continue
        max_simulations -= 1
        if peak_within(graph, segments, budget_bytes) is not None:
            chosen, best = trial, cost_key(graph, segments)
    return chosen
