"""Where a forward graph can be cut, and what each cut costs.

A *cut* is a down-closed set of op nodes (the values computed before the boundary); its
cost is :func:`passes.kept_bytes.boundary_bytes` of the values it hands to the rest. Three
families of cuts, cheapest to find first:

* prefix cuts of the execution order (:func:`prefix_costs`), what √n uses;
* articulation points (:func:`articulation_points`): single values every input-to-output
  path passes through;
* minimum vertex cuts inside a window of the order (:func:`min_cut_between`), which find
  multi-tensor boundaries across skip connections.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from weakref import WeakKeyDictionary

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov

from passes.graph_facts import in_order, keeps_order, node_attribute, op_nodes, output_sink, per_graph, storage_root
from passes.kept_bytes import keep_cost

INF = float("inf")


def op_positions(graph: nx.DiGraph) -> tuple[list[str], dict[str, int]]:
    """Op nodes in order and every non-param node's position among them (copies of
    :func:`op_layout`'s).

    Inputs sit at -1 (before every op) and the output sink at ``len(ops)`` (after all).
    """
    layout = op_layout(graph)
    return list(layout.ops), dict(layout.position)


def last_reader(graph: nx.DiGraph, position: dict[str, int]) -> dict[str, int]:
    """For each positioned value, the position of the last op (or sink) reading it."""
    return {name: max((position[v] for v in graph.successors(name)), default=position[name])
            for name in position}


@dataclass(frozen=True)
class OpLayout:
    """What the cut heuristics read of a cost graph's op order, found once per graph
    (:func:`op_layout`): ``ops`` in order, ``position`` (:func:`op_positions`), ``last``
    (:func:`last_reader`), ``weights`` (:func:`op_weights`) and their running sums, and
    :func:`sqrt_segment_count`. Each is a pass over every node's attribute dict, 20 ms at
    50k nodes against 1.5 ms at 10k once the dicts outgrow the caches, and three
    heuristics asked for each. Read-only."""

    ops: list[str]
    position: dict[str, int]
    last: dict[str, int]
    weights: list[float]
    cumulative: list[float]
    segment_count: int
    keep: dict[str, float]  # every positioned value's keep_cost
    root: dict[str, str]  # every positioned value's storage_root


_LAYOUTS: WeakKeyDictionary[nx.DiGraph, tuple[int, OpLayout]] = WeakKeyDictionary()


def op_layout(graph: nx.DiGraph) -> OpLayout:
    """The :class:`OpLayout` of ``graph``, memoised like :func:`passes.graph_facts.per_graph`
    (a graph still gaining nodes is laid out again)."""
    if graph not in _LAYOUTS or _LAYOUTS[graph][0] != len(graph):
        ops = op_nodes(graph)
        position = {name: index for index, name in enumerate(ops)}
        position.update((name, -1) for name, kind in graph.nodes(data="kind") if kind == "input")
        sink = output_sink(graph)
        if sink is not None:
            position[sink] = len(ops)
        weights = op_weights(graph, ops)
        roots = {name: storage_root(graph, name) for name in position}
        layout = OpLayout(ops, position, last_reader(graph, position), weights, list(accumulate(weights)),
                          sqrt_segment_count(graph), {name: keep_cost(graph, name) for name in position}, roots)
        _LAYOUTS[graph] = len(graph), layout
    return _LAYOUTS[graph][1]


@per_graph
def prefix_costs(graph: nx.DiGraph) -> list[float]:
    """``costs[i]``: bytes kept when cutting after the i-th op (``inf`` if not allowed).

    One sweep over the order: a value is open from its producer until its last reader.
    Storages kept through several views count once.
    """
    layout = op_layout(graph)
    ops, position, last, keep, roots = layout.ops, layout.position, layout.last, layout.keep, layout.root
    opened: dict[int, list[str]] = {}
    for name, pos in position.items():
        if last[name] > pos:
            opened.setdefault(pos, []).append(name)
    closing: dict[int, list[str]] = {}
    for name, pos in last.items():
        if pos > position[name]:
            closing.setdefault(pos, []).append(name)
    holders: dict[str, int] = {}
    blocked = 0
    total = 0.0
    costs: list[float] = []

    def change(name: str, step: int) -> None:
        nonlocal blocked, total
        cost = keep[name]
        if cost == INF:
            blocked += step
            return
        root = roots[name]
        before = holders.get(root, 0)
        holders[root] = before + step
        if before == 0 and step == 1:
            total += cost
        elif before == 1 and step == -1:
            total -= cost

    for name in opened.get(-1, []):
        change(name, 1)
    for index in range(len(ops)):
        for name in closing.get(index, []):
            change(name, -1)
        for name in opened.get(index, []):
            change(name, 1)
        costs.append(INF if blocked else total)
    return costs


def balanced_targets(weights: Sequence[float], segments: int) -> list[float]:
    """Cumulative-weight marks that split ``weights`` into ``segments`` equal parts."""
    total = sum(weights)
    return [total * j / segments for j in range(1, segments)]


def sqrt_segment_count(graph: nx.DiGraph) -> int:
    """Chen et al.'s √n: about √(number of ops) segments, at least one. Updates of
    ``state`` (an export-captured BatchNorm's batch counter ``add_``) are bookkeeping, not
    layers: they do not count, so a graph plans alike however its norms were captured."""
    state = node_attribute(graph, "state")
    return max(1, round(math.sqrt(sum(not state[n] for n in op_nodes(graph)))))


def op_weights(graph: nx.DiGraph, ops: Sequence[str]) -> list[float]:
    """What balancing divides evenly: each op's new bytes, or 1 each when sizes are unknown."""
    weights = list(map(float, map(node_attribute(graph, "bytes").__getitem__, ops)))
    return weights if sum(weights) > 0 else [1.0] * len(ops)


def nearest_positions(cumulative: Sequence[float], candidates: Sequence[int],
                      targets: Sequence[float]) -> list[int]:
    """For each target, the candidate position whose cumulative weight is closest; distinct
    and increasing, so each boundary comes after the previous one."""
    ordered = sorted(candidates)
    weights = [cumulative[c] for c in ordered]  # non-decreasing: cumulative weights grow with position
    chosen: list[int] = []
    for target in targets:
        start = bisect_right(ordered, chosen[-1]) if chosen else 0
        if start == len(ordered):
            break
        above = bisect_left(weights, target, lo=start)  # the first candidate at or past the target
        below = bisect_left(weights, weights[above - 1], lo=start) if above > start else None
        if below is None or (above < len(ordered) and weights[above] - target < target - weights[below]):
            chosen.append(ordered[above])
        else:
            chosen.append(ordered[below])
    return chosen


def articulation_points(graph: nx.DiGraph) -> list[str]:
    """Op values every path from the inputs to the output passes through, in order.

    These are the dominators of the output sink, seen from a virtual source feeding all
    inputs; keeping one of them alone separates everything before from everything after.
    In a DAG laid out in execution order they are the nodes on some input-to-output path
    that no edge of such a path jumps over: one sweep (networkx's dominator tree, on a copy
    of the graph, took a second at 50k nodes and grew faster than the graph).
    """
    sink = output_sink(graph)
    order = in_order(graph)
    on_path = _on_input_output_paths(graph, order, sink)
    if sink is None or sink not in on_path:
        return []
    position = {name: index for index, name in enumerate(order)}
    jumps = [0] * (len(order) + 1)  # difference array: edges of such paths passing over each position
    kind = node_attribute(graph, "kind")
    for name in on_path:
        starts = [position[p] for p in graph.predecessors(name) if p in on_path]
        if kind[name] == "input":
            starts.append(-1)  # the virtual source's edge
        for start in starts:
            jumps[start + 1] += 1
            jumps[position[name]] -= 1
    chain, over = [], 0
    for index, name in enumerate(order):
        over += jumps[index]
        if over == 0 and name in on_path and kind[name] == "op":
            chain.append(name)
    return chain


def _on_input_output_paths(graph: nx.DiGraph, order: list[str], sink: str | None) -> set[str]:
    """The nodes on some path from an input to ``sink`` that runs through no parameter."""
    reached: set[str] = set()
    kinds = node_attribute(graph, "kind")
    for name in order:
        kind = kinds[name]
        if kind == "input" or (kind != "param" and any(p in reached for p in graph.predecessors(name))):
            reached.add(name)
    if sink not in reached:
        return set()
    useful = {sink}
    for name in reversed(order):
        if name in reached and any(s in useful for s in graph.successors(name)):
            useful.add(name)
    return useful


class Frontiers:
    """The values open at each cut position, for positions asked in non-decreasing order:
    made before it and read at or after it (what :func:`min_cut_between` starts from).

    One sweep with a heap by last reader instead of a scan of every value per window, which
    made the min-cut heuristic grow as n^1.5 (0.2 s a window at 50k nodes). Values come
    in ``position``'s order, as that scan gave them.
    """

    def __init__(self, position: dict[str, int], last: dict[str, int]) -> None:
        self.rank = {name: index for index, name in enumerate(position)}
        self.pending = sorted(position, key=lambda name: (position[name], self.rank[name]))
        self.position, self.last = position, last
        self.next = 0
        self.open: list[tuple[int, int, str]] = []  # (last reader, rank, name)

    def at(self, low: int) -> list[str]:
        """The values with ``position < low <= last``."""
        while self.next < len(self.pending) and self.position[self.pending[self.next]] < low:
            name = self.pending[self.next]
            heapq.heappush(self.open, (self.last[name], self.rank[name], name))
            self.next += 1
        while self.open and self.open[0][0] < low:
            heapq.heappop(self.open)
        return [name for _, _, name in sorted(self.open, key=lambda entry: entry[1])]


def min_cut_between(graph: nx.DiGraph, ops: Sequence[str], position: dict[str, int],
                    last: dict[str, int], low: int, high: int,
                    mark: int | None = None, frontier: Sequence[str] | None = None,
                    keep: Mapping[str, float] | None = None) -> tuple[float, set[str]] | None:
    """The cheapest cut that computes ``ops[:low]`` before it and ``ops[high:]`` after.

    Vertex cut on the node-split graph (``v_in -> v_out`` costs keeping ``v``), with
    reverse edges so the before-side is down-closed, and so a random op is only before
    the cut if every earlier random op is. Among cuts of equal bytes the one
    nearest ``mark`` wins (a tie-break folded into the capacities). Returns ``(bytes,
    window ops before the cut)``, or ``None`` when every boundary in the window holds a
    value that may not be kept. ``frontier``: the values open at ``low``, when the caller
    has them (:class:`Frontiers`); ``keep``: :func:`passes.kept_bytes.keep_cost` of every
    value, when the caller has them (:attr:`OpLayout.keep`).

    The flow is Boykov-Kolmogorov's: 1.5-3.7x faster than Edmonds-Karp's here (500-op and
    3000-op random DAGs, 2k-10k-node transformer and residual stacks), and Edmonds-Karp was
    2-3x faster than networkx's default preflow-push, which allocates two sets per possible
    height each call. The side of the cut is the same for any maximum flow: the nodes that
    cannot reach the sink in the residual graph; an all-uncuttable path raises
    ``NetworkXUnbounded`` in each.
    """
    source, sink = ("__source__",), ("__sink__",)
    flow = nx.DiGraph()
    if frontier is None:
        frontier = [n for n, pos in position.items() if pos < low <= last[n]]
    window = ops[low:high]
    scale = (len(frontier) + len(window) + 1) * (len(ops) + 2)  # every tie-break sum stays below it
    mark = (low + high) // 2 if mark is None else mark

    def add_value(name: str) -> None:
        cost = keep_cost(graph, name) if keep is None else keep[name]
        tie_break = abs(position[name] - mark)
        attributes = {} if cost == INF else {"capacity": int(cost) * scale + tie_break}
        flow.add_edge((name, "in"), (name, "out"), **attributes)
        if last[name] >= high:
            flow.add_edge((name, "out"), sink)

    for name in frontier:
        add_value(name)
        flow.add_edge(source, (name, "in"))
    ordered = [name for name in window if keeps_order(graph, name)]
    for earlier, later in pairwise(ordered):
        flow.add_edge((later, "in"), (earlier, "in"))  # random draws and in-place writes keep their order
    for name in window:
        add_value(name)
        for reader in graph.successors(name):
            if low <= position.get(reader, -2) < high:
                flow.add_edge((name, "out"), (reader, "in"))
        for producer in graph.predecessors(name):
            if producer in position:
                flow.add_edge((name, "in"), (producer, "in"))
                flow.add_edge((producer, "out"), (name, "in"))
    if not window and not frontier:
        return 0.0, set()
    flow.add_nodes_from((source, sink))
    try:
        value, (before, _) = nx.minimum_cut(flow, source, sink, flow_func=boykov_kolmogorov)
    except nx.NetworkXUnbounded:
        return None
    return float(value // scale), {name for name in window if (name, "in") in before}
