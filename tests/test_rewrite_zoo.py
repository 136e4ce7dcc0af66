"""Every zoo model x every strategy: trains like eager and uses less measured memory."""

from __future__ import annotations

import functools

import pytest
import torch

import graphckpt
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from tests.equivalence import assert_trains_like_twice, zoo_pair

STRATEGIES = ["sqrt", "articulation", "mincut", "auto", "optimal"]
MEMORY_SIZES = {  # large enough that activations dominate the measured peak
    "mlp": {"batch": 256},
    "resnet": {"batch": 16},
    "gpt": {"batch": 8},
    "unet": {"batch": 8},
    "densenet": {"batch": 16},
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", zoo.names())
def test_outputs_gradients_and_buffers_equal_eager(name: str, strategy: str) -> None:
    reference, model, inputs = zoo_pair(name)
    rewritten = graphckpt.rewrite(model, inputs, strategy=strategy)
    assert rewritten.meta["graphckpt_plan"].recomputed_segments, "nothing is recomputed"
    assert_trains_like_twice(reference, model, rewritten, inputs)


@functools.cache
def eager_measured(name: str) -> int:
    """Eager's measured peak of zoo model ``name`` at its memory size, measured once a
    worker: the model is built from the same seed for every strategy."""
    model, inputs = zoo.make(name, **MEMORY_SIZES[name])
    return measure_step(model, inputs, zoo.scalar_loss, repeats=1).peak_bytes


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", zoo.names())
def test_measured_peak_below_eager(name: str, strategy: str) -> None:
    model, inputs = zoo.make(name, **MEMORY_SIZES[name])
    eager = eager_measured(name)
    rewritten = graphckpt.rewrite(model, inputs, strategy=strategy)
    ours = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert ours < eager, f"{name}/{strategy}: measured {ours} B, eager {eager} B"


def test_deep_mlp_chain_best_strategy_halves_measured_peak() -> None:
    model, inputs = zoo.make("mlp", depth=32, width=256, batch=512)
    eager = measure_step(model, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    best = min(
        measure_step(graphckpt.rewrite(model, inputs, strategy=s), inputs, zoo.scalar_loss,
                     repeats=1).peak_bytes
        for s in STRATEGIES
    )
    assert best <= 0.5 * eager, f"best {best / eager:.2f}x eager"


def test_gradients_flow_into_the_models_own_parameters() -> None:
    model, inputs = zoo.make("gpt")
    rewritten = graphckpt.rewrite(model, inputs)
    assert set(rewritten.state_dict()) == set(model.state_dict())
    for name, parameter in model.named_parameters():
        assert rewritten.get_parameter(name) is parameter
    for name, buffer in model.named_buffers():
        assert rewritten.get_buffer(name) is buffer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.head.weight.detach().clone()
    zoo.scalar_loss(rewritten(*inputs)).backward()
    optimizer.step()
    assert not torch.equal(before, model.head.weight)


@pytest.mark.parametrize("name", zoo.names())
def test_selective_plans_keep_matmuls_and_train_like_eager(name: str) -> None:
    from graphckpt.api import analyze
    from graphckpt.codegen import generate
    from passes.plan import Candidate, selective, simulated

    reference, model, inputs = zoo_pair(name)
    analysis = analyze(model, inputs, strategy="mincut")
    flat = Candidate(analysis.plan.strategy, analysis.plan.segments)
    plan = simulated(analysis.cost_graph, selective(analysis.cost_graph, flat))
    assert any(s.saved_inside for s in plan.segments)
    assert plan.recompute_flops < analysis.plan.recompute_flops
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert "keeps matmul/conv outputs" in rewritten.code or "run by saved-tensor hooks" in rewritten.code
    assert_trains_like_twice(reference, model, rewritten, inputs)
