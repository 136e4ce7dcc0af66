"""Property tests of the strategies on random cost graphs (pure networkx, no torch): every
strategy's plan is valid, auto is the best of its candidates, replays and keeps agree with a
fresh search. The graphs are tests/cost_graph_draws.py's; the cuts' own properties are
tests/test_cuts_properties.py."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import passes.peak_queries as peak_queries
from passes.costgraph import add_value, check_cost_graph
from passes.cuts import INF
from passes.graph_facts import op_nodes
from passes.heuristics import sqrt_candidate
from passes.keeps import with_keeps
from passes.kept_bytes import boundary_bytes
from passes.kept_values import least_with_keeps
from passes.peak_queries import peak_exceeds, peak_within
from passes.plan import simulated
from passes.remat import remat_chain
from passes.segments import make_segments, segment_edges, validate_plan
from passes.sim_memory import LimitExceeded
from passes.simulate import eager_peak
from passes.strategies import STRATEGIES, choose_plan
from tests.cost_graph_draws import SETTINGS, CostGraph, cost_graphs
from tests.thorough import examples


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
