"""Local search over plans of small graphs: what the dynamic program's estimates miss.

The dynamic program (:mod:`passes.optimal`) plans on a chain of prefix cuts with estimated
memory; on a graph with skip connections its estimates count a long-lived value once per
boundary it crosses, and its floor and its plans near the budget sit above what the same
plan space reaches (on 16-op random DAGs, a search found plans 5-20% below its floor). On
small graphs a simulation costs well under a millisecond, so a hill climb over plan layouts
that asks the simulator directly is affordable.

A :class:`PlanLayout` describes a plan by flags over the op positions: where top-level segments
start and whether each is recomputed, where the children of a recomputed segment start and
whether each is recomputed again, and which values recomputed segments keep from forward
(:mod:`passes.keeps`), and which inputs they drop after forward and rematerialize
(:mod:`passes.remat`). A move flips one flag; it is kept when the plan's score is no worse:
first how far its simulated peak is over the budget, then its recompute
(:attr:`passes.plan.Plan.cost_key`). Moves are drawn from a seeded generator: the same graph
and budget give the same plan.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from passes.cuts import op_layout
from passes.graph_facts import op_nodes
from passes.kept_bytes import boundary_bytes
from passes.kept_values import keepable, keeping
from passes.peak_queries import peak_within
from passes.plan import Plan, plan_of_segments
from passes.recompute import cost_key
from passes.remat import rematerializable, with_remat
from passes.segments import PlanError, Segment, make_segments, nested
from passes.simulate import simulate

SEARCH_MAX_OPS = 64  # larger graphs: too few moves for the time a simulation takes there
SEARCHED_OPS = 24000  # ops x moves of a search's first climbs: 1500 moves at 16 ops, 375 at 64
FURTHER_PLANS = 600  # plans scored as the climbs go on (fewer over 40 ops: SEARCHED_OPS // ops)
FURTHER_MOVES_PER_PLAN = 4  # moves the climbs going on may make per plan scored (most flip a flag nothing reads)


@dataclass
class PlanLayout:
    """A plan as flags over op positions (lists, changed in place by moves)."""

    top_start: list[bool]  # a top-level segment starts here (always at 0)
    top_recompute: list[bool]  # read at a top segment's start
    child_start: list[bool]  # inside a recomputed top segment: a child starts here
    child_recompute: list[bool]  # read at a child's start
    keep: list[bool]  # kept from forward by the recomputed segment (or child) it sits in
    remat: list[bool]  # dropped after forward by the recomputed segments it is an input of (passes.remat)

    def flags(self) -> list[list[bool]]:
        return [self.top_start, self.top_recompute, self.child_start, self.child_recompute, self.keep, self.remat]

    def state(self) -> tuple[tuple[bool, ...], ...]:
        """The flags as they are now, hashable."""
        return tuple(tuple(flags) for flags in self.flags())


def _runs(starts: Sequence[bool], first: int, last: int) -> list[tuple[int, int]]:
    """Positions ``first..last`` cut where ``starts`` says, as ``(start, end)`` pairs."""
    runs, begin = [], first
    for position in range(first + 1, last + 1):
        if starts[position]:
            runs.append((begin, position - 1))
            begin = position
    runs.append((begin, last))
    return runs


def build(graph: nx.DiGraph, layout: PlanLayout, memo: dict | None = None) -> tuple[Segment, ...]:
    """The segments a layout describes: runs of the op order made by
    :func:`passes.segments.make_segments` (which splits out what may not be recomputed and
    keeps runs with an uncuttable edge), so valid but for a nested parent over such ops or
    edges: :class:`PlanError` then. ``memo`` caches the segments of each run across calls."""
    ops, memo = op_nodes(graph), {} if memo is None else memo

    def run(start: int, end: int, recompute: bool) -> tuple[Segment, ...]:
        if (start, end, recompute) not in memo:
            memo[start, end, recompute] = make_segments(graph, [(ops[start:end + 1], recompute)])
        return memo[start, end, recompute]

    keep = {ops[p] for p, flag in enumerate(layout.keep) if flag}
    segments: list[Segment] = []
    for start, end in _runs(layout.top_start, 0, len(ops) - 1):
        if not layout.top_recompute[start]:
            segments += run(start, end, False)
            continue
        children = _runs(layout.child_start, start, end)
        if len(children) == 1:
            segments += keeping(run(start, end, True), keep)
            continue
        inner = [s for a, b in children for s in keeping(run(a, b, layout.child_recompute[a]), keep)]
        parent = nested(graph, inner)
        if not all(graph.nodes[n]["recomputable"] for n in parent.nodes) or \
                boundary_bytes(graph, (*parent.inputs, *parent.outputs)) == float("inf"):
            raise PlanError("a nested segment over ops that may not be recomputed, or with an uncuttable edge")
        segments.append(parent)
    remat = {ops[p] for p, flag in enumerate(layout.remat) if flag}
    if not remat:
        return tuple(segments)
    picks = [(i, v) for i, s in enumerate(segments) if s.recompute for v in s.inputs if v in remat]
    return with_remat(graph, segments, picks, PlanError)


def layout_of(graph: nx.DiGraph, segments: Sequence[Segment]) -> PlanLayout:
    """The layout nearest ``segments``: children of children are read as one child."""
    position, n = op_layout(graph).position, len(op_nodes(graph))
    layout = PlanLayout(*([False] * n for _ in range(6)))
    for segment in segments:
        first = position[segment.nodes[0]]
        layout.top_start[first], layout.top_recompute[first] = True, segment.recompute
        for child in segment.children:
            at = position[child.nodes[0]]
            layout.child_start[at], layout.child_recompute[at] = True, child.recompute
        for inner in (segment, *segment.children):
            for name in inner.saved_inside:
                layout.keep[position[name]] = True
        for remat in segment.remat:
            layout.remat[position[remat.value]] = True
    return layout


def score(graph: nx.DiGraph, segments: Sequence[Segment], budget_bytes: float) -> tuple:
    """What the search lowers: bytes over the budget, then recompute."""
    return ranked(simulate(graph, segments).peak_bytes, cost_key(graph, segments), budget_bytes)


def ranked(peak_bytes: float, key: tuple, budget_bytes: float) -> tuple:
    """:func:`score` of a plan whose peak and :attr:`Plan.cost_key` are known."""
    return (max(0, peak_bytes - budget_bytes), *key)


def score_if_no_worse(graph: nx.DiGraph, segments: Sequence[Segment], budget_bytes: float, bar: tuple) -> tuple | None:
    """:func:`score` of ``segments`` when it is no worse than ``bar``, else ``None``, asking
    the simulator as little as that takes: beside a plan that fits, one recomputing more is
    worse whatever its peak (no replay), and a replay stops once the peak is further over the
    budget than ``bar``'s (:func:`passes.peak_queries.peak_within`). Most of a search's moves are
    rejected, so this is what its time goes on."""
    key = cost_key(graph, segments)
    if bar[0] == 0 and key > bar[1:]:
        return None
    peak = peak_within(graph, segments, budget_bytes + bar[0])
    if peak is None:
        return None
    trial = ranked(peak, key, budget_bytes)
    return trial if trial <= bar else None


def _top_start(layout: PlanLayout, position: int) -> int:
    """Where the top-level segment holding ``position`` starts."""
    while position > 0 and not layout.top_start[position]:
        position -= 1
    return position


def unread(graph: nx.DiGraph, layout: PlanLayout, kind: int, position: int) -> bool:
    """Whether :func:`build` certainly ignores flag ``kind`` at ``position`` of ``layout``
    (the flags of :meth:`PlanLayout.flags`): a flip there gives the same plan, so a search
    need not build it. Conservative: ``False`` says only that the flag may be read.

    >>> from passes.costgraph import add_value
    >>> g = nx.DiGraph()
    >>> add_value(g, "a", kind="op", order=0, bytes=8)
    >>> add_value(g, "b", kind="op", order=1, bytes=8, reads=["a"])
    >>> add_value(g, "c", kind="op", order=2, bytes=8, reads=["b"])
    >>> kept = PlanLayout([True, False, False], *([False] * 3 for _ in range(5)))
    >>> unread(g, kept, 1, 0), unread(g, kept, 1, 1), unread(g, kept, 2, 1), unread(g, kept, 5, 0)
    (False, True, True, True)
    """
    if kind == 0:
        return False
    start = _top_start(layout, position)
    if kind == 1:
        return start != position
    if kind == 5:  # read when a consumer sits in a recomputed top segment
        at, ops = op_layout(graph).position, op_nodes(graph)
        users = (at[user] for user in graph.successors(ops[position]) if 0 <= at.get(user, -1) < len(ops))
        return not any(layout.top_recompute[_top_start(layout, user)] for user in users)
    if not layout.top_recompute[start]:
        return True
    if kind == 2:
        return position == start
    if kind == 3:
        end = position + 1
        while end < len(layout.top_start) and not layout.top_start[end]:
            end += 1
        only_child = not any(layout.child_start[start + 1:end])
        return only_child or not (position == start or layout.child_start[position])
    return False


def _climb(graph: nx.DiGraph, segments: tuple[Segment, ...], budget_bytes: float, rng: random.Random,
           choices: dict[int, list[int]], *, moves: int, plans: int, memo: dict) -> tuple[tuple, tuple[Segment, ...]]:
    """One hill climb from ``segments``: each move flips one flag (positions of keeps and
    rematerialized inputs from ``choices``) and is kept when the plan is no worse
    (:func:`score_if_no_worse`). Ends after ``moves`` moves or ``plans`` plans scored,
    whichever comes first. Returns the score and segments it ends at."""
    ops = op_nodes(graph)
    layout = layout_of(graph, segments)
    current = (score(graph, segments, budget_bytes), segments)
    try:  # whether the layout builds the current plan, so a flag nothing reads changes nothing
        built = build(graph, layout, memo) == segments
    except PlanError:
        built = False
    rejected: set[tuple] = set()  # layouts found no better than the current plan (most moves
    scored = 0  # are rejected, and the next move from the same plan often repeats one)
    for _ in range(moves):
        if scored >= plans:
            break
        kind = rng.randrange(6)
        if kind in choices and not choices[kind]:
            continue
        position = rng.choice(choices[kind]) if kind in choices else rng.randrange(1 if kind in (0, 2) else 0, len(ops))
        flags = layout.flags()[kind]
        flags[position] = not flags[position]
        state = layout.state()
        if state in rejected or (built and unread(graph, layout, kind, position)):
            rejected.add(state)  # (no plan but the current one: see below)
            flags[position] = not flags[position]
            continue
        try:
            found = build(graph, layout, memo)
        except PlanError:
            found = current[1]  # rejected below, like a flag nothing reads
        trial = None
        if found != current[1]:  # (a flag nothing reads here, or a layout that is no plan: rejected)
            scored += 1
            trial = score_if_no_worse(graph, found, budget_bytes, current[0])
        if trial is not None:
            current, built = (trial, found), True
            rejected.clear()
        else:
            rejected.add(state)
            flags[position] = not flags[position]
    return current


def search(graph: nx.DiGraph, starts: Sequence[Plan], budget_bytes: float, seed: int = 0,
           remat: bool = True) -> Plan | None:
    """The best plan hill climbs from each of ``starts`` find: the least over ``budget_bytes``,
    then the least recompute (it may not fit; ``None`` for graphs over :data:`SEARCH_MAX_OPS`
    ops). ``remat=False`` leaves out the moves that rematerialize segment inputs (the plan
    space before them).

    Each start gets an even part of :data:`SEARCHED_OPS` in moves, drawn from one seeded
    generator (the same graph and budget give the same plan); then the climb goes on from
    where it ended with a generator of its own for :data:`FURTHER_PLANS` plans scored. It
    only ever takes a plan no worse, so the search never returns worse than the first climbs
    alone, and a seeded hill climb stopped early is often on a plateau with better plans
    further on: on 40-op random DAGs at 0.3 of eager, 8x as many moves recomputed 22-30% less."""
    ops = op_nodes(graph)
    if len(ops) > SEARCH_MAX_OPS or not starts or len(ops) < 2:
        return None
    rng = random.Random(seed)
    keepable_at = [p for p, name in enumerate(ops) if keepable(graph, name)]
    remat_at = [p for p, name in enumerate(ops) if remat and rematerializable(graph, name)]
    choices = {4: keepable_at, 5: remat_at}
    moves = SEARCHED_OPS // len(ops) // len(starts)
    further = min(FURTHER_PLANS, SEARCHED_OPS // len(ops)) // len(starts)
    best: tuple | None = None
    memo: dict = {}
    for index, start in enumerate(starts):
        current = _climb(graph, start.segments, budget_bytes, rng, choices, moves=moves, plans=moves, memo=memo)
        onward = random.Random(f"{seed}/{index}")
        current = _climb(graph, current[1], budget_bytes, onward, choices,
                         moves=FURTHER_MOVES_PER_PLAN * further, plans=further, memo=memo)
        if best is None or current[0] < best[0]:
            best = current
    if best is None:
        return None
    return plan_of_segments(graph, starts[0].strategy, best[1], starts[0].notes)


SEEDS_BELOW_FLOOR = 4  # climbs toward a budget below every plan in hand where no exact floor is solved


def search_seeds(graph: nx.DiGraph, starts: Sequence[Plan], budget_bytes: float, seeds: int) -> Plan | None:
    """The best plan :func:`search` finds from each of ``seeds`` seeds in turn (the least
    over ``budget_bytes``, then the least recompute), stopping at the first that fits.

    Below the floor of every plan in hand a climb's end depends on its draws: on the corpus's
    in-place residual MLP under bf16 autocast (44 ops, no exact floor: more than
    :data:`passes.exact.EXACT_MAX_OPS`), asked for 1 byte, 2 of 8 seeds end below
    2.40 MiB (2,498,248 and 2,503,304 B) and the other 6 at 2.52 MiB, about 0.4 s a climb."""
    best: Plan | None = None
    for seed in range(seeds):
        found = search(graph, starts, budget_bytes, seed=seed)
        if found is None:
            return best
        if best is None or ranked(found.peak_bytes, found.cost_key, budget_bytes) < ranked(
                best.peak_bytes, best.cost_key, budget_bytes):
            best = found
        if best.peak_bytes <= budget_bytes:
            return best
    return best
