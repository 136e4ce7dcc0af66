"""Random DAG models, every strategy (and one segment run by saved-tensor hooks over the whole
graph, its values remade per group or at every use, and the exact solver's schedule): one
training step of the rewrite equals eager.

``model_specs`` (tests/random_model_draws.py) draws a recipe over values of shape (batch,
width): Linear, activations, add/mul, cat + Linear(2w, w), LayerNorm, BatchNorm1d, Dropout,
in-place ``ReLU(inplace=True)`` / ``add_`` / ``mul_`` on intermediates (norm and dropout
outputs included), one Linear / LayerNorm / BatchNorm1d / Dropout module called at several
places (one BatchNorm's running statistics updated several times, in eager's order), 1-3
outputs as a tensor, tuple or dict. Outputs, gradients, every buffer and dropout masks must
equal eager's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import graphckpt
from tests.random_model_draws import BATCH, WIDTH, ModelSpec, RecipeModel, model_specs
from tests.thorough import examples

STRATEGY_NAMES = ("sqrt", "articulation", "mincut", "auto", "optimal")
RTOL, ATOL = 1e-5, 1e-6


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [output[key] for key in sorted(output)]
    return list(output)


def _train_step(module: nn.Module, x: torch.Tensor, seed: int) -> tuple[type, list[torch.Tensor]]:
    torch.manual_seed(seed)
    output = module(x)
    tensors = _tensors(output)
    weights = torch.Generator().manual_seed(1234)
    loss = sum((t * torch.randn(t.shape, generator=weights)).sum() for t in tensors)
    if loss.requires_grad:  # no parameter or input reaches the outputs: nothing to train
        loss.backward()
    return type(output), [t.detach().clone() for t in tensors]


def _rewrite_keeping_values(model: nn.Module, x: torch.Tensor, strategy: str, segments: int | None) -> nn.Module:
    """The ``strategy`` plan with every other value its recomputed segments could keep kept
    from forward (:mod:`passes.keeps`; pointwise values too): per-value keeps on any DAG."""
    from graphckpt.api import Analysis, analyze, generate_rewrite
    from passes.kept_values import add_keeps, ranked_keeps
    from passes.plan import plan_of_segments

    analysis = analyze(model, (x.clone(),), strategy=strategy, segments=segments)
    graph = analysis.cost_graph
    keeps = sorted(ranked_keeps(graph, analysis.plan.segments), key=lambda k: graph.nodes[k[1]]["order"])[::2]
    plan = plan_of_segments(graph, "keeps", add_keeps(graph, analysis.plan.segments, keeps))
    return generate_rewrite(model, Analysis(analysis.captured, graph, plan))


def _rewrite_rematerializing(model: nn.Module, x: torch.Tensor, strategy: str, segments: int | None) -> nn.Module:
    """A plan that rematerializes segment inputs (:mod:`passes.remat`): dropping every other
    value a plan could drop (:mod:`passes.drops`) and that still gives a plan with those before,
    or, when there is none, the ``strategy`` plan rematerializing every input it can."""
    from graphckpt.api import Analysis, analyze, generate_rewrite
    from passes.drops import drop_order, dropped_segments
    from passes.plan import plan_of_segments
    from passes.remat import greedy_remat
    from passes.segments import PlanError

    analysis = analyze(model, (x.clone(),), strategy=strategy, segments=segments)
    graph = analysis.cost_graph
    dropped: list[str] = []
    for value in drop_order(graph)[::2]:
        try:
            dropped_segments(graph, [*dropped, value])
        except PlanError:  # an op that saved it may not be recomputed, or its chain is not pure
            continue
        dropped.append(value)
    chosen = dropped_segments(graph, dropped) if dropped else greedy_remat(graph, analysis.plan.segments, PlanError)
    plan = plan_of_segments(graph, "remat", chosen)
    return generate_rewrite(model, Analysis(analysis.captured, graph, plan))


def _rewrite_one_hooked_segment(model: nn.Module, x: torch.Tensor, hooked: str) -> nn.Module:
    """One selective segment over the whole graph keeping its matmul outputs, as
    :mod:`passes.relaxed` builds them: run by saved-tensor hooks when its ops allow
    (dropouts drawn again), its dropped values made ``"per group"`` or at every use
    (``"each use"``, ``remake_each_use``), holding every other value it may once made
    (``"each use, held"``, ``remake_held``); the ``sqrt`` plan when such a segment is no valid plan."""
    from dataclasses import replace

    from graphckpt.api import Analysis, analyze, generate_rewrite
    from passes.hooked import holdable
    from passes.kept_values import keepable, keeping, whole_graph
    from passes.plan import plan_of_segments
    from passes.segments import PlanError

    analysis = analyze(model, (x.clone(),), strategy="sqrt")
    graph = analysis.cost_graph
    kept = {name for name in graph if graph.nodes[name]["expensive"] and keepable(graph, name)}
    segments = tuple(replace(s, remake_each_use=hooked != "per group") for s in keeping(whole_graph(graph), kept))
    if hooked == "each use, held":
        segments = tuple(replace(s, remake_held=holdable(graph, s)[::2]) if s.recompute else s for s in segments)
    try:
        plan = plan_of_segments(graph, "one hooked segment", segments)
    except PlanError:
        plan = analysis.plan
    return generate_rewrite(model, Analysis(analysis.captured, graph, plan))


def _rewrite_exact(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """The exact solver's schedule at 0.6 of eager (:mod:`passes.exact`: values kept, let go
    and made again before each op's backward, only pure ops made again), or the ``sqrt``
    plan where no such schedule fits or the graph is too large."""
    from graphckpt.api import Analysis, analyze, generate_rewrite
    from passes.exact import exact_plan
    from passes.simulate import eager_peak

    analysis = analyze(model, (x.clone(),), strategy="sqrt")
    graph = analysis.cost_graph
    plan = exact_plan(graph, int(0.6 * eager_peak(graph)), time_limit=2) or analysis.plan
    return generate_rewrite(model, Analysis(analysis.captured, graph, plan))


def _check_same_step(spec: ModelSpec, strategy: str, segments: int | None, keep_values: bool = False,
                     remat: bool = False, hooked: str = "", exact: bool = False) -> None:
    model = RecipeModel(spec)
    model.train()
    reference = copy.deepcopy(model)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(spec.seed))
    # planned on what it trains on: an exact schedule holds only what its example's ops saved,
    # and ops save more when the input needs a gradient
    example = x.clone().requires_grad_(spec.input_requires_grad)
    if keep_values:
        rewritten = _rewrite_keeping_values(model, example, strategy, segments)
    elif remat:
        rewritten = _rewrite_rematerializing(model, example, strategy, segments)
    elif hooked:
        rewritten = _rewrite_one_hooked_segment(model, example, hooked)
    elif exact:
        rewritten = _rewrite_exact(model, example)
    else:
        rewritten = graphckpt.rewrite(model, (example.clone(),), strategy=strategy, segments=segments)
    plan = rewritten.meta["graphckpt_plan"]
    assert set(rewritten.state_dict()) == set(model.state_dict())

    x_ref = x.clone().requires_grad_(spec.input_requires_grad)
    x_new = x.clone().requires_grad_(spec.input_requires_grad)
    kind_ref, expected = _train_step(reference, x_ref, spec.seed + 1)
    kind_new, actual = _train_step(rewritten, x_new, spec.seed + 1)
    where = f"strategy={strategy} segments={segments} {hooked}\n{plan}"
    assert kind_new is kind_ref, where
    assert len(actual) == len(expected), where
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, i=index: f"output {i}: {m}\n{where}")
    if spec.input_requires_grad:
        assert (x_ref.grad is None) == (x_new.grad is None), where
        if x_ref.grad is not None:
            torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"input grad: {m}\n{where}")

    reference_parameters = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        want = reference_parameters[name].grad
        if want is None:
            assert parameter.grad is None, f"{name} has a gradient, eager has none\n{where}"
            continue
        assert parameter.grad is not None, f"{name} has no gradient\n{where}"
        torch.testing.assert_close(parameter.grad, want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"grad of {n}: {m}\n{where}")
    reference_buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, reference_buffers[name]), f"buffer {name} differs\n{where}"

    # Eval mode: running statistics used, Dropout off (and returning its input unchanged).
    model.eval()
    reference.eval()
    with torch.no_grad():
        x_ref, x_new = x.clone(), x.clone()
        for a, e in zip(_tensors(rewritten(x_new)), _tensors(reference(x_ref)), strict=True):
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"eval: {m}\n{where}")


# Found by the search below; kept as explicit examples so that they fail fast.
# One BatchNorm called three times side by side, the second call's result read last: the
# articulation plan (min-cut fallback) ran the third call before the second.
SHARED_NORM_ORDER = ModelSpec(
    modules=(("gelu0", "gelu"), ("linear1", "linear"), ("bn2", "bn"), ("linear3", "linear"), ("linear4", "linear"),
             ("linear5", "linear"), ("linear6", "linear"), ("linear7", "linear")),
    recipe=(("add", 0, 0), ("call", "gelu0", 1), ("mul_", 2, 0), ("call", "linear1", 0), ("call", "bn2", 0),
            ("call", "bn2", 0), ("call", "bn2", 4), ("call", "linear3", 0), ("call", "linear4", 0),
            ("call", "linear5", 0), ("call", "linear6", 6), ("call", "linear7", 0)),
    outputs=(12,), output_form="tuple", input_requires_grad=False, seed=0)
# Writes through a chain of in-place results (h.mul_ -> .add_ -> ReLU(inplace)) and a read of
# the first result afterwards: eager reads relu(2h + x).
INPLACE_CHAIN = ModelSpec(
    modules=(("linear0", "linear"), ("relu1", "relu_"), ("linear2", "linear")),
    recipe=(("call", "linear0", 0), ("mul_", 1, 0), ("add_", 2, 0), ("inplace", "relu1", 3),
            ("call", "linear2", 2)),
    outputs=(5,), output_form="tuple", input_requires_grad=False, seed=0)
# Two Dropouts, the second reading a Linear: the plan must not run the second one first.
DROPOUT_ORDER = ModelSpec(
    modules=(("linear0", "linear"), ("drop1", "drop"), ("drop2", "drop")),
    recipe=(("call", "linear0", 0), ("call", "drop1", 0), ("call", "drop2", 1), ("add", 3, 2)),
    outputs=(4,), output_form="tuple", input_requires_grad=False, seed=0)
# Dropout -> ReLU(inplace=True) with the Dropout's input read afterwards: in eval mode
# Dropout returns its input, so eager's ReLU writes into it.
DROPOUT_THEN_INPLACE = ModelSpec(
    modules=(("linear0", "linear"), ("drop1", "drop"), ("relu2", "relu_"), ("linear3", "linear")),
    recipe=(("call", "linear0", 0), ("call", "drop1", 1), ("inplace", "relu2", 2), ("call", "linear3", 3),
            ("add", 4, 1)),
    outputs=(5,), output_form="tuple", input_requires_grad=False, seed=0)

# In eval mode Dropout returns its input, so add_ writes into x; relu(x) runs before the
# write in eager and must stay before it (min-cut once moved it after).
READ_BEFORE_EVAL_WRITE = ModelSpec(
    modules=(("drop0", "drop"), ("ln1", "ln"), ("linear2", "linear"), ("linear3", "linear")),
    recipe=(("call", "drop0", 0), ("call", "ln1", 0), ("act", "relu", 0), ("act", "relu", 0), ("act", "relu", 0),
            ("add_", 1, 0), ("call", "linear2", 0), ("call", "linear3", 5)),
    outputs=(8,), output_form="tuple", input_requires_grad=False, seed=0)


SEGMENT_COUNTS = st.lists(st.sampled_from([None, 2, 3, 5]), min_size=5, max_size=5)


def _check_every_strategy(spec: ModelSpec, segments: list[int | None]) -> None:
    for strategy, count in zip(STRATEGY_NAMES, segments, strict=True):
        _check_same_step(spec, strategy, count)
    _check_same_step(spec, "mincut", segments[2], keep_values=True)
    _check_same_step(spec, "sqrt", segments[0], remat=True)
    for hooked in ("per group", "each use", "each use, held"):
        _check_same_step(spec, "sqrt", None, hooked=hooked)
    _check_same_step(spec, "exact", None, exact=True)


@pytest.mark.full_solver_time  # its exact schedules: as many as 2 s a solve finds (a few seconds in all)
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=model_specs(), segments=SEGMENT_COUNTS)
@example(spec=INPLACE_CHAIN, segments=[None, None, None, None, None])
@example(spec=DROPOUT_ORDER, segments=[2, 2, 2, 2, None])
@example(spec=DROPOUT_THEN_INPLACE, segments=[None, None, None, None, None])
@example(spec=READ_BEFORE_EVAL_WRITE, segments=[None, None, None, None, None])
@example(spec=SHARED_NORM_ORDER, segments=[None, None, None, None, None])
def test_rewrite_trains_like_eager(spec: ModelSpec, segments: list[int | None]) -> None:
    _check_every_strategy(spec, segments)


@pytest.mark.slow
@pytest.mark.full_solver_time
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=model_specs(max_steps=24), segments=SEGMENT_COUNTS)
def test_rewrite_trains_like_eager_many_models(spec: ModelSpec, segments: list[int | None]) -> None:
    """The search above, longer and on larger recipes (about 7 minutes on 2 busy cores)."""
    _check_every_strategy(spec, segments)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@pytest.mark.parametrize(("spec", "segments"), [
    pytest.param(INPLACE_CHAIN, None, id="inplace-chain"),
    pytest.param(DROPOUT_ORDER, 2, id="dropout-order"),
    pytest.param(DROPOUT_THEN_INPLACE, None, id="dropout-then-inplace-eval"),
    pytest.param(SHARED_NORM_ORDER, None, id="shared-norm-order"),
])
def test_found_examples(spec: ModelSpec, segments: int | None, strategy: str) -> None:
    _check_same_step(spec, strategy, segments)
