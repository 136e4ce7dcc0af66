"""Property tests of :mod:`passes.cuts` on random cost graphs (pure networkx, no torch): the
min-cut search against a brute force over all down-closed cuts, prefix costs, articulation
points and the bisection that places boundaries."""

from __future__ import annotations

import networkx as nx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from passes.costgraph import add_value
from passes.cuts import (
    INF,
    articulation_points,
    last_reader,
    min_cut_between,
    nearest_positions,
    op_positions,
    prefix_costs,
)
from passes.graph_facts import keeps_order, op_nodes
from passes.kept_bytes import boundary, boundary_bytes, keep_cost
from tests.cost_graph_draws import SETTINGS, CostGraph, cost_graphs

# --- min-cut -----------------------------------------------------------------------------


def _cut_cost(graph: nx.DiGraph, ops: list[str], low: int, window_before: set[str]) -> float:
    """Bytes of keeping what ``ops[:low] ∪ window_before ∪ inputs`` hands to the rest:
    one ``keep_cost`` per value read from outside, no storage dedup."""
    before = set(ops[:low]) | window_before | {n for n, k in graph.nodes(data="kind") if k == "input"}
    return sum((keep_cost(graph, v) for v in before
                if any(r not in before for r in graph.successors(v))), 0.0)


def _down_closed_subsets(graph: nx.DiGraph, window: list[str]):
    """Every subset of ``window`` holding the window predecessors of each of its ops, and
    the earlier ordered ops of each ordered op (they keep their eager order)."""
    inside = set(window)
    ordered = [n for n in window if keeps_order(graph, n)]

    def extend(index: int, chosen: set[str]):
        if index == len(window):
            yield set(chosen)
            return
        yield from extend(index + 1, chosen)
        name = window[index]
        earlier = ordered[: ordered.index(name)] if name in ordered else []
        if all(p in chosen for p in graph.predecessors(name) if p in inside) and all(e in chosen for e in earlier):
            chosen.add(name)
            yield from extend(index + 1, chosen)
            chosen.discard(name)

    yield from extend(0, set())


@st.composite
def windows(draw, max_ops: int = 30):
    graph = draw(cost_graphs(max_ops=max_ops))
    ops = op_nodes(graph)
    low = draw(st.integers(0, len(ops)))
    high = draw(st.integers(low, len(ops)))
    mark = draw(st.one_of(st.none(), st.integers(low, max(low, high - 1))))
    return graph, low, high, mark


def _check_min_cut(graph: nx.DiGraph, low: int, high: int, mark: int | None, brute_force: bool) -> None:
    ops, position = op_positions(graph)
    last = last_reader(graph, position)
    found = min_cut_between(graph, ops, position, last, low, high, mark)
    window = ops[low:high]
    best = min(_cut_cost(graph, ops, low, w) for w in _down_closed_subsets(graph, window)) \
        if brute_force else None
    if found is None:
        if brute_force:
            assert best == INF, f"None returned but a cut of {best} bytes exists"
        return
    nbytes, before = found
    assert before <= set(window), "the before-set holds only window ops"
    op_set = set(ops)
    computed = set(ops[:low]) | before
    for name in before:
        missing = [p for p in graph.predecessors(name) if p in op_set and p not in computed]
        assert not missing, f"{name} is before the cut but reads {missing} after it"
    assert not any(position[n] >= high for n in before)
    ordered = [n for n in window if keeps_order(graph, n)]
    assert all(set(ordered[: ordered.index(n)]) <= before for n in before if n in ordered), "order broken"
    cost = _cut_cost(graph, ops, low, before)
    assert nbytes == cost, f"reported {nbytes} bytes, the boundary it implies keeps {cost}"
    assert cost < INF
    if brute_force:
        assert nbytes == best, f"reported {nbytes} bytes, brute force finds {best}"


@SETTINGS
@given(case=windows(max_ops=30))
def test_min_cut_between_is_a_down_closed_separating_cut(case) -> None:
    graph, low, high, mark = case
    _check_min_cut(graph, low, high, mark, brute_force=False)


@SETTINGS
@given(case=windows(max_ops=12))
def test_min_cut_between_matches_brute_force(case) -> None:
    graph, low, high, mark = case
    _check_min_cut(graph, low, high, mark, brute_force=True)


def many_free_inputs() -> CostGraph:
    """Ten inputs (free to keep) read by one op of 1 byte."""
    graph = CostGraph()
    inputs = [f"x{i}" for i in range(10)]
    for order, name in enumerate(inputs):
        add_value(graph, name, kind="input", order=order, bytes=4)
    add_value(graph, "op", kind="op", order=10, bytes=1, reads=inputs)
    add_value(graph, "output", kind="output", order=11, bytes=0, reads=["op"])
    return graph


@settings(max_examples=60, deadline=None)
@given(graph=cost_graphs(max_ops=3, inputs=(4, 12), max_reads=12))
@example(graph=many_free_inputs())
def test_min_cut_between_with_many_inputs_matches_brute_force(graph: nx.DiGraph) -> None:
    """Inputs cost nothing to keep, however many of them cross the cut."""
    ops = op_nodes(graph)
    for low in range(len(ops) + 1):
        for high in range(low, len(ops) + 1):
            _check_min_cut(graph, low, high, None, brute_force=True)


def test_min_cut_between_many_free_inputs_example() -> None:
    """Ten inputs read by one op: keeping the inputs costs 0 bytes, keeping the op 1."""
    graph = many_free_inputs()
    ops, position = op_positions(graph)
    found = min_cut_between(graph, ops, position, last_reader(graph, position), 0, 1, 0)
    assert found == (0.0, set())


# --- prefix costs and articulation points ---------------------------------------------


@SETTINGS
@given(graph=cost_graphs())
def test_prefix_costs_match_boundary_bytes(graph: nx.DiGraph) -> None:
    ops = op_nodes(graph)
    inputs = {n for n, k in graph.nodes(data="kind") if k == "input"}
    costs = prefix_costs(graph)
    assert len(costs) == len(ops)
    for index in range(len(ops)):
        expected = boundary_bytes(graph, boundary(graph, set(ops[: index + 1]) | inputs))
        assert costs[index] == expected, (index, ops[index])


def _separates(flow: nx.DiGraph, inputs: list[str], sink: str, removed: str) -> bool:
    rest = flow.subgraph(n for n in flow if n != removed)
    return not any(nx.has_path(rest, i, sink) for i in inputs)


@SETTINGS
@given(graph=cost_graphs())
def test_articulation_points_separate_inputs_from_output(graph: nx.DiGraph) -> None:
    points = articulation_points(graph)
    flow = graph.subgraph(n for n, k in graph.nodes(data="kind") if k != "param")
    inputs = [n for n, k in graph.nodes(data="kind") if k == "input"]
    assert len(points) == len(set(points))
    assert points == sorted(points, key=lambda n: graph.nodes[n]["order"]), "in execution order"
    for name in points:
        assert graph.nodes[name]["kind"] == "op"
        assert _separates(flow, inputs, "output", name), f"removing {name} leaves a path"
    if any(nx.has_path(flow, i, "output") for i in inputs):
        expected = [n for n in op_nodes(graph) if _separates(flow, inputs, "output", n)]
        assert points == expected, "every separating op is an articulation point"


@SETTINGS
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=1, max_size=30), st.data())
def test_nearest_positions_matches_the_plain_search(weights: list[float], data) -> None:
    """Boundaries chosen by bisection equal the first closest later candidate, target by
    target (zero-weight ops make ties; ties go to the earlier position)."""
    cumulative = [sum(weights[: i + 1]) for i in range(len(weights))]
    candidates = sorted(data.draw(st.sets(st.integers(0, len(weights) - 1))))
    targets = sorted(data.draw(st.lists(st.sampled_from([-1.0, 0.25, *cumulative, cumulative[-1] + 1]), max_size=8)))
    chosen: list[int] = []
    for target in targets:
        later = [c for c in candidates if not chosen or c > chosen[-1]]
        if not later:
            break
        chosen.append(min(later, key=lambda c: abs(cumulative[c] - target)))
    assert nearest_positions(cumulative, candidates, targets) == chosen
