"""Exact schedules that make an op's *extra* again (what it saves for backward that is no
value of the graph: max-pool's indices): the solver may make it at a hooked stage with its
pure op (:func:`passes.checkmate.pin_executable`), the schedule says so
(``Schedule.dropped_extras``, ``ScheduleStep.extras``), and the runtime runs that op with
autograd on to hold what it saves (:func:`graphckpt.exact.with_autograd_for_saved_extras`).
Apart from :mod:`tests.test_exact` to keep each module short."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import pytest
import torch
import torch.nn.functional as F

from graphckpt.api import Analysis, analyze, generate_rewrite
from graphckpt.tools import zoo
from passes.budget import BudgetError
from passes.budget_search import fit_budget
from passes.checkmate import build_milp, checkmate_schedule, pin_executable, recompute_objective
from passes.exact import exact_plan, schedule_of, scheduled_segment
from passes.kept_values import ranked_keeps
from passes.plan import plan_of_segments
from passes.schedule import Schedule, ScheduleError, ScheduleStep, check_schedule
from passes.segments import validate_plan
from passes.simulate import eager_peak
from passes.training_graph import training_graph
from tests.equivalence import assert_trains_like_twice, fresh_pair
from tests.test_exact import assert_peak_as_simulated

pytestmark = pytest.mark.full_solver_time  # schedules the solver must find: extras made again or held

UNET_SIZE = {"base": 4, "levels": 1, "batch": 16}  # scripts/planner_gap.py's ZOO_SIZES["unet"]


def _small_unet(extra: int = 64) -> nx.DiGraph:
    """A U-Net in miniature: a skip from ``a1`` past a max-pool (``pool``, saving ``extra``
    bytes beyond values, its indices) and a bottleneck to ``cat``."""
    from passes.costgraph import add_value

    graph = nx.DiGraph(measured=True)
    add_value(graph, "x", kind="input", order=0, bytes=64, requires_grad=False)
    ops = [("a0", ["x"], 64, ("x",)), ("a1", ["a0"], 64, ("a1",)), ("pool", ["a1"], 32, ("a1",)),
           ("b0", ["pool"], 32, ("pool",)), ("b1", ["b0"], 32, ("b1",)), ("up", ["b1"], 64, ("b1",)),
           ("cat", ["up", "a1"], 128, ()), ("d0", ["cat"], 64, ("cat",)), ("d1", ["d0"], 64, ("d1",)),
           ("o", ["d1"], 64, ("d1",))]
    for order, (name, reads, size, saved) in enumerate(ops, start=1):
        add_value(graph, name, kind="op", order=order, bytes=size, reads=reads, flops=10, saved=saved,
                  saved_extra_bytes=extra if name == "pool" else 0)
    add_value(graph, "output", kind="output", order=len(ops) + 1, bytes=0, reads=["o"])
    return graph


def _status_holding_extras(graph: nx.DiGraph, budget: float) -> str:
    """The executable MILP's status with every extra held from forward, as before extras
    could be made again (``R[t, extra] = 0`` but at its op's home stage)."""
    training = training_graph(graph)
    model = build_milp(training, budget)
    pin_executable(model, training, graph)
    for (kind, t, i, *_), column in model.columns.items():
        if kind == "R" and training.role(i) == "extra" and t != training.home[i]:
            model.bounds[column] = (0.0, 0.0, model.bounds[column][2])
    return model.solve(recompute_objective(model, training), 10).status


def test_an_exact_schedule_makes_an_extra_again_where_holding_it_does_not_fit() -> None:
    """At 0.57 of eager no schedule holding ``pool``'s indices from forward to its backward
    fits, nor does any plan of the other strategies; a schedule dropping them in forward and
    running ``pool`` again with autograd on just before a backward does."""
    graph = _small_unet()
    budget = int(0.57 * eager_peak(graph))
    assert _status_holding_extras(graph, budget) == "infeasible"
    plan = exact_plan(graph, budget, time_limit=10)
    assert plan is not None and plan.peak_bytes <= budget
    schedule = plan.segments[0].schedule
    assert schedule.dropped_extras == ("pool",) and schedule.kept_extras == ()
    assert schedule.grad_reads == (("pool", ("a1",)),)
    assert any(step.extras == ("pool",) and "pool" in step.make for step in schedule.steps), schedule.steps
    check_schedule(graph, schedule)
    validate_plan(graph, plan.segments)
    assert ranked_keeps(graph, plan.segments) == []  # what it keeps is its schedule's: no keep search edits it
    assert "the extra their op saves" in plan.notes[0] and "runs pool with autograd on" in str(plan)
    with pytest.raises(BudgetError):
        fit_budget(graph, budget, exact_seconds=0)  # no exact schedule: nothing fits
    fitted = fit_budget(graph, budget)
    assert fitted.peak_bytes <= budget and any(step.extras for step in fitted.segments[0].schedule.steps)


def test_check_schedule_names_what_is_wrong_with_an_extra() -> None:
    graph = _small_unet()
    step = ScheduleStep("b0", (), ("a0", "a1", "pool"), ((), (), ()), extras=("pool",))
    check_schedule(graph, Schedule(kept=(), steps=(step,), peak_bytes=0, dropped_extras=("pool",)))
    cases = [
        (Schedule((), (), 0, dropped_extras=("pool",)), "no step makes it again"),
        (Schedule((), (replace(step, extras=("a1",)),), 0, dropped_extras=("pool",)), "no step makes it again"),
        (Schedule((), (replace(step, extras=("pool", "b0")),), 0, dropped_extras=("pool", "b0")), "but not its op"),
        (Schedule((), (step,), 0), "forward leaves it to autograd"),
        (Schedule((), (step,), 0, dropped_extras=("pool",), kept_extras=("a1",)), "not in dropped_extras"),
        (Schedule((), (replace(step, free=((), (), ("extra:pool", "extra:pool"))),), 0, dropped_extras=("pool",)),
         "'extra:pool' is let go but not held"),
    ]
    for schedule, message in cases:
        with pytest.raises(ScheduleError, match=message):
            check_schedule(graph, schedule)


def _plan_making_an_extra(graph: nx.DiGraph, fractions: tuple[float, ...]):
    """The first plan of ``graph`` at these fractions of eager running the executable MILP's
    schedule with extras allowed (one solve: :func:`passes.exact.exact_plan` takes one
    holding them where it recomputes as little) whose steps make an extra again (the solver
    picks among schedules of equal recompute: not every one does)."""
    for fraction in fractions:
        result = checkmate_schedule(graph, int(fraction * eager_peak(graph)), time_limit=20, executable=True)
        if result is None:
            continue
        schedule = schedule_of(graph, training_graph(graph), result.R, result.S)
        if any(step.extras for step in schedule.steps):
            return plan_of_segments(graph, "exact", [scheduled_segment(graph, schedule)], peak_bytes=schedule.peak_bytes)
    return None


def _unet_plan_making_an_extra(graph: nx.DiGraph):
    """The zoo U-Net's, between the floor of schedules holding every extra and the floor of
    those that may make one again (0.66-0.76 of eager where the machine's costs put them)."""
    return _plan_making_an_extra(graph, (0.72, 0.7, 0.74, 0.68, 0.76, 0.66))


class _FunctionalPoolUNet(zoo.UNet):
    """The zoo U-Net pooling with ``F.max_pool2d`` (a function the step holds as an
    attribute, ``max_pool2d_function``) rather than its ``nn.MaxPool2d`` (a module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips), strict=True):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def _functional_pool_unet() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = _FunctionalPoolUNet(base=UNET_SIZE["base"], levels=UNET_SIZE["levels"])
    return model, model.example_inputs(UNET_SIZE["batch"])


@pytest.mark.parametrize(("make", "pool"), [
    pytest.param(lambda: zoo.make("unet", **UNET_SIZE), "pool", id="module"),
    pytest.param(_functional_pool_unet, "max_pool2d", id="function"),
])
def test_an_exact_schedule_making_max_pools_indices_again_trains_like_eager_at_its_simulated_peak(make, pool: str) -> None:
    """The zoo U-Net: its max-pool's indices are dropped in forward and held again from a
    step running the pool with autograd on; outputs, gradients and peak as planned."""
    model, inputs = make()
    reference, model = fresh_pair(model)
    analysis = analyze(model, inputs)
    plan = _unet_plan_making_an_extra(analysis.cost_graph)
    assert plan is not None, "no exact schedule at 0.66-0.76 of eager makes the max-pool's indices again"
    rewritten = generate_rewrite(model, Analysis(analysis.captured, analysis.cost_graph, plan))
    assert "exact_0_step_" in rewritten.code and f"with_autograd_for_saved_extras(cache, '{pool}'" in rewritten.code
    assert "run with autograd on to hold what it saves beyond values" in rewritten.code
    assert_trains_like_twice(reference, model, rewritten, inputs)
    assert_peak_as_simulated(rewritten, inputs)


def test_an_exact_schedule_making_batchnorms_statistics_again_trains_like_eager_at_its_simulated_peak() -> None:
    """DenseNet: a BatchNorm's extra (its batch statistics) is packed beside its weight and
    running statistics, which match no value either: all are taken by position from the
    step's run of the norm with autograd on (running statistics on scratch copies: counted
    once a batch, as in eager)."""
    model, inputs = zoo.make("densenet", layers=2, blocks=1, batch=8)
    reference, model = fresh_pair(model)
    analysis = analyze(model, inputs)
    plan = _plan_making_an_extra(analysis.cost_graph, (0.65, 0.7, 0.75, 0.8))
    assert plan is not None, "no exact schedule at 0.65-0.8 of eager makes a BatchNorm's statistics again"
    rewritten = generate_rewrite(model, Analysis(analysis.captured, analysis.cost_graph, plan))
    assert_trains_like_twice(reference, model, rewritten, inputs)  # buffers (running statistics) included
    assert_peak_as_simulated(rewritten, inputs)


def _holding_extras_from_forward(plan):
    """``plan`` with its schedule holding each dropped extra from forward in the call's
    cache instead of making it again (``kept_extras``): the runtime's other way to them."""
    (segment,) = plan.segments
    schedule = segment.schedule
    held = replace(schedule, kept_extras=schedule.dropped_extras, steps=tuple(replace(s, extras=()) for s in schedule.steps))
    return replace(plan, segments=(replace(segment, schedule=held),))


def test_extras_held_from_forward_by_the_schedule_train_like_eager() -> None:
    """An extra the schedule holds from forward (to let it go and make it again later, where
    the solver finds that pays) is taken from the call's cache by its handle: eager's
    gradients, and no op runs with autograd on."""
    model, inputs = zoo.make("unet", **UNET_SIZE)
    reference, model = fresh_pair(model)
    analysis = analyze(model, inputs)
    graph = analysis.cost_graph
    plan = _unet_plan_making_an_extra(graph)
    assert plan is not None and plan.segments[0].schedule.dropped_extras == ("pool",)
    rewritten = generate_rewrite(model, Analysis(analysis.captured, graph, _holding_extras_from_forward(plan)))
    assert "with_autograd_for_saved_extras" not in rewritten.code
    assert_trains_like_twice(reference, model, rewritten, inputs)


def test_an_op_saving_other_tensors_than_in_forward_is_named() -> None:
    """The extras are told apart by their positions among what the op packs: a run again
    packing another number of tensors is refused, naming the op and the way out."""
    from graphckpt.exact import StepCache, with_autograd_for_saved_extras

    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    cache = StepCache()
    cache.extra_packs["pool"] = ((1,), 2)  # max-pool packs its input, then its indices
    value = with_autograd_for_saved_extras(cache, "pool", F.max_pool2d, (x, 2), {})
    assert not value.requires_grad and cache["extra:pool"][0].dtype == torch.int64
    cache.extra_packs["pool"] = ((1,), 3)
    with pytest.raises(RuntimeError, match=r"'pool', run again for its extra .* saved 2 tensors where forward saved 3"
                                           r".*exact=False"):
        with_autograd_for_saved_extras(cache, "pool", F.max_pool2d, (x, 2), {})
    with pytest.raises(RuntimeError, match="forward did not drop it"):
        with_autograd_for_saved_extras(StepCache(), "pool", F.max_pool2d, (x, 2), {})


def test_no_extra_is_made_again_under_autocast() -> None:
    """Under autocast an extra may hold casts autocast's cache keeps to the end of forward
    (:func:`passes.checkmate.extras_stay`): the small U-Net's budget that only making the
    indices again meets is refused there, and a looser one is met holding them."""
    graph = _small_unet()
    graph.graph["autocast"] = "cpu:bfloat16"
    assert exact_plan(graph, int(0.57 * eager_peak(graph)), time_limit=10) is None
    plan = exact_plan(graph, int(0.7 * eager_peak(graph)), time_limit=10)
    assert plan is not None and plan.segments[0].schedule.dropped_extras == ()
