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
:data:`passes.search.SEARCH_MAX_OPS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import networkx as nx

from passes.graph_facts import node_attribute, op_nodes
from passes.keeps import keepable
from passes.plan import Plan, plan_of_segments
from passes.recompute import cost_key
from passes.remat import rematerializable, with_remat
from passes.segments import PlanError, Segment, make_segments
from passes.simulate import eager_segments, peak_within, simulate


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


DROPS_MAX_OPS = 1500  # larger graphs: each validity check walks the whole plan, ~30 ms at 10k ops


def drops_on_top(graph: nx.DiGraph, bases: Sequence[Plan], budget_bytes: float) -> Plan | None:
    """The cheapest plan fitting ``budget_bytes`` made by dropping values on top of one of
    ``bases`` (:func:`dropped_segments`): for each base, the shortest prefix of the values it
    could drop (:func:`droppable_values`) that fits (:func:`_shortest_fitting_prefix`). For
    graphs of any size, where :func:`drop_plan`'s greedy takes a simulation per value: a
    transformer's plan keeps its matmul outputs and drops the pointwise values between them,
    what torch.compile's partitioner recomputes."""
    found: list[tuple[tuple[int, int, int], int, Plan, list[str], tuple[Segment, ...]]] = []
    for index, base in enumerate(bases):
        fitting = _shortest_fitting_prefix(graph, base.segments, droppable_values(graph, base.segments), budget_bytes)
        if fitting is not None:
            chosen, segments = fitting
            found.append((cost_key(graph, segments), index, base, chosen, segments))
    if not found:
        return None
    _, _, base, chosen, segments = min(found, key=lambda item: item[:2])
    return plan_of_segments(graph, "dropped values", segments,
                            [f"dropped values: {len(chosen)} values made again before their backward, "
                             f"on top of a {base.strategy} plan with {len(base.segments)} segments"])


DROP_BASES = 4


def drop_bases(graph: nx.DiGraph, plans: Sequence[Plan], budget_bytes: float, chosen: Plan | None) -> list[Plan]:
    """The plans worth dropping values on top of (:func:`drops_on_top`), all above the budget
    and cheaper than ``chosen`` (dropping only adds recompute): everything kept, and of
    ``plans`` the :data:`DROP_BASES` nearest the budget (the least to drop) and the
    :data:`DROP_BASES` cheapest, each layout once."""
    everything = plan_of_segments(graph, "eager", eager_segments(graph))
    above = {p.segments: p for p in [everything, *plans]
             if p.peak_bytes > budget_bytes and (chosen is None or p.cost_key < chosen.cost_key)}
    nearest = sorted(above.values(), key=lambda p: p.peak_bytes)[:DROP_BASES]
    cheapest = sorted(above.values(), key=lambda p: p.cost_key)[:DROP_BASES]
    candidates = [p for p in (above.get(everything.segments), *nearest, *cheapest) if p is not None]
    return list({id(p): p for p in candidates}.values())


DROP_REFUSALS = 16  # values refused before the scan for more to drop gives up


def droppable_values(graph: nx.DiGraph, segments: Sequence[Segment], chunk: int = 16) -> Iterator[str]:
    """The values of :func:`drop_order` that ``segments`` can drop together, in that order,
    as they are found: made and saved only by ops of kept segments, each taken with those
    before it only when the plan stays valid, until :data:`DROP_REFUSALS` values have been
    refused. Each check rebuilds the whole plan (3 ms on GPT-2's 538 ops), so values are
    tried a ``chunk`` at a time, and in a chunk that fails the first value refused is found
    by :func:`_longest_valid_prefix`, not one by one. Lazy: a budget that a few dropped
    values meet stops the scan there (:func:`_shortest_fitting_prefix`). On a 1000-op
    residual stack, where dropping a run of values in a row makes chains too long
    (:data:`passes.remat.MAX_REMAT_OPS`), checking every value was most of a 12 s budget
    plan, and the values late in the order are the ones worth least."""
    kept = {name for s in segments if not s.recompute for name in s.nodes}
    savers: dict[str, list[str]] = {}
    for name in op_nodes(graph):
        for value in graph.nodes[name]["saved"]:
            savers.setdefault(value, []).append(name)
    todo = [v for v in drop_order(graph) if v in kept and savers.get(v) and all(s in kept for s in savers[v])]
    chosen: list[str] = []
    refused = 0
    while todo and refused < DROP_REFUSALS:
        block, todo = todo[:chunk], todo[chunk:]
        taken = _longest_valid_prefix(graph, chosen, block, segments)
        chosen += block[:taken]
        yield from block[:taken]
        if taken < len(block):  # block[taken] is refused; the rest of the block is tried again
            refused += 1
            todo = block[taken + 1:] + todo


def _longest_valid_prefix(graph: nx.DiGraph, chosen: list[str], block: list[str],
                          segments: Sequence[Segment]) -> int:
    """How many values of ``block``, from its start, ``segments`` can drop with ``chosen``:
    all of them in one check when they can; otherwise found by galloping from the start
    (prefixes of 1, 2, 4, ... values) and then bisection, taking a plan that is invalid as
    staying invalid with more values dropped (a dropped value only takes sources away from
    the others' chains). Refused values come mostly first in a block (the one refused just
    before it was the start of a run the chains cannot reach across), where galloping
    needs one check past the whole block's and bisection needed four."""
    if _valid(graph, [*chosen, *block], segments):
        return len(block)
    low, high = 0, 1  # low values are known to be droppable, high are not known to be
    while high < len(block) and _valid(graph, [*chosen, *block[:high]], segments):
        low, high = high, 2 * high
    high = min(high, len(block))  # known not to be droppable
    while high - low > 1:
        middle = (low + high) // 2
        if _valid(graph, [*chosen, *block[:middle]], segments):
            low = middle
        else:
            high = middle
    return low


def _trial(graph: nx.DiGraph, dropped: list[str], base: Sequence[Segment] = ()) -> tuple[Segment, ...] | None:
    """:func:`dropped_segments`, or ``None`` when the values cannot be dropped together."""
    try:
        return dropped_segments(graph, dropped, base)
    except PlanError:
        return None


def _valid(graph: nx.DiGraph, dropped: list[str], segments: Sequence[Segment]) -> bool:
    return _trial(graph, dropped, segments) is not None


FIRST_FIT_TEST = 16  # dropped values after which the scan first asks whether the plan fits


def _shortest_fitting_prefix(graph: nx.DiGraph, segments: Sequence[Segment], options: Iterable[str],
                             budget_bytes: float) -> tuple[list[str], tuple[Segment, ...]] | None:
    """The shortest prefix of ``options`` whose plan fits ``budget_bytes``, with that plan's
    segments; ``None`` when all of them do not fit. ``options`` is taken lazily: the plan of
    the values taken so far is tried after :data:`FIRST_FIT_TEST` values, then each time
    their count doubles, and once one fits no more are scanned; the shortest fitting prefix
    is then found by bisection since the last that did not fit (dropping more lowers the
    peak, all but always). A budget near the base's peak needs a few values, where checking
    every value droppable was most of the plan's time."""
    fitting: dict[int, tuple[Segment, ...]] = {}
    chosen: list[str] = []

    def fits(count: int) -> bool:
        trial = _trial(graph, chosen[:count], segments)
        if trial is None or peak_within(graph, trial, budget_bytes) is None:
            return False
        fitting[count] = trial
        return True

    low, test_at = 0, FIRST_FIT_TEST  # low: the longest prefix known not to fit (0: not known to)
    for value in options:
        chosen.append(value)
        if len(chosen) == test_at:
            if fits(test_at):
                break
            low, test_at = test_at, 2 * test_at
    else:  # every option taken: the plan dropping all of them is the last to try
        if len(chosen) == low or not fits(len(chosen)):
            return None
    high = len(chosen)  # fits
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return chosen[:high], fitting[high]


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
            trial = None if name in chosen or simulations >= max_simulations else _trial(graph, [*chosen, name])
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
        trial = None if name in chosen else _trial(graph, [*chosen, name])
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
        segments = _trial(graph, trial)
        if segments is None or cost_key(graph, segments) >= best:
            continue
        max_simulations -= 1
        if peak_within(graph, segments, budget_bytes) is not None:
            chosen, best = trial, cost_key(graph, segments)
    return chosen
