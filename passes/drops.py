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

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

import networkx as nx

from passes.graph_facts import node_attribute, op_nodes, pure_ops
from passes.keeps import keepable
from passes.plan import Plan, plan_of_segments
from passes.recompute import cost_key
from passes.remat import MAX_REMAT_OPS, ChainTooLong, held_at_each, remat_chain, rematerializable, with_remat
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


def drops_on_top(graph: nx.DiGraph, bases: Sequence[Plan], budget_bytes: float,
                 dearer_than: tuple[int, int, int] | None = None) -> Plan | None:
    """The cheapest plan fitting ``budget_bytes`` made by dropping values on top of one of
    ``bases`` (:func:`dropped_segments`): for each base, the shortest prefix of the values it
    could drop (:func:`droppable_values`) that fits (:func:`_shortest_fitting_prefix`). For
    graphs of any size, where :func:`drop_plan`'s greedy takes a simulation per value: a
    transformer's plan keeps its matmul outputs and drops the pointwise values between them,
    what torch.compile's partitioner recomputes.

    With ``dearer_than`` (a plan's :func:`passes.recompute.cost_key` the caller has already),
    only plans cheaper than it are looked for: bases are taken cheapest first, one no cheaper
    than the best found so far is skipped, and a scan stops once its prefix costs that much
    (dropping more only adds recompute). On 500-op random DAGs the scans of bases whose
    prefixes grew dearer than a plan in hand were most of a budget plan's time."""
    found: list[tuple[tuple[int, int, int], int, Plan, list[str], tuple[Segment, ...]]] = []
    bound = dearer_than
    for index, base in sorted(enumerate(bases), key=lambda item: item[1].cost_key):
        if bound is not None and base.cost_key >= bound:
            continue
        trial = _memo_trials(graph, base.segments)
        options = droppable_values(graph, base.segments, dearer_than=bound, trial=trial)
        fitting = _shortest_fitting_prefix(graph, trial, options, budget_bytes, bound)
        if fitting is not None:
            chosen, segments = fitting
            key = cost_key(graph, segments)
            found.append((key, index, base, chosen, segments))
            bound = key if bound is None else min(bound, key)
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


def droppable_values(graph: nx.DiGraph, segments: Sequence[Segment], chunk: int = 16,
                     dearer_than: tuple[int, int, int] | None = None, trial: Trials | None = None) -> Iterator[str]:
    """The values of :func:`drop_order` that ``segments`` can drop together, in that order,
    as they are found: made and saved only by ops of kept segments, each taken with those
    before it only when the plan stays valid, until :data:`DROP_REFUSALS` values have been
    refused. Each check rebuilds the whole plan (3 ms on GPT-2's 538 ops), so values are
    tried a ``chunk`` at a time (twice as many after a chunk of which none was refused), and
    in a chunk that fails the first value refused is found by :func:`_longest_valid_prefix`,
    not one by one. Lazy: a budget that a few dropped
    values meet stops the scan there (:func:`_shortest_fitting_prefix`). On a 1000-op
    residual stack, where dropping a run of values in a row makes chains too long
    (:data:`passes.remat.MAX_REMAT_OPS`), checking every value was most of a 12 s budget
    plan, and the values late in the order are the ones worth least. With ``dearer_than``
    the scan stops at the first plan it builds that costs that much
    (:func:`passes.recompute.cost_key`): dropping more only adds recompute. ``trial`` builds
    the plans (default: :func:`_memo_trials` of ``segments``)."""
    kept = {name for s in segments if not s.recompute for name in s.nodes}
    savers: dict[str, list[str]] = {}
    for name in op_nodes(graph):
        for value in graph.nodes[name]["saved"]:
            savers.setdefault(value, []).append(name)
    reachable = _reachable_from_held(graph, segments)
    todo = [v for v in drop_order(graph) if v in kept and savers.get(v) and all(s in kept for s in savers[v])
            and reachable(v)]
    trial = trial or _memo_trials(graph, segments)

    def too_dear(plan: tuple[Segment, ...]) -> bool:
        return dearer_than is not None and cost_key(graph, plan) >= dearer_than

    chosen: list[str] = []
    refused, size = 0, chunk
    while todo and refused < DROP_REFUSALS:
        block, todo = todo[:size], todo[size:]
        taken, plan = _longest_valid_prefix(trial, chosen, block, too_dear)
        chosen += block[:taken]
        yield from block[:taken]
        if plan is not None and too_dear(plan):
            return
        size = 2 * size if taken == len(block) else chunk  # a run of valid values: check more at once
        if taken < len(block):  # block[taken] is refused; the rest of the block is tried again
            refused += 1
            todo = block[taken + 1:] + todo


def _reachable_from_held(graph: nx.DiGraph, segments: Sequence[Segment]) -> Callable[[str], bool]:
    """Whether a value could be made again from what ``segments`` hold at all: its chain back
    to every value the plan holds at some segment's recompute, saves for backward, or reads
    into an op that saves something (such an op, made a one-op recomputed segment when a value
    it saved is dropped, keeps its inputs: :func:`dropped_segments`) is pure and at most
    :data:`passes.remat.MAX_REMAT_OPS` ops. That is a superset of what any plan dropping values
    on top of ``segments`` holds, and dropping values only lengthens a chain, so a value
    failing this is refused by every set the scan tries; found here in one trace rather than
    by a plan rebuild per refusal. On GPT-2 every chain through a dropout fails, and its
    refusals were most of a budget plan's time (8 bases, 99 rebuilds each)."""
    held = set().union(*held_at_each(graph, segments))
    for segment in segments:
        if not segment.recompute:
            for name in segment.nodes:
                saved = graph.nodes[name]["saved"]
                held.update((*saved, *graph.predecessors(name)) if saved else ())
    pure = pure_ops(graph)

    def reachable(value: str) -> bool:
        try:
            chain = remat_chain(graph, value, held - {value}, MAX_REMAT_OPS)
        except ChainTooLong:
            return False
        return all(name in pure for name in chain.nodes)

    return reachable


def _longest_valid_prefix(trial: Trials, chosen: list[str], block: list[str],
                          stop: Callable[[tuple[Segment, ...]], bool]) -> tuple[int, tuple[Segment, ...] | None]:
    """How many values of ``block``, from its start, can be dropped with ``chosen`` (``trial``
    builds each plan), and the plan dropping them (``None`` when none can: not built): all of
    them in one check when they can; otherwise found by galloping from the start (prefixes of
    1, 2, 4, ... values) and then bisection, taking a plan that is invalid as staying invalid
    with more values dropped (a dropped value only takes sources away from the others'
    chains). Refused values come mostly first in a block (the one refused just before it was
    the start of a run the chains cannot reach across), where galloping needs one check past
    the whole block's and bisection needed four. A valid plan for which ``stop`` holds (it
    costs too much) ends the search there: no more values are wanted."""
    plan = trial([*chosen, *block])
    if plan is not None:
        return len(block), plan
    low, high = 0, 1  # low values are known to be droppable, high are not known to be
    while high < len(block) and (built := trial([*chosen, *block[:high]])) is not None:
        if stop(built):
            return high, built
        low, high, plan = high, 2 * high, built
    high = min(high, len(block))  # known not to be droppable
    while high - low > 1:
        middle = (low + high) // 2
        built = trial([*chosen, *block[:middle]])
        if built is None:
            high = middle
        elif stop(built):
            return middle, built
        else:
            low, plan = middle, built
    return low, plan


def _trial(graph: nx.DiGraph, dropped: list[str], base: Sequence[Segment] = ()) -> tuple[Segment, ...] | None:
    """:func:`dropped_segments`, or ``None`` when the values cannot be dropped together."""
    try:
        return dropped_segments(graph, dropped, base)
    except PlanError:
        return None


Trials = Callable[[Sequence[str]], "tuple[Segment, ...] | None"]


def _memo_trials(graph: nx.DiGraph, base: Sequence[Segment]) -> Trials:
    """:func:`_trial` on top of ``base``, each set of dropped values built once: the scan for
    values to drop and the search for the shortest fitting prefix ask for the same prefixes
    (a chunk's plan is the first fit test's)."""
    built: dict[tuple[str, ...], tuple[Segment, ...] | None] = {}

    def trial(dropped: Sequence[str]) -> tuple[Segment, ...] | None:
        key = tuple(dropped)
        if key not in built:
            built[key] = _trial(graph, list(key), base)
        return built[key]

    return trial


FIRST_FIT_TEST = 16  # dropped values after which the scan first asks whether the plan fits


def _shortest_fitting_prefix(graph: nx.DiGraph, trial: Trials, options: Iterable[str], budget_bytes: float,
                             dearer_than: tuple[int, int, int] | None = None,
                             ) -> tuple[list[str], tuple[Segment, ...]] | None:
    """The shortest prefix of ``options`` whose plan fits ``budget_bytes`` and, with
    ``dearer_than``, costs less than it (:func:`passes.recompute.cost_key`), with that plan's
    segments (``trial`` builds each plan); ``None`` when there is none. ``options`` is taken lazily: the plan of the values
    taken so far is tried after :data:`FIRST_FIT_TEST` values, then each time their count
    doubles, and once one fits (or costs ``dearer_than``: a longer prefix costs more) no more
    are scanned; the shortest fitting prefix is then found by bisection since the last that
    did not fit (dropping more lowers the peak, all but always). A budget near the base's peak
    needs a few values, where checking every value droppable was most of the plan's time."""
    fitting: dict[int, tuple[Segment, ...]] = {}
    chosen: list[str] = []

    def enough(count: int) -> bool:
        """Whether no longer prefix than ``count`` is worth trying: it fits, or costs too much."""
        plan = trial(chosen[:count])
        if plan is None:
            return False
        if dearer_than is not None and cost_key(graph, plan) >= dearer_than:
            return True
        if peak_within(graph, plan, budget_bytes) is None:
            return False
        fitting[count] = plan
        return True

    low, test_at = 0, FIRST_FIT_TEST  # low: the longest prefix known not to fit (0: not known to)
    for value in options:
        chosen.append(value)
        if len(chosen) == test_at:
            if enough(test_at):
                break
            low, test_at = test_at, 2 * test_at
    else:  # every option taken: the plan dropping all of them is the last to try
        if len(chosen) == low or not enough(len(chosen)):
            return None
    high = len(chosen)  # enough
    while high - low > 1:
        middle = (low + high) // 2
        if enough(middle):
            high = middle
        else:
            low = middle
    return (chosen[:high], fitting[high]) if high in fitting else None


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
