"""Cost graphs the MILP tests share: a chain, a diamond with a skip, random small DAGs
(hypothesis), and the check that a schedule obeys Checkmate's constraints."""

from __future__ import annotations

import networkx as nx
from hypothesis import strategies as st

from passes.checkmate import CheckmateResult
from passes.costgraph import add_value, check_cost_graph
from passes.graph_facts import op_nodes
from passes.training_graph import peak_moment, stage_peaks, training_graph

UNIT = 10


def chain(n: int, nbytes: int = UNIT) -> nx.DiGraph:
    """x -> a0 -> ... -> a{n-1} -> loss -> output; each a_k saves its input and costs 1 flop,
    the loss is a scalar (0 bytes, so no loss working set) that saves nothing."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=nbytes, requires_grad=False)
    previous = "x"
    for index in range(n):
        add_value(graph, f"a{index}", kind="op", order=index + 1, bytes=nbytes, reads=[previous],
                  flops=1, saved=(previous,))
        previous = f"a{index}"
    add_value(graph, "loss", kind="op", order=n + 1, bytes=0, reads=[previous])
    add_value(graph, "output", kind="output", order=n + 2, bytes=0, reads=["loss"])
    check_cost_graph(graph)
    return graph


def diamond_with_skip() -> nx.DiGraph:
    """x -> p -> q -> a -> (b1, b2) -> c -> d -> loss, with a skip a -> d; b2 is a view of a
    and b1 may not be recomputed."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=UNIT, requires_grad=False)
    add_value(graph, "p", kind="op", order=1, bytes=UNIT, reads=["x"], flops=4, saved=("x",))
    add_value(graph, "q", kind="op", order=2, bytes=UNIT, reads=["p"], flops=4, saved=("p",))
    add_value(graph, "a", kind="op", order=3, bytes=UNIT, reads=["q"], flops=5, saved=("q",))
    add_value(graph, "b1", kind="op", order=4, bytes=UNIT, reads=["a"], flops=3, saved=("b1",),
              recomputable=False)
    add_value(graph, "b2", kind="op", order=5, bytes=0, reads=["a"], alias_of="a", flops=0)
    add_value(graph, "c", kind="op", order=6, bytes=UNIT, reads=["b1", "b2"], flops=7, saved=("b1", "b2"))
    add_value(graph, "d", kind="op", order=7, bytes=UNIT, reads=["c", "a"], flops=2, saved=("c", "a"),
              saved_extra_bytes=UNIT // 2)
    add_value(graph, "loss", kind="op", order=8, bytes=0, reads=["d"], flops=1)
    add_value(graph, "output", kind="output", order=9, bytes=0, reads=["loss"])
    check_cost_graph(graph)
    return graph


def assert_valid_schedule(graph: nx.DiGraph, result: CheckmateResult, budget: float) -> None:
    """The schedule obeys Checkmate's constraints, fits the budget and costs what it says."""
    training = training_graph(graph)
    R, S, T, home = result.R, result.S, training.size, training.home
    assert result.stages == training.names
    assert len(R) == len(S) == T
    for t in range(T):
        assert not any(R[t][t + 1:]) and not any(S[t][t:])
        for k in range(t + 1):
            if R[t][k]:
                assert t >= home[k] and (not training.once[k] or t == home[k]), (t, k)
                assert all(R[t][i] or S[t][i] for i in training.preds[k]), (t, k)
                assert R[t][home[k]], (t, k)  # an extra only with its op
                assert t == home[k] or all(R[t][i] for i in training.fresh[k]), (t, k)
        if t + 1 < T:
            assert all(S[t + 1][i] <= S[t][i] + R[t][i] for i in range(T)), t
        assert all(S[t][training.root[i]] for i in range(t) if S[t][i]), t  # a view held holds its storage
    for i in range(T):
        if home[i] == i:
            assert R[i][i] == 1, training.names[i]
        if training.kept[i]:
            assert all(S[t][i] for t in range(home[i] + 1, T)), training.names[i]
    assert result.peak_bytes == max(stage_peaks(training, R, S)) <= budget
    stage, moment = peak_moment(training, R, S)  # what a breakdown lists adds up to the peak, in that stage
    assert sum(training.mem[i] for i in moment.live) + moment.temporary == moment.peak == result.peak_bytes
    assert all(i <= stage for i in moment.live)
    forward = sum(training.flops[: training.n_forward])
    total = sum(training.flops[i] * R[t][i] for t in range(T) for i in range(training.n_forward))
    assert result.recompute_flops == total - forward >= 0



@st.composite
def small_cost_graphs(draw, autocast: bool = False) -> nx.DiGraph:
    """Random DAG cost graphs of 1-8 ops (rare features drawn as ``!= last``: hypothesis
    favours small integers), mostly chain-like (so that few values are graph
    outputs, which stay alive): skips, views (whose gradients may be smaller or larger than
    their storage, ``grad_bytes``), saved values, extra bytes, forward temporaries, a few
    unrecomputable or uncuttable nodes, ops that need no gradient, ops whose backward hands
    their inputs views of their own gradient (``grad_views``), a weight several ops make
    gradients for (summed in one buffer), parameter gradients made 16-bit and cast up
    (``param_grad_cast_bytes``); with
    ``autocast``, casts autocast's cache keeps to the end of forward (a checkpoint call's
    forward does not cache them, a schedule's does: no longer one of the MILP's schedules)."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=draw(st.integers(0, 40)), requires_grad=draw(st.booleans()))
    shared = draw(st.sampled_from([0, 0, 16]))  # a weight several ops make gradients for: summed in one buffer
    add_value(graph, "w", kind="param", order=1, bytes=0, param_grad_bytes=shared)
    readable = ["x", "w"]
    n_ops = draw(st.integers(1, 8))
    for index in range(n_ops):
        name = f"op{index}"
        latest = draw(st.sampled_from(readable)) if draw(st.integers(0, 3)) == 3 else readable[-1]
        reads = list(dict.fromkeys([latest, *draw(st.lists(st.sampled_from(readable), max_size=1))]))
        view = graph.nodes[reads[0]]["kind"] == "op" and draw(st.integers(0, 4)) == 4
        alias_of = (graph.nodes[reads[0]]["alias_of"] or reads[0]) if view else None
        savable = [r for r in reads if graph.nodes[r]["kind"] != "param"] + [name]
        own = draw(st.sampled_from([0, 30]))
        cast_up = draw(st.sampled_from([0, 0, 20, own])) if own else 0  # read through autocast's casts
        add_value(graph, name, kind="op", order=index + 2, bytes=0 if view else draw(st.integers(1, 40)),
                  reads=reads, alias_of=alias_of, flops=draw(st.integers(0, 20)),
                  recomputable=draw(st.integers(0, 7)) != 7, cuttable=draw(st.integers(0, 9)) != 9,
                  saved=tuple(v for v in savable if draw(st.booleans())),
                  saved_extra_bytes=draw(st.sampled_from([0, 0, 5])),
                  param_grad_bytes=own + shared * ("w" in reads),
                  param_grad_cast_bytes=cast_up, param_grad_narrow_bytes=cast_up // 2,
                  requires_grad=draw(st.integers(0, 5)) != 5,
                  grad_views=draw(st.integers(0, 3)) == 3,  # a cat, an add or reshape passing its gradient through
                  grad_bytes=draw(st.sampled_from([None, None, 7, 60])) if view else None,  # a slice's, an expand's
                  forward_extra_bytes=draw(st.sampled_from([0, 0, 0, 9])),
                  autocast_cache_bytes=draw(st.sampled_from([0, 0, 4])) if autocast else 0)
        readable.append(name)
    unread = [n for n in op_nodes(graph) if graph.out_degree(n) == 0]
    add_value(graph, "output", kind="output", order=n_ops + 2, bytes=0, reads=unread)
    check_cost_graph(graph)
    return graph

