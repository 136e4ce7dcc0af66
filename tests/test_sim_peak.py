"""What is alive at the simulated peak (:mod:`passes.sim_peak`, ``graphckpt inspect --peak``):
the parts are the simulator's own live set, so they add up to its peak for every plan."""

from __future__ import annotations

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.costgraph import add_value
from passes.sim_peak import peak_breakdown
from passes.simulate import eager_segments, simulate
from passes.strategies import STRATEGIES
from tests.cost_graph_draws import cost_graphs


@settings(max_examples=30, deadline=None)
@given(graph=cost_graphs(max_ops=20), strategy=st.sampled_from(sorted(STRATEGIES)))
def test_the_storages_at_the_peak_add_up_to_the_simulated_peak(graph: nx.DiGraph, strategy: str) -> None:
    plan = STRATEGIES[strategy](graph)
    breakdown = peak_breakdown(graph, plan.segments)
    assert breakdown.peak_bytes == simulate(graph, plan.segments).peak_bytes
    assert sum(s.bytes for s in breakdown.storages) + breakdown.temporary_bytes == breakdown.peak_bytes
    assert sum(breakdown.bytes_by_kind().values()) == breakdown.peak_bytes
    assert all(s.bytes > 0 and s.level >= 0 for s in breakdown.storages)
    assert all(s.name in graph for s in breakdown.storages if s.kind in ("activation", "recomputed copy", "gradient"))
    assert breakdown.reached_by


def test_eager_peaks_holding_every_value_backward_saved() -> None:
    """A chain run eagerly peaks at the start of backward: every value an op saved is alive
    then, forward's own (no recompute made a copy)."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=8, requires_grad=False)
    names = ["x"]
    for index in range(6):
        name = f"op{index}"
        add_value(graph, name, kind="op", order=index + 1, bytes=100 * (index + 1), reads=[names[-1]],
                  saved=(names[-1],))
        names.append(name)
    add_value(graph, "out", kind="output", order=7, bytes=0, reads=[names[-1]])
    breakdown = peak_breakdown(graph, eager_segments(graph))
    alive = {s.name for s in breakdown.storages if s.kind == "activation"}
    assert set(names[1:-1]) <= alive
    assert not any(s.kind == "recomputed copy" for s in breakdown.storages)


def test_a_recomputed_segment_shows_its_copies_at_the_peak() -> None:
    """A plan recomputing everything in one segment peaks during that recompute: the values
    at the peak are the recompute's copies, one level deep."""
    from passes.segments import make_segments

    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=8, requires_grad=False)
    previous = "x"
    for index in range(5):  # the last op small: the loss made from it stays under the recompute
        add_value(graph, f"op{index}", kind="op", order=index + 1, bytes=1000 if index < 4 else 10, reads=[previous],
                  saved=(previous,))
        previous = f"op{index}"
    add_value(graph, "out", kind="output", order=6, bytes=0, reads=[previous])
    ops = [f"op{index}" for index in range(5)]
    segments = make_segments(graph, [(ops[:4], True), (ops[4:], False)])
    breakdown = peak_breakdown(graph, segments)
    copies = [s for s in breakdown.storages if s.kind == "recomputed copy"]
    assert copies and all(s.level == 1 for s in copies)
