"""Tests of the Checkmate MILP reference solver (:mod:`passes.checkmate`): pure networkx, no torch.
Its properties on random graphs are tests/test_checkmate_properties.py."""

from __future__ import annotations

import math
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from passes.checkmate import MAX_OPS, checkmate_schedule
from passes.costgraph import add_value, check_cost_graph
from passes.highs import Milp
from passes.training_graph import no_recompute_peak, no_recompute_schedule, peak_moment, training_graph
from tests.milp_graphs import UNIT, assert_valid_schedule, chain, diamond_with_skip

pytestmark = pytest.mark.full_solver_time  # the MILP's answers: proofs of least recompute, monotone in the budget


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


def test_rows_converted_once_serve_every_solve_with_its_own_columns() -> None:
    """A model's rows are converted for HiGHS at its first solve and kept
    (:class:`passes.highs.RowsLp`): the relaxation, a fixed copy and the integer model solved
    in turn each get their own columns, and a row added after a solve is in the next one."""
    model = Milp()
    model.var(("x",), 0.0, 10.0, True)
    model.var(("y",), 0.0, 10.0, True)
    model.row([(("x",), 1.0), (("y",), 1.0)], 3.5, math.inf)  # x + y >= 3.5
    cost = np.array([1.0, 2.0])
    assert model.solve(cost, 5).objective == 4  # x = 4
    assert model.solve(cost, 5, relaxed=True).objective == pytest.approx(3.5)  # x = 3.5: no integrality left over
    assert model.fixed({0: 1.0}).solve(cost, 5).objective == 7  # x = 1, y = 3
    assert model.solve(cost, 5).objective == 4  # the copy's bounds stayed with the copy
    model.row([(("x",), 1.0)], -math.inf, 2.0)  # x <= 2
    assert model.solve(cost, 5).objective == 6  # x = 2, y = 2


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
    monkeypatch.setattr(passes.guided_solve, "POLISH_OVERTIME", 0.0)  # nor after the limit
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


@pytest.mark.parametrize("status", ["optimal", "time_limit"])
def test_a_schedule_above_beat_is_none_when_proven_and_a_timeout_when_not(
        status: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The solve may answer with a schedule recomputing no less than ``beat`` (the start the
    polish was given, or one HiGHS found before pruning). Proven least, no schedule beats
    ``beat``: ``None``. Not proven, the time ran out before one beating it was found:
    :class:`passes.checkmate.SolveTimeout`, never ``None``, which callers read as a proof
    (``scripts/planner_gap.py`` would print 1.00x)."""
    import passes.checkmate
    from passes.checkmate import SolveTimeout

    graph, budget = chain(8), 3 * UNIT
    best = checkmate_schedule(graph, budget, time_limit=30)
    assert best is not None and best.status == "optimal" and best.recompute_flops > 0
    real = passes.checkmate.guided_solve

    def answered_as(model, cost, time_limit, cutoff, polish_start=True, start=None):
        found = real(model, cost, time_limit, None, polish_start, start)  # the least schedule, above the cutoff asked
        return type(found)(status, found.x, found.objective, found.bound)

    monkeypatch.setattr(passes.checkmate, "guided_solve", answered_as)
    beat = best.recompute_flops  # nothing recomputes less
    if status == "optimal":
        assert checkmate_schedule(graph, budget, time_limit=30, beat=beat) is None
    else:
        with pytest.raises(SolveTimeout):
            checkmate_schedule(graph, budget, time_limit=30, beat=beat)
