"""Dropping values on top of a plan, on graphs of any size: a lazy scan, not a greedy.

:func:`passes.drops.drop_plan` tries one simulation per value, which only small graphs afford.
:func:`drops_on_top` takes a plan (a *base*: the dynamic program's, a flat candidate) and
drops the values of :func:`passes.drops.drop_order` it can drop together, cheapest to make
again per byte first, until the plan fits: each check of a set rebuilds the whole plan, so
values are checked a chunk at a time (:func:`droppable_values`), fit is asked at doubling
counts and then bisected (:func:`_shortest_fitting_prefix`), and a plan in hand bounds the
cost a scan may reach. A transformer's plan keeps its matmul outputs and drops the pointwise
values between them, what torch.compile's partitioner recomputes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import networkx as nx

from passes.drops import drop_order, dropped_or_none
from passes.graph_facts import op_nodes, pure_ops
from passes.peak_queries import peak_within
from passes.plan import Plan, plan_of_segments
from passes.recompute import cost_key
from passes.remat import MAX_REMAT_OPS, ChainTooLong, held_at_each, remat_chain
from passes.segments import Segment
from passes.simulate import eager_segments

DROPS_MAX_OPS = 1500  # larger graphs: each validity check walks the whole plan, ~30 ms at 10k ops


def drops_on_top(graph: nx.DiGraph, bases: Sequence[Plan], budget_bytes: float,
                 dearer_than: tuple[int, int, int] | None = None) -> Plan | None:
    """The cheapest plan fitting ``budget_bytes`` made by dropping values on top of one of
    ``bases`` (:func:`passes.drops.dropped_segments`): for each base, the shortest prefix of the values it
    could drop (:func:`droppable_values`) that fits (:func:`_shortest_fitting_prefix`). For
    graphs of any size, where :func:`passes.drops.drop_plan`'s greedy takes a simulation per value: a
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
        options = droppable_runs(graph, base.segments, dearer_than=bound, trial=trial)
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
    """:func:`droppable_runs`, value by value."""
    for run in droppable_runs(graph, segments, chunk, dearer_than, trial):
        yield from run


def droppable_runs(graph: nx.DiGraph, segments: Sequence[Segment], chunk: int = 16,
                   dearer_than: tuple[int, int, int] | None = None, trial: Trials | None = None) -> Iterator[list[str]]:
    """The values of :func:`passes.drops.drop_order` that ``segments`` can drop together, in that order,
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
    the plans (default: :func:`_memo_trials` of ``segments``). Yields the values a check
    took at a time: the plan dropping every value yielded so far has just been built."""
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
        taken, plan = _longest_valid_prefix(trial, chosen, block, too_dear, gallop=size == chunk)
        chosen += block[:taken]
        if taken:
            yield block[:taken]
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
    it saved is dropped, keeps its inputs: :func:`passes.drops.dropped_segments`) is pure and at most
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
                          stop: Callable[[tuple[Segment, ...]], bool],
                          gallop: bool = True) -> tuple[int, tuple[Segment, ...] | None]:
    """How many values of ``block``, from its start, can be dropped with ``chosen`` (``trial``
    builds each plan), and the plan dropping them (``None`` when none can: not built): all of
    them in one check when they can; otherwise found by galloping from the start (prefixes of
    1, 2, 4, ... values) and then bisection, taking a plan that is invalid as staying invalid
    with more values dropped (a dropped value only takes sources away from the others'
    chains). Refused values come mostly first in a block (the one refused just before it was
    the start of a run the chains cannot reach across), where galloping needs one check past
    the whole block's and bisection needed four. In a block grown after a run of valid ones
    (``gallop=False``) the value refused is anywhere, and the search bisects from the start: on
    500-op DAGs at 0.3 of eager, galloping through a 256-value block took ten plan builds
    where bisection takes three. A valid plan for which ``stop`` holds (it costs too much)
    ends the search there: no more values are wanted."""
    plan = trial([*chosen, *block])
    if plan is not None:
        return len(block), plan
    low, high = 0, 1 if gallop else len(block)  # low values are known to be droppable, high are not known to be
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


Trials = Callable[[Sequence[str]], "tuple[Segment, ...] | None"]


def _memo_trials(graph: nx.DiGraph, base: Sequence[Segment]) -> Trials:
    """:func:`passes.drops.dropped_or_none` on top of ``base``, each set of dropped values built once: the scan for
    values to drop and the search for the shortest fitting prefix ask for the same prefixes
    (a chunk's plan is the first fit test's)."""
    built: dict[tuple[str, ...], tuple[Segment, ...] | None] = {}

    def trial(dropped: Sequence[str]) -> tuple[Segment, ...] | None:
        key = tuple(dropped)
        if key not in built:
            built[key] = dropped_or_none(graph, list(key), base)
        return built[key]

    return trial


FIRST_FIT_TEST = 16  # dropped values after which the scan first asks whether the plan fits


class _Hopeless(Exception):
    """A prefix of dropped values costs too much and still does not fit: no shorter one fits."""


def _shortest_fitting_prefix(graph: nx.DiGraph, trial: Trials, runs: Iterable[list[str]], budget_bytes: float,
                             dearer_than: tuple[int, int, int] | None = None,
                             ) -> tuple[list[str], tuple[Segment, ...]] | None:
    """The shortest prefix of the values in ``runs`` whose plan fits ``budget_bytes`` and,
    with ``dearer_than``, costs less than it (:func:`passes.recompute.cost_key`), with that
    plan's segments (``trial`` builds each plan); ``None`` when there is none. ``runs`` is
    taken lazily (:func:`droppable_runs`): the plan of the values taken so far is tried once
    :data:`FIRST_FIT_TEST` values are taken, then each time their count has doubled, at the
    end of a run (whose plan the scan has just built), and once one fits (or costs
    ``dearer_than``: a longer prefix costs more) no more are scanned; the shortest fitting
    prefix is then found by bisection since the last that did not fit (dropping more lowers
    the peak, all but always). A budget near the base's peak needs a few values, where
    checking every value droppable was most of the plan's time. A prefix that costs
    ``dearer_than`` is simulated too: when it does not fit, no shorter one does, and the
    scan ends there with nothing (on 500-op DAGs at 0.3 of eager the bisection that followed
    was a third of the scan's plan builds, for the same answer)."""
    fitting: dict[int, tuple[Segment, ...]] = {}
    peaks: dict[int, int] = {}  # the simulated peak of each fitting prefix
    chosen: list[str] = []

    def enough(count: int) -> bool:
        """Whether no longer prefix than ``count`` is worth trying: it fits, or costs too much."""
        plan = trial(chosen[:count])
        if plan is None:
            return False
        peak = peak_within(graph, plan, budget_bytes)
        if peak is not None:
            peaks[count] = peak
        if dearer_than is not None and cost_key(graph, plan) >= dearer_than:
            if peak is None:
                raise _Hopeless
            return True  # and never the answer: it costs too much
        if peak is not None:
            fitting[count] = plan
        return peak is not None

    low, test_at = 0, FIRST_FIT_TEST  # low: the longest prefix known not to fit (0: not known to)
    try:
        for run in runs:
            chosen += run
            if len(chosen) >= test_at:
                if enough(len(chosen)):
                    break
                low, test_at = len(chosen), 2 * len(chosen)
        else:  # every run taken: the plan dropping all of them is the last to try
            if len(chosen) == low or not enough(len(chosen)):
                return None
        high = len(chosen)  # enough
        while high - low > 1:
            probe = _next_probe(graph, chosen, low, high, peaks, budget_bytes)
            if enough(probe):
                high = probe
            else:
                low = probe
    except _Hopeless:
        return None
    return (chosen[:high], fitting[high]) if high in fitting else None


def _next_probe(graph: nx.DiGraph, chosen: Sequence[str], low: int, high: int, peaks: dict[int, int],
                budget_bytes: float) -> int:
    """The prefix length of ``chosen`` to try next between ``low`` (does not fit) and
    ``high`` (fits): where the plan is estimated to meet the budget, else the middle. Each
    value given back is taken to raise the peak as much as it rose per value between the two
    fitting prefixes nearest above (``peaks``: the simulated peak of each), or, with one
    known, by its own bytes (a value held again through the peak raises it by that much, and
    most are not: the guess mostly fits, a few values over the shortest). The answer is the
    bisection's (the shortest prefix that fits, dropping more lowering the peak); on
    ``scripts/planner_gap.py``'s 500-op DAGs at 0.7 of eager the scans' fit tests went from
    80 to 50 over the 8 graphs, and at 0.3 a graph's from 7 to 3 past its first fitting
    prefix (its drop scan 0.54 -> 0.37 s of a 1.07 s plan)."""
    middle = (low + high) // 2
    if high not in peaks:  # (never so: a prefix known to fit or cost too much fits)
        return middle
    slack = budget_bytes - peaks[high]
    above = [count for count in peaks if count > high]
    if above:
        nearest = min(above)
        per_value = (peaks[high] - peaks[nearest]) / (nearest - high)
        guess = high - int(slack // per_value) if per_value > 0 else low
    else:
        guess, freed = high, 0
        while guess > low and freed + graph.nodes[chosen[guess - 1]]["bytes"] <= slack:
            guess -= 1
            freed += graph.nodes[chosen[guess]]["bytes"]
    guess = min(guess, high - 1)
    return guess if guess > low else middle
