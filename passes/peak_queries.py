"""Questions about a plan's simulated peak cheaper than a whole replay: does it fit under a
limit, and what can it not go below.

The plan searches try thousands of plans and ask of each only whether it fits a budget (or
beats a peak in hand). :func:`peak_within` answers with a replay of
:func:`passes.simulate.step_peak` that stops where the peak goes above the limit, and keeps
what each replay found so a plan tried again is not replayed; :func:`forward_floor` is a
lower bound on the peak in O(kept values), for trials that need no replay at all.

>>> import networkx as nx
>>> from passes.costgraph import add_value
>>> from passes.simulate import eager_segments, step_peak
>>> g = nx.DiGraph()
>>> add_value(g, "x", kind="input", order=0, bytes=8, requires_grad=False)
>>> add_value(g, "a", kind="op", order=1, bytes=100, reads=["x"], saved=("x",))
>>> add_value(g, "b", kind="op", order=2, bytes=100, reads=["a"], saved=("a",))
>>> add_value(g, "out", kind="output", order=3, bytes=0, reads=["b"])
>>> eager = eager_segments(g)
>>> step_peak(g, eager), peak_within(g, eager, 1000), peak_within(g, eager, 500)
(600, 600, None)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx

from passes.graph_facts import leaves_nothing, per_graph_value, storage_root
from passes.hooked import keeps_by_hooks
from passes.hooked_lifetimes import last_needed
from passes.remat import kept_inputs
from passes.segments import Segment
from passes.sim_memory import LimitExceeded
from passes.simulate import step_peak


def forward_floor(graph: nx.DiGraph, segments: Iterable[Segment]) -> int:
    """Bytes alive when forward ends that a plan cannot avoid: the inputs of its recomputed
    segments and the values they keep from forward (those backward needs, for a segment run by
    hooks), each storage once. A lower bound on
    its simulated peak, in O(kept values): a plan above the budget by this alone need not
    be simulated."""
    segments = [s for s in segments if s.recompute]
    roots: set[str] = set()
    for segment in segments:
        if leaves_nothing(graph, segment):
            continue
        values = (*kept_inputs(segment), *segment.saved_inside)
        if keeps_by_hooks(graph, segment):
            needed = last_needed(graph, segment)
            values = tuple(v for v in values if v in needed)
        roots.update(storage_root(graph, value) for value in values)
    inner = sum(graph.nodes[value]["selective_extra_bytes"] for segment in segments for value in segment.saved_inside)
    return inner + sum(graph.nodes[root]["bytes"] for root in roots if graph.nodes[root]["kind"] == "op")


REPLAYS_KEPT = 4096  # replays remembered per graph: one fit_budget of a 500-op graph tries ~1500 plans, and a
# graph planned at many budgets (a benchmark's) would otherwise hold every plan of every search


def peak_within(graph: nx.DiGraph, segments: Iterable[Segment], limit: float) -> int | None:
    """A plan's simulated peak when it is at most ``limit`` bytes, else ``None``, found by a
    replay that stops where the peak goes above: the plan searches ask of each trial only
    whether it fits (or beats a peak), and a trial that does not is dropped for part of a
    simulation (at 50k nodes the √n candidate of :func:`passes.heuristics.auto_plan` went
    above the articulation plan's peak early in backward). A plan replayed before is not
    replayed again when what that replay found answers (:func:`_replays`)."""
    segments = tuple(segments)
    replays = _replays(graph)
    known = replays.get(segments)
    if known is not None and (known.whole or known.peak > limit):
        return None if known.peak > limit and known.peak > 0 else known.peak  # (a step holding nothing never stops)
    if len(replays) >= REPLAYS_KEPT:  # the oldest first: a search asks again of what it tried last
        del replays[next(iter(replays))]
    try:
        peak = step_peak(graph, segments, limit)
    except LimitExceeded as over:
        replays[segments] = _Replay(over.args[0], whole=False)
        return None
    replays[segments] = _Replay(peak, whole=True)
    return peak


@dataclass(frozen=True)
class _Replay:
    """What one replay of a plan found: its ``peak``, or (``whole`` false) a peak it passed
    before it stopped above its limit, a lower bound on the plan's."""

    peak: int
    whole: bool


@per_graph_value
def _replays(graph: nx.DiGraph) -> dict[tuple[Segment, ...], _Replay]:
    """The replays :func:`peak_within` made of ``graph``'s plans (a cache filled as asked).
    The plan searches try some plans more than once (on 500-op random graphs one keep
    search trial in eight is a plan an earlier trial found above the same budget)."""
    return {}


def peak_exceeds(graph: nx.DiGraph, segments: Iterable[Segment], limit: float) -> bool:
    """Whether a plan's simulated peak goes above ``limit`` bytes (:func:`peak_within`)."""
    return peak_within(graph, segments, limit) is None
