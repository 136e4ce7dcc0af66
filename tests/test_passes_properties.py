"""Property tests of the passes on random cost graphs (pure networkx, no torch).

``cost_graphs`` draws DAG cost graphs that obey the node-attribute contract of
:mod:`passes.costgraph`; the properties check every strategy's plan, the min-cut search
against a brute force over all down-closed cuts, prefix costs and articulation points.
"""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import passes.peak_queries as peak_queries
from passes.costgraph import DEFAULTS, add_value, check_cost_graph
from passes.cuts import (
    INF,
    articulation_points,
    last_reader,
    min_cut_between,
    nearest_positions,
    op_positions,
    prefix_costs,
)
from passes.graph_facts import keeps_order, op_nodes, storage_root
from passes.heuristics import sqrt_candidate
from passes.keeps import least_with_keeps, with_keeps
from passes.kept_bytes import boundary, boundary_bytes, keep_cost
from passes.peak_queries import peak_exceeds, peak_within
from passes.plan import simulated
from passes.remat import remat_chain
from passes.segments import make_segments, segment_edges, validate_plan
from passes.sim_memory import LimitExceeded
from passes.simulate import eager_peak
from passes.strategies import STRATEGIES, choose_plan
from tests.thorough import examples


class CostGraph(nx.DiGraph):
    """A cost graph that prints as the ``add_value`` calls rebuilding it (for failing examples)."""

    def __repr__(self) -> str:
        lines = ["graph = nx.DiGraph(measured=True)"]
        for name, attributes in sorted(self.nodes(data=True), key=lambda item: item[1]["order"]):
            extra = {k: v for k, v in attributes.items()
                     if k not in ("kind", "order", "bytes", "label") and DEFAULTS.get(k, object()) != v}
            args = "".join(f", {k}={v!r}" for k, v in extra.items())
            reads = sorted(self.predecessors(name), key=lambda n: self.nodes[n]["order"])
            lines.append(f"add_value(graph, {name!r}, kind={attributes['kind']!r}, "
                         f"order={attributes['order']}, bytes={attributes['bytes']}, reads={reads!r}{args})")
        return "\n".join(lines)


SETTINGS = settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _mostly_true(draw, one_in: int) -> bool:
    """``False`` about once in ``one_in`` draws; shrinks towards ``True``."""
    return draw(st.integers(0, one_in - 1)) != one_in - 1


@st.composite
def cost_graphs(draw, max_ops: int = 30, inputs: tuple[int, int] = (1, 2), max_reads: int = 3) -> nx.DiGraph:
    """A random cost graph obeying the contract of :mod:`passes.costgraph`.

    ``inputs`` then ``params`` and ``op`` s interleaved, each op reading 1-3 earlier values;
    some ops are views (0 bytes, ``alias_of`` the storage root of the value they read),
    a few are not recomputable or not cuttable; one ``output`` sink reads every op
    nobody else reads, plus maybe others.
    """
    graph = CostGraph(measured=True)  # bytes, not node counts
    order = 0
    readable: list[str] = []
    for index in range(draw(st.integers(*inputs))):
        name = f"x{index}"
        add_value(graph, name, kind="input", order=order, bytes=draw(st.integers(0, 64)),
                  requires_grad=draw(st.booleans()))
        readable.append(name)
        order += 1
    n_ops = draw(st.integers(1, max_ops))
    n_params = draw(st.integers(0, 2))
    param_slots = sorted(draw(st.lists(st.integers(0, n_ops - 1), min_size=n_params, max_size=n_params)))
    params = 0
    for index in range(n_ops):
        while param_slots and param_slots[0] == index:
            param_slots.pop(0)
            name = f"p{params}"
            params += 1
            add_value(graph, name, kind="param", order=order, bytes=0)
            readable.append(name)
            order += 1
        reads = draw(st.lists(st.sampled_from(readable), min_size=1, max_size=max_reads, unique=True))
        base = reads[0]
        view = graph.nodes[base]["kind"] in ("op", "input") and draw(st.integers(0, 4)) == 0
        if view:
            nbytes, alias_of = 0, storage_root(graph, base)
        else:
            nbytes, alias_of = draw(st.one_of(st.just(0), st.integers(1, 100))), None
        name = f"op{index}"
        savable = [r for r in reads if graph.nodes[r]["kind"] != "param"] + [name]
        saved = tuple(v for v in savable if draw(st.booleans()))
        add_value(
            graph, name, kind="op", order=order, bytes=nbytes, reads=reads,
            alias_of=alias_of,
            flops=draw(st.integers(0, 1000)),
            recomputable=_mostly_true(draw, 8),
            cuttable=_mostly_true(draw, 10),
            saved=saved,
            saved_extra_bytes=draw(st.one_of(st.just(0), st.integers(1, 50))),
            requires_grad=_mostly_true(draw, 6),
            ordered=not _mostly_true(draw, 6),
        )
        readable.append(name)
        order += 1
    ops = [n for n in readable if graph.nodes[n]["kind"] == "op"]
    unread = [n for n in ops if graph.out_degree(n) == 0]
    others = draw(st.lists(st.sampled_from(readable), max_size=3, unique=True))
    add_value(graph, "output", kind="output", order=order, bytes=0,
              reads=list(dict.fromkeys([*unread, *others])))
    check_cost_graph(graph)
    return graph


def unrecomputable_op_reading_an_uncuttable_value() -> CostGraph:
    """``b`` may not be recomputed and reads ``a``, which may not be kept at a boundary:
    splitting ``b`` out of a recomputed group must not leave ``a`` on a boundary."""
    graph = CostGraph()
    add_value(graph, "x", kind="input", order=0, bytes=4)
    add_value(graph, "a", kind="op", order=1, bytes=4, reads=["x"], cuttable=False)
    add_value(graph, "b", kind="op", order=2, bytes=4, reads=["a"], recomputable=False)
    add_value(graph, "c", kind="op", order=3, bytes=4, reads=["b"])
    add_value(graph, "d", kind="op", order=4, bytes=4, reads=["c"])
    add_value(graph, "output", kind="output", order=5, bytes=0, reads=["d"])
    return graph


# --- strategies ------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", sorted(set(STRATEGIES) - {"optimal"}))
@SETTINGS
@given(graph=cost_graphs(), segments=st.sampled_from([None, 1, 2, 3, 5]))
@example(graph=unrecomputable_op_reading_an_uncuttable_value(), segments=2)
def test_every_strategy_gives_a_valid_plan(strategy: str, graph: nx.DiGraph, segments: int | None) -> None:
    assert_valid_plan(graph, strategy, segments)


@settings(SETTINGS, max_examples=examples(20))  # 1-3 s an example, up to 6 s (its dynamic program, and the exact solver's
# two solves on a graph with an extra: passes.exact), the others' 0.05 s
@given(graph=cost_graphs(), segments=st.sampled_from([None, 1, 2, 3, 5]))
@example(graph=unrecomputable_op_reading_an_uncuttable_value(), segments=2)
def test_optimal_gives_a_valid_plan(graph: nx.DiGraph, segments: int | None) -> None:
    assert_valid_plan(graph, "optimal", segments)


def assert_valid_plan(graph: nx.DiGraph, strategy: str, segments: int | None) -> None:
    """``strategy``'s plan for ``graph`` places every op once, in segments whose recompute
    reads only what is available, with checkpoints it may keep, and is no worse than eager."""
    plan = choose_plan(graph, strategy, segments)
    validate_plan(graph, plan.segments)
    if graph.graph.get("measured"):
        assert plan.peak_bytes <= plan.eager_peak_bytes, "no strategy hands back a plan worse than doing nothing"

    ops = op_nodes(graph)
    placed = [n for s in plan.segments for n in s.nodes]
    assert sorted(placed) == sorted(ops), "every op node sits in exactly one segment"
    assert len(placed) == len(set(placed))

    available = {n for n, k in graph.nodes(data="kind") if k in ("input", "param")}
    for index, segment in enumerate(plan.segments):
        assert segment.nodes, f"segment {index} is empty"
        assert (segment.inputs, segment.outputs) == segment_edges(graph, segment.nodes)
        if segment.schedule is not None:  # the exact solver's (passes.exact): validate_plan checked it
            available |= set(segment.nodes)
            continue
        if segment.recompute:
            assert all(graph.nodes[n]["recomputable"] for n in segment.nodes), index
            assert all(v in available for v in segment.inputs), (index, segment.inputs)
            assert boundary_bytes(graph, (*segment.inputs, *segment.outputs)) < INF, index
        inside = set(segment.nodes)
        for name in segment.nodes:
            assert all(u in available or u in inside for u in graph.predecessors(name)), name
        available |= inside

    scheduled = any(s.schedule for s in plan.segments)  # keeps values from forward it never cuts at
    assert all(graph.nodes[v]["kind"] == "op" and (scheduled or graph.nodes[v]["cuttable"]) for v in plan.checkpoints)
    assert plan.checkpoint_bytes < INF
    assert 0 <= plan.recompute_flops <= plan.forward_flops
    assert plan.forward_flops == sum(graph.nodes[n]["flops"] for n in ops)
    if strategy == "auto":
        assert plan.strategy in ("sqrt", "articulation", "mincut")
    else:
        assert plan.strategy in (strategy, "mincut", "sqrt" if strategy == "blocks" else strategy)


@SETTINGS
@given(graph=cost_graphs(), segments=st.sampled_from([None, 2, 3]))
def test_auto_is_the_best_of_its_candidates_simulated_in_full(graph: nx.DiGraph, segments: int | None) -> None:
    """auto drops a candidate as soon as its replay goes above the best peak so far; what it
    chooses is still the lowest peak (then least recompute) of the three plans simulated in
    full, and the early stop agrees with the full replay on each of them."""
    plans = [choose_plan(graph, name, segments) for name in ("mincut", "articulation", "sqrt")]
    best = min(plans, key=lambda p: (p.peak_bytes, p.recompute_flops))
    auto = choose_plan(graph, "auto", segments)
    assert (auto.peak_bytes, auto.recompute_flops) == (best.peak_bytes, best.recompute_flops)
    for plan in plans:
        assert not peak_exceeds(graph, plan.segments, plan.peak_bytes)
        assert peak_exceeds(graph, plan.segments, plan.peak_bytes - 1) == (plan.peak_bytes > 0)
        assert peak_within(graph, plan.segments, plan.peak_bytes) == plan.peak_bytes


@SETTINGS
@given(graph=cost_graphs(), data=st.data())
def test_a_plan_asked_again_gets_what_a_fresh_replay_gives(graph: nx.DiGraph, data: st.DataObject) -> None:
    """peak_within answers a plan it replayed before from what that replay found (its peak,
    or a peak passed before it stopped); whatever limits are asked in turn, each answer is
    the one a full replay gives, and a plan's second ask at the same limit replays nothing."""
    plan = choose_plan(graph, data.draw(st.sampled_from(["sqrt", "mincut", "articulation"])), None)
    peak = plan.peak_bytes
    limits = data.draw(st.lists(st.sampled_from([0, peak // 2, peak - 1, peak, peak + 1, 2 * peak]), min_size=1,
                                max_size=6))
    real = peak_queries.step_peak

    def replayed(limit: int) -> int | None:
        try:
            return real(graph, plan.segments, limit)
        except LimitExceeded:
            return None

    for limit in limits:
        assert peak_within(graph, plan.segments, limit) == replayed(limit), limit
    replays = []
    peak_queries.step_peak = lambda *args: replays.append(args) or real(*args)
    try:
        assert peak_within(graph, plan.segments, limits[-1]) == replayed(limits[-1])
    finally:
        peak_queries.step_peak = real
    assert not replays



def test_the_replay_memo_forgets_its_oldest_plan_past_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """peak_within remembers at most REPLAYS_KEPT plans of a graph: past that the plan
    remembered longest is replayed again when asked, the later ones are not."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=8, requires_grad=False)
    previous = "x"
    for order in range(1, 7):
        add_value(graph, f"op{order}", kind="op", order=order, bytes=100, reads=[previous], saved=(previous,))
        previous = f"op{order}"
    add_value(graph, "out", kind="output", order=7, bytes=0, reads=[previous])
    ops = op_nodes(graph)
    plans = [make_segments(graph, [(ops[:cut], True), (ops[cut:], False)]) for cut in (2, 3, 4)]
    monkeypatch.setattr(peak_queries, "REPLAYS_KEPT", 2)
    peaks = [peak_within(graph, plan, float("inf")) for plan in plans]
    real, replayed = peak_queries.step_peak, []
    monkeypatch.setattr(peak_queries, "step_peak", lambda *args: replayed.append(args[1]) or real(*args))
    assert [peak_within(graph, plan, float("inf")) for plan in (plans[2], plans[1])] == peaks[:0:-1]
    assert not replayed
    assert peak_within(graph, plans[0], float("inf")) == peaks[0]
    assert replayed == [plans[0]]

@SETTINGS
@given(graph=cost_graphs(), data=st.data())
def test_a_chain_traced_again_is_the_chain_traced_afresh(graph: nx.DiGraph, data: st.DataObject) -> None:
    """remat_chain reuses the chain it last traced to a value when the new kept set would
    make the trace visit the same nodes; whatever the kept sets asked in turn, each answer is
    the one a graph never traced before gives."""
    ops = op_nodes(graph)
    value = data.draw(st.sampled_from(ops))
    others = [n for n in graph if n != value and graph.nodes[n]["kind"] == "op"]
    for _ in range(4):
        keep = set(data.draw(st.lists(st.sampled_from(others), max_size=len(others)))) if others else set()
        assert remat_chain(graph, value, keep) == remat_chain(nx.DiGraph(graph), value, keep)


@SETTINGS
@given(graph=cost_graphs(), strategy=st.sampled_from(["sqrt", "mincut", "optimal"]),
       slack=st.sampled_from([1.0, 1.3, 2.0]))
def test_keeping_values_never_recomputes_less_than_keeping_them_all(graph: nx.DiGraph, strategy: str,
                                                                    slack: float) -> None:
    """least_with_keeps is a floor of what with_keeps makes of a plan at any budget, nested
    plans (optimal's) included: the budget search skips a start whose floor is above a plan
    it has."""
    plan = choose_plan(graph, strategy, None)
    kept = with_keeps(graph, plan, slack * plan.peak_bytes)
    assert least_with_keeps(graph, plan) <= kept.cost_key[0] <= plan.cost_key[0]


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


def test_a_plan_worse_than_eager_falls_back_to_eager_and_says_so() -> None:
    """Found by hypothesis: a one-op segment recomputed right before another keeps its
    output (1 byte) alive with the recompute's copy, so sqrt's plan peaks at 2 bytes
    where eager peaks at 1. (``op1`` saves its input: a segment whose ops save nothing holds
    nothing, passes.graph_facts.leaves_nothing.)"""
    graph = nx.DiGraph(measured=True)
    add_value(graph, "x0", kind="input", order=0, bytes=0, requires_grad=False)
    add_value(graph, "op0", kind="op", order=1, bytes=1, reads=["x0"])
    add_value(graph, "op1", kind="op", order=2, bytes=0, reads=["x0", "op0"], alias_of="x0", saved=("x0",))
    views = [f"op{i}" for i in range(2, 7)]
    for order, name in enumerate(views, start=3):
        add_value(graph, name, kind="op", order=order, bytes=0, reads=["x0"], alias_of="x0")
    add_value(graph, "output", kind="output", order=9, bytes=0, reads=["op1", *views])
    check_cost_graph(graph)
    assert simulated(graph, sqrt_candidate(graph)).peak_bytes > eager_peak(graph)
    plan = choose_plan(graph, "sqrt")
    assert plan.peak_bytes == eager_peak(graph) and not plan.recomputed_segments
    assert any("kept eager execution" in note for note in plan.notes)
