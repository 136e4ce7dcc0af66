"""The simulator's memory model (:mod:`passes.simulate`) on small cost graphs made by hand
or drawn: scratch a backward allocates, the order torch's checkpoint runs an op's backward
and its recompute, selective checkpointing's cache; and the MILP holding scratch as the
simulator does. Pure networkx, no torch: the measured truth is tests/test_simulator_accuracy.py."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passes.costgraph import add_value, check_cost_graph
from passes.graph_facts import op_nodes
from passes.segments import Segment, make_segments, segment_edges
from passes.sim_peak import peak_breakdown
from passes.simulate import eager_segments, simulate
from passes.training_graph import no_recompute_peak
from tests.milp_graphs import small_cost_graphs
from tests.test_checkmate_properties import check_strategies


def test_backward_extra_bytes_default_to_zero() -> None:
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=10)
    assert graph.nodes["x"]["backward_extra_bytes"] == 0
    check_cost_graph(graph)


def _graph(extra: int, *, diamond: bool) -> nx.DiGraph:
    """x -> a -> output, or x -> a -> b -> c(a, b) -> output; 10 bytes each, nothing saved;
    the last op but one (``a``, or ``b``) has ``extra`` scratch bytes."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=10, requires_grad=False)
    add_value(graph, "a", kind="op", order=1, bytes=10, reads=["x"], backward_extra_bytes=0 if diamond else extra)
    last = "a"
    if diamond:
        add_value(graph, "b", kind="op", order=2, bytes=10, reads=["a"], backward_extra_bytes=extra)
        add_value(graph, "c", kind="op", order=3, bytes=10, reads=["a", "b"])
        last = "c"
    add_value(graph, "output", kind="output", order=4, bytes=0, reads=[last])
    check_cost_graph(graph)
    return graph


def test_scratch_is_held_on_top_of_the_gradients() -> None:
    # Loss: output + 3 x output + its gradient = 50. Backward of a: output, its gradient, 100.
    assert simulate(_graph(0, diamond=False), eager_segments(_graph(0, diamond=False))).peak_bytes == 50
    graph = _graph(100, diamond=False)
    assert simulate(graph, eager_segments(graph)).peak_bytes == 120 == no_recompute_peak(graph)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("allocates", [True, False])
def test_ops_ending_a_recomputed_segment_that_save_nothing_run_their_backward_before_its_recompute(
        allocates: bool, nested: bool) -> None:
    """torch's checkpoint recomputes at the first saved tensor backward unpacks: an op at the
    end of a recomputed segment that saves nothing (a residual add) runs its backward first,
    and what that backward makes lives through the recompute. Under bf16 autocast the add
    casts its bf16 input's gradient there: ViT's plan at the floor measured 1.7% over its
    simulated peak (stop 67). Here ``a``'s recompute (its 1000-byte temporary) is the peak;
    when ``b``'s backward makes storage, the gradient of ``x`` it made is alive in it; when it
    makes none (float32's add passes its gradient through), ``b``'s own gradient is.
    ``nested``: the segment's recompute runs children, the last one kept and ending in ``b``
    (ViT's plan at the floor, stop 68: 1.6% over its simulated peak before)."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=500, requires_grad=True)
    add_value(graph, "a", kind="op", order=1, bytes=100, reads=["x"], saved=("x",), saved_extra_bytes=50,
              forward_extra_bytes=1000)  # saves a mask it makes: the recompute reruns it
    add_value(graph, "b", kind="op", order=2, bytes=100, reads=["a", "x"], backward_allocates=allocates)  # saves nothing
    add_value(graph, "output", kind="output", order=3, bytes=0, reads=["b"])
    check_cost_graph(graph)
    segments = make_segments(graph, [(["a", "b"], True)])
    if nested:  # (make_segments would merge two kept neighbours)
        children = tuple(Segment((name,), False, *segment_edges(graph, [name])) for name in ("a", "b"))
        segments = (replace(segments[0], children=children),)
    peak = peak_breakdown(graph, segments)
    assert peak.reached_by == "a temporary of 1000 bytes"
    gradients = {s.name for s in peak.storages if s.kind == "gradient"}
    assert gradients == ({"x", "a"} if allocates else {"b"})


def test_a_recompute_takes_a_cached_nodes_inner_matmul_outputs_out_of_the_cache_as_it_runs_it() -> None:
    """Selective checkpointing caches the matmul outputs inside an ``expensive`` node (the
    score matrix of an attention, ``selective_extra_bytes``); the recompute pops them as the
    node's kernels run again, so they are part of its working set there, not bytes beside it
    (BART's nested plan at the floor, bf16: 98,304 B over its measured peak, stop 68). Here
    ``a``'s recompute (its 1000-byte temporary) is the peak, with no cache alive."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=500, requires_grad=True)
    add_value(graph, "a", kind="op", order=1, bytes=100, reads=["x"], saved=("x",), expensive=True,
              selective_extra_bytes=300, forward_extra_bytes=1000)
    add_value(graph, "b", kind="op", order=2, bytes=100, reads=["a"], saved=("a",))
    add_value(graph, "output", kind="output", order=3, bytes=0, reads=["b"])
    check_cost_graph(graph)
    segments = (replace(make_segments(graph, [(["a", "b"], True)])[0], saved_inside=("a",)),)
    peak = peak_breakdown(graph, segments)
    assert peak.reached_by == "a temporary of 1000 bytes"
    assert {s.kind for s in peak.storages} >= {"gradient"}
    assert "selective cache" not in {s.kind for s in peak.storages}, peak


@pytest.mark.parametrize("rerun_extra", [None, 10])
def test_a_recompute_served_from_the_cache_holds_the_nodes_rerun_temporaries_only(rerun_extra: int | None) -> None:
    """A node a selective segment keeps comes back from selective checkpointing's cache in the
    recompute: its matmul is not called, so its scratch (a bf16 GEMM's, in
    ``forward_extra_bytes``) is not made, only ``cached_rerun_extra_bytes`` (``None``: all of
    ``forward_extra_bytes``). In forward, where it runs, it holds all of them."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=500, requires_grad=True)
    add_value(graph, "a", kind="op", order=1, bytes=100, reads=["x"], saved=("x",), expensive=True,
              forward_extra_bytes=1000, cached_rerun_extra_bytes=rerun_extra)
    add_value(graph, "b", kind="op", order=2, bytes=100, reads=["a"], saved=("a",))
    add_value(graph, "output", kind="output", order=3, bytes=0, reads=["b"])
    check_cost_graph(graph)
    segments = (replace(make_segments(graph, [(["a", "b"], True)])[0], saved_inside=("a",)),)
    peak = peak_breakdown(graph, segments)
    gradients = {s.name for s in peak.storages if s.kind == "gradient"}
    assert peak.reached_by == "a temporary of 1000 bytes"
    if rerun_extra is None:  # in the recompute: a, b, b's gradient and the 1000
        assert (peak.peak_bytes, gradients) == (1300, {"b"})
    else:  # in forward: a and the 1000; the recompute holds a, b, b's gradient and 10
        assert (peak.peak_bytes, gradients) == (1100, set())


def test_a_selective_segment_runs_its_ops_with_their_temporaries_under_its_dispatch_mode() -> None:
    """Torch's selective checkpointing runs a segment's forward and its recompute under a
    dispatch mode, where a composite op may take another branch than in plain code: CPU's
    math attention adds its mask out of place there (``selective_forward_extra_bytes``).
    A plain checkpoint call of the same ops holds their ``forward_extra_bytes``."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=500, requires_grad=True)
    add_value(graph, "a", kind="op", order=1, bytes=100, reads=["x"], saved=("x",), expensive=True,
              forward_extra_bytes=10, selective_forward_extra_bytes=1000, cached_rerun_extra_bytes=10)
    add_value(graph, "b", kind="op", order=2, bytes=100, reads=["a"], saved=("a",))
    add_value(graph, "output", kind="output", order=3, bytes=0, reads=["b"])
    check_cost_graph(graph)
    (plain,) = make_segments(graph, [(["a", "b"], True)])
    assert peak_breakdown(graph, (plain,)).peak_bytes < 1000
    peak = peak_breakdown(graph, (replace(plain, saved_inside=("a",)),))
    assert (peak.reached_by, peak.peak_bytes) == ("a temporary of 1000 bytes", 1100)  # forward: a and the 1000


def test_a_recompute_runs_while_what_its_trigger_made_before_unpacking_lives() -> None:
    """torch's checkpoint recomputes at the first unpack of a saved value: the op whose
    backward starts it (``b``, the last that saves) may have made gradients before
    (``unpack_held_bytes``: math attention's float32 copy of its bf16 gradient), and they
    live through the recompute."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=500, requires_grad=True)
    add_value(graph, "a", kind="op", order=1, bytes=100, reads=["x"], saved=("x",), forward_extra_bytes=1000)
    add_value(graph, "b", kind="op", order=2, bytes=100, reads=["a"], saved=("a",))
    add_value(graph, "output", kind="output", order=3, bytes=0, reads=["b"])
    check_cost_graph(graph)
    segments = make_segments(graph, [(["a", "b"], True)])
    before = peak_breakdown(graph, segments)
    graph.nodes["b"]["unpack_held_bytes"] = 50
    after = peak_breakdown(graph, segments)
    assert after.peak_bytes == before.peak_bytes + 50, (before, after)


def test_scratch_is_held_with_the_gradients_added_into_existing_buffers() -> None:
    # c's backward leaves c (output), grad a, grad b = 30; b's backward makes a gradient for a
    # that is added into grad a (10), and holds its scratch (100) while that gradient exists.
    graph = _graph(100, diamond=True)
    assert simulate(graph, eager_segments(graph)).peak_bytes == 140 == no_recompute_peak(graph)


@st.composite
def graphs_with_scratch(draw) -> nx.DiGraph:
    graph = draw(small_cost_graphs())
    for name in op_nodes(graph):
        graph.nodes[name]["backward_extra_bytes"] = draw(st.sampled_from([0, 0, 7, 60]))
    return graph


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graphs_with_scratch())
def test_checkmate_holds_scratch_like_the_simulator(graph: nx.DiGraph) -> None:
    assert no_recompute_peak(graph) == simulate(graph, eager_segments(graph)).eager_peak_bytes


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graphs_with_scratch(), segments=st.sampled_from([None, 2, 3]))
def test_no_strategy_beats_checkmate_with_scratch(graph: nx.DiGraph, segments: int | None) -> None:
    check_strategies(graph, segments)
