"""Tests of the Checkmate MILP reference solver (:mod:`passes.checkmate`): pure networkx, no torch."""

from __future__ import annotations

import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passes.checkmate import MAX_OPS, CheckmateResult, checkmate_schedule
from passes.costgraph import add_value, check_cost_graph
from passes.graph_facts import op_nodes
from passes.plan import Plan
from passes.simulate import eager_segments, simulate
from passes.strategies import STRATEGIES, choose_plan
from passes.training_graph import (
    no_recompute_peak,
    no_recompute_schedule,
    peak_moment,
    stage_peaks,
    training_graph,
)
from tests.thorough import examples

pytestmark = pytest.mark.full_solver_time  # the MILP's answers: proofs of least recompute, monotone in the budget

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


def test_an_op_run_again_without_its_extra_holds_it_for_a_moment() -> None:
    """A step running ``a`` again without its extra (what it saves beyond values) makes the
    extra all the same and lets it go when ``a`` returns: it is held for a moment with
    ``a``'s temporaries. Under bf16 autocast a step's Linear casts its weight and input there;
    an exact schedule measured 5.1% over its simulated peak without them (stop 68)."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=400, requires_grad=False)
    add_value(graph, "a", kind="op", order=1, bytes=100, reads=["x"], saved_extra_bytes=300, forward_extra_bytes=1000)
    add_value(graph, "b", kind="op", order=2, bytes=100, reads=["a"], saved=("a",))
    add_value(graph, "output", kind="output", order=3, bytes=0, reads=["b"])
    check_cost_graph(graph)
    training = training_graph(graph)
    a, stage = training.names.index("a"), training.names.index("backward:b")
    extra = training.extra_node(a)
    assert extra is not None and training.mem[extra] == 300
    R, S = (list(map(list, matrix)) for matrix in no_recompute_schedule(training))
    for t in range(a + 1, stage + 1):  # a is let go after forward and made again for b's backward
        S[t][a] = 0
    R[stage][a] = 1
    at, moment = peak_moment(training, R, S)
    assert (training.names[at], training.names[moment.reached]) == ("backward:b", "a")
    assert moment.temporary == 1000 + 300
    assert sum(training.mem[i] for i in moment.live) + moment.temporary == moment.peak


def test_chain_without_memory_pressure_recomputes_nothing() -> None:
    graph = chain(6)
    budget = no_recompute_peak(graph)
    result = checkmate_schedule(graph, budget)
    assert result is not None and result.status == "optimal"
    assert result.recompute_flops == 0
    assert_valid_schedule(graph, result, budget)


def test_chain_under_a_tight_budget_recomputes_and_fits() -> None:
    graph = chain(6)
    budget = no_recompute_peak(graph) - 3 * UNIT
    result = checkmate_schedule(graph, budget)
    assert result is not None and result.status == "optimal"
    assert result.recompute_flops > 0
    assert_valid_schedule(graph, result, budget)
    # the least budget: a gradient in, a gradient out and one saved value, so each backward
    # step after the first (which finds a4 kept from forward) recomputes its saved input from x
    least = checkmate_schedule(graph, 3 * UNIT)
    assert least is not None and least.recompute_flops == 4 + 3 + 2 + 1
    assert_valid_schedule(graph, least, 3 * UNIT)


@pytest.mark.parametrize("budget", [0, UNIT // 2, 2 * UNIT])
def test_impossible_budget_gives_none(budget: int) -> None:
    assert checkmate_schedule(chain(6), budget) is None


def test_diamond_with_skip_and_unrecomputable_node() -> None:
    graph = diamond_with_skip()
    peak = no_recompute_peak(graph)
    assert peak == 85
    relaxed = checkmate_schedule(graph, peak)
    assert relaxed is not None and relaxed.recompute_flops == 0
    assert_valid_schedule(graph, relaxed, peak)
    # p (4 flops) once more, then p and q; below 65 the backward alone does not fit
    for budget, recompute in [(80, 4), (75, 4), (70, 8), (65, 8), (60, None)]:
        result = checkmate_schedule(graph, budget)
        if recompute is None:
            assert result is None
            continue
        assert result is not None and result.recompute_flops == recompute
        assert_valid_schedule(graph, result, budget)
        b1 = result.stages.index("b1")
        assert sum(row[b1] for row in result.R) == 1, "b1 may not be recomputed"


def test_training_graph_of_the_diamond() -> None:
    training = training_graph(diamond_with_skip())
    names = list(training.names)
    assert names[:10] == ["p", "q", "a", "b1", "b2", "c", "extra:d", "d", "loss", "grad-seed:loss"]
    assert names[10:] == ["backward:loss", "backward:d", "backward:d:a", "backward:c", "backward:c:b2",
                          "backward:b2", "backward:b1", "backward:a", "backward:q", "backward:p"]
    reads = {names[k]: {names[i] for i in training.preds[k]} for k in range(len(names))}
    assert reads["c"] == {"a", "b1", "b2"}  # b2 is a view of a: reading it needs a's storage
    assert reads["extra:d"] == reads["d"] == {"a", "c"}
    assert training.home[names.index("extra:d")] == names.index("d")
    # d's backward makes the gradients of c, then of a, from d's gradient, saved values and extra
    assert reads["backward:d"] == reads["backward:d:a"] == {"backward:loss", "c", "a", "extra:d"}
    assert reads["backward:b2"] == {"backward:c:b2", "backward:d:a"}  # adds into a's gradient
    assert training.transient[names.index("backward:b2")] == UNIT
    assert reads["backward:p"] == {"backward:q"}
    assert training.mem[names.index("backward:p")] == 0  # x needs no gradient
    assert training.kept == tuple(name == "loss" for name in names)


def test_beat_answers_only_a_schedule_recomputing_less() -> None:
    """With ``beat`` (a plan in hand's recompute) the solver prunes what cannot beat it:
    ``None`` at the optimum itself, the optimum just above it."""
    graph = chain(6)
    budget = 3 * UNIT
    optimum = checkmate_schedule(graph, budget)
    assert optimum is not None and optimum.status == "optimal"
    assert checkmate_schedule(graph, budget, beat=optimum.recompute_flops) is None
    better = checkmate_schedule(graph, budget, beat=optimum.recompute_flops + 1)
    assert better is not None and better.recompute_flops == optimum.recompute_flops
    assert_valid_schedule(graph, better, budget)


def test_planning_imports_without_scipy() -> None:
    """Budget plans import the MILP (exact schedules, floors): its solver is a dependency of
    the package itself, so ``pip install graphckpt`` (no extras) imports and plans."""
    code = ("import sys; sys.modules['scipy'] = None\n"
            "import passes.budget_search, passes.checkmate, passes.floor\n"
            "assert passes.checkmate.checkmate_schedule is not None")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_too_many_ops_is_refused() -> None:
    with pytest.raises(ValueError, match="op nodes"):
        checkmate_schedule(chain(MAX_OPS + 1), 1e12)


def test_a_fixed_model_keeps_what_it_fixes() -> None:
    """What the guided solve builds on (:func:`passes.guided_solve.guided_solve`): fixing
    columns at an optimum's values leaves that optimum, in a new model."""
    from passes.checkmate import build_milp, recompute_objective

    training = training_graph(chain(12))
    model = build_milp(training, 6 * UNIT)
    cost = recompute_objective(model, training)
    best = model.solve(cost, 20)
    assert best.status == "optimal" and best.x is not None
    assert float(cost @ best.x) == pytest.approx(best.objective)  # the solution read back is the one reported
    held = {column: best.x[column] for key, column in model.columns.items() if key[0] == "S"}
    assert model.fixed(held).solve(cost, 20).objective == best.objective
    assert model.bounds != model.fixed(held).bounds  # fixing made a new model, this one unchanged


def test_the_freed_neighbourhoods_fix_at_zero_only_what_the_relaxation_barely_holds() -> None:
    """The smaller sub-MIPs of the guided solve fix each ``S`` the LP relaxation holds at most
    a threshold at 0 and leave the others free, smallest sub-MIP (most fixed) first."""
    from passes.checkmate import build_milp, recompute_objective
    from passes.guided_solve import FREED_AT, freed_neighbourhoods

    training = training_graph(chain(12))
    model = build_milp(training, 4 * UNIT)
    relaxation = model.solve(recompute_objective(model, training), 20, relaxed=True)
    S = [column for key, column in model.columns.items() if key[0] == "S"]
    held = {column: relaxation.x[column] for column in S}
    assert any(0.1 < share < 0.9 for share in held.values())  # a fractional relaxation: the case they are for
    found = list(freed_neighbourhoods(S, relaxation.x))
    assert [share for _, share in found] == [share for _, share in FREED_AT]
    for (fixed, _), (threshold, _) in zip(found, FREED_AT, strict=True):
        assert fixed == {column: 0.0 for column, share in held.items() if share <= threshold}
    assert all(set(later) <= set(earlier) for (earlier, _), (later, _) in pairwise(found))


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("graph, budget", [(chain(10), 55), (chain(12), 65), (chain(12), 78), (diamond_with_skip(), 68)])
def test_the_guided_solve_proves_the_plain_solves_optimum(graph: nx.DiGraph, budget: int, lanes: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting from sub-MIPs, in one lane or two, changes how fast a schedule is found,
    never which is least."""
    import passes.guided_solve
    from passes.checkmate import build_milp, recompute_objective
    from passes.guided_solve import guided_solve

    monkeypatch.setattr(passes.guided_solve, "lanes", lambda: lanes)
    training = training_graph(graph)
    model = build_milp(training, budget)
    cost = recompute_objective(model, training)
    plain, guided = model.solve(cost, 30), guided_solve(model, cost, 30, None)
    assert plain.status == guided.status == "optimal"
    assert guided.objective == pytest.approx(plain.objective)
    assert float(cost @ guided.x) == pytest.approx(guided.objective)


def test_two_lanes_solve_the_freed_neighbourhoods_while_the_whole_set_sub_mip_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With two lanes, the smaller sub-MIPs run in a thread of their own at the same time as
    the one the relaxation sets whole (and the whole MILP after it), not after them."""
    import threading
    import time

    import passes.guided_solve
    from passes.checkmate import build_milp, recompute_objective
    from passes.guided_solve import guided_solve
    from passes.highs import Milp

    solve, runs = Milp.solve, []

    def watched(self: Milp, cost, time_limit: float, relaxed: bool = False, **kwargs):
        started = time.perf_counter()
        found = solve(self, cost, time_limit, relaxed, **kwargs)
        runs.append((threading.current_thread().name, relaxed, started, time.perf_counter()))
        return found

    monkeypatch.setattr(Milp, "solve", watched)
    monkeypatch.setattr(passes.guided_solve, "lanes", lambda: 2)
    monkeypatch.setattr(passes.guided_solve, "POLISH_SHARE", 0.0)  # the lanes before polishing (its solves: test_polish)
    training = training_graph(chain(30))
    model = build_milp(training, 6 * UNIT)
    guided_solve(model, recompute_objective(model, training), 3.0, None)  # each solve capped at 1 s (conftest)
    here = threading.current_thread().name
    ours = [(start, end) for name, relaxed, start, end in runs if name == here and not relaxed]
    theirs = [(start, end) for name, _, start, end in runs if name != here]
    assert theirs and len(ours) == 2  # the whole-set sub-MIP and the whole MILP here; the freed ones there
    assert any(start < their_end and their_start < end for start, end in ours for their_start, their_end in theirs)


def test_quiet_nested_across_threads_restores_the_output(capfd: pytest.CaptureFixture[str]) -> None:
    """Two lanes each silence HiGHS's output around their solves, overlapping and leaving in
    any order: what the process prints afterwards is seen again."""
    import os
    import threading

    from passes.highs import quiet

    inside, main_left = threading.Event(), threading.Event()

    def lane() -> None:
        with quiet():
            inside.set()
            main_left.wait(5)

    other = threading.Thread(target=lane)
    with quiet():
        other.start()
        inside.wait(5)
        os.write(1, b"silenced\n")
    main_left.set()  # the lane that entered second leaves last
    other.join()
    os.write(1, b"heard\n")
    out = capfd.readouterr().out
    assert "heard" in out and "silenced" not in out


def test_time_limit_without_a_schedule_raises() -> None:
    with pytest.raises(TimeoutError, match="no schedule found"):
        checkmate_schedule(chain(30), 6 * UNIT, time_limit=0.0)


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


def least_budget(graph: nx.DiGraph) -> int:
    """The least integer budget with a schedule, by bisection (feasibility grows with the budget)."""
    low, high = 0, int(no_recompute_peak(graph))
    while low < high:
        middle = (low + high) // 2
        if checkmate_schedule(graph, middle) is None:
            low = middle + 1
        else:
            high = middle
    return low


def check_monotone(graph: nx.DiGraph, fractions: list[float]) -> None:
    """From the least budget that fits up to the no-recompute peak, each schedule is valid
    and optimal, and recompute never grows with the budget."""
    peak, least = int(no_recompute_peak(graph)), least_budget(graph)
    budgets = sorted({least + round(f * (peak - least)) for f in fractions} | {least, peak})
    results = [checkmate_schedule(graph, budget, time_limit=20) for budget in budgets]
    assert results[-1] is not None and results[-1].recompute_flops == 0
    if least > 0:
        assert checkmate_schedule(graph, least - 1) is None
    for budget, result in zip(budgets, results, strict=True):
        assert result is not None and result.status == "optimal"
        assert_valid_schedule(graph, result, budget)
    for smaller, larger in pairwise(results):
        assert larger.recompute_flops <= smaller.recompute_flops


def in_run_order(graph: nx.DiGraph, plan: Plan) -> nx.DiGraph:
    """A copy of ``graph`` whose ops' ``order`` is the order ``plan`` runs them in (its
    segments one after another). The MILP schedules ops in ``order``; a plan may run an op
    later than eager does (an op reading only a weight, put in a later segment), and its peak
    may then be below every schedule in eager order."""
    ordered = graph.copy()
    slots = sorted(graph.nodes[name]["order"] for name in op_nodes(graph))
    run = [name for segment in plan.segments for name in segment.nodes]
    for name, slot in zip(run, slots, strict=True):
        ordered.nodes[name]["order"] = slot
    return ordered


def check_strategies(graph: nx.DiGraph, segments: int | None) -> None:
    """Each plan's run (its simulated peak, its recompute) is one of the schedules the MILP
    searches over the ops in the plan's order, so the MILP at that peak fits and recomputes
    no more."""
    for strategy in sorted(STRATEGIES):
        plan = choose_plan(graph, strategy, segments)
        result = checkmate_schedule(in_run_order(graph, plan), plan.peak_bytes, time_limit=20)
        assert result is not None and result.status == "optimal", strategy
        assert result.recompute_flops <= plan.recompute_flops, strategy


def test_a_plan_running_an_op_later_than_eager_is_checked_in_its_own_order() -> None:
    """Found by hypothesis: op2 reads only a weight and saves a 5-byte extra; the mincut plan
    runs it after op3, so its extra is gone before op3's backward, at a peak (140 B) no
    schedule in eager order reaches."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=28)
    add_value(graph, "w", kind="param", order=1, bytes=0)
    add_value(graph, "op0", kind="op", order=2, bytes=1, reads=["w"])
    add_value(graph, "op1", kind="op", order=3, bytes=29, reads=["op0"])
    add_value(graph, "op2", kind="op", order=4, bytes=1, reads=["w"], saved_extra_bytes=5, flops=1)
    add_value(graph, "op3", kind="op", order=5, bytes=15, reads=["op1", "x"], saved=("op1",), param_grad_bytes=30)
    add_value(graph, "op4", kind="op", order=6, bytes=1, reads=["op3"], saved=("op3",), grad_views=True)
    add_value(graph, "op5", kind="op", order=7, bytes=22, reads=["op4"])
    add_value(graph, "output", kind="output", order=8, bytes=0, reads=["op2", "op5"])
    check_cost_graph(graph)
    plan = choose_plan(graph, "mincut", None)
    run = [name for segment in plan.segments for name in segment.nodes]
    assert run.index("op2") > run.index("op3")
    assert checkmate_schedule(graph, plan.peak_bytes, time_limit=20) is None
    check_strategies(graph, None)


FEW = settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
FRACTIONS = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3)
SEGMENTS = st.sampled_from([None, 2, 3])


@FEW
@given(graph=small_cost_graphs(), fractions=FRACTIONS)
def test_recompute_is_monotone_in_the_budget(graph: nx.DiGraph, fractions: list[float]) -> None:
    check_monotone(graph, fractions)


@FEW
@given(graph=small_cost_graphs(), segments=SEGMENTS)
def test_no_strategy_beats_checkmate_at_its_own_peak(graph: nx.DiGraph, segments: int | None) -> None:
    check_strategies(graph, segments)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=small_cost_graphs(autocast=True))
def test_no_recompute_peak_is_the_simulators_eager_peak(graph: nx.DiGraph) -> None:
    assert no_recompute_peak(graph) == simulate(graph, eager_segments(graph)).eager_peak_bytes


@pytest.mark.slow
@MANY
@given(graph=small_cost_graphs(), fractions=FRACTIONS)
def test_recompute_is_monotone_in_the_budget_many(graph: nx.DiGraph, fractions: list[float]) -> None:
    check_monotone(graph, fractions)


@pytest.mark.slow
@MANY
@given(graph=small_cost_graphs(), segments=SEGMENTS)
def test_no_strategy_beats_checkmate_at_its_own_peak_many(graph: nx.DiGraph, segments: int | None) -> None:
    check_strategies(graph, segments)
