"""A rewritten module planned on an input that needed no gradient warns when training passes
one that does: ops reading it then save what the plan never counted (graphckpt/planned_inputs.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import graphckpt
from graphckpt.enable import enabled_plan
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from tests.device import under_autocast
from tests.equivalence import assert_trains_like, assert_trains_like_twice, fresh_pair

MEASURE_TOLERANCE = 0.03  # measured peak within 3% of the simulated one (issue 15's bar for plan kinds)


class InputMixing(nn.Module):
    """Parameter-free ops on the input (they save nothing unless it needs a gradient), then
    Linear + ReLU layers."""

    def __init__(self, depth: int = 6, width: int = 256) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x * x) * torch.sigmoid(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return h


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _model_and_input() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return InputMixing(), torch.randn(128, 256)


def test_a_call_passing_an_input_the_plan_counted_without_grad_warns() -> None:
    model, x = _model_and_input()
    rewritten = graphckpt.rewrite(model, (x,), budget=0.7)
    plan = rewritten.meta["graphckpt_plan"]
    assert plan.inputs_without_grad == ("x",)
    assert "planned_without_grad_x = graphckpt_planned_inputs_warn_if_needs_grad(x, 'x'" in rewritten.code
    assert "planned for x without gradients" in rewritten.code
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as planned: no warning
        _loss(rewritten(x)).backward()
        with torch.no_grad():  # no backward: nothing saved
            rewritten(x.clone().requires_grad_())
    with pytest.warns(UserWarning, match=r"input 'x' requires grad, but the plan was made on example inputs where "
                                         r"it did not.*\(x\.requires_grad_\(\)\)"):
        _loss(rewritten(x.clone().requires_grad_())).backward()


def test_the_warning_is_for_a_peak_the_plan_misses_and_planning_with_grad_meets_it() -> None:
    """Why it warns: the same plan measured with an input needing a gradient holds more than
    simulated; planned on such an input, the rewrite holds what it simulated and trains like eager."""
    model, x = _model_and_input()
    planned_without = graphckpt.rewrite(model, (x,), budget=0.7)
    with pytest.warns(UserWarning, match="requires grad"):
        missed = measure_step(planned_without, (x.clone().requires_grad_(),), _loss, repeats=1).peak_bytes
    assert missed > (1 + MEASURE_TOLERANCE) * planned_without.meta["graphckpt_plan"].peak_bytes

    reference, model = fresh_pair(_model_and_input()[0])
    grad_input = x.clone().requires_grad_()
    planned_with = graphckpt.rewrite(model, (grad_input,), budget=0.7)
    plan = planned_with.meta["graphckpt_plan"]
    assert plan.inputs_without_grad == () and "planned_without_grad" not in planned_with.code
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_trains_like_twice(reference, model, planned_with, (grad_input,))
        measured = measure_step(planned_with, (grad_input,), _loss, repeats=1).peak_bytes
    assert abs(measured / plan.peak_bytes - 1) <= MEASURE_TOLERANCE, (measured, plan.peak_bytes)


def test_integer_inputs_are_not_checked() -> None:
    """Token ids never need a gradient: nothing to check, nothing in the code."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    rewritten = graphckpt.rewrite(model, (torch.randint(0, 100, (4, 16)),), strategy="sqrt")
    assert rewritten.meta["graphckpt_plan"].inputs_without_grad == ()
    assert "planned_without_grad" not in rewritten.code


def test_a_call_under_another_autocast_than_the_plan_warns() -> None:
    model, x = _model_and_input()
    rewritten = graphckpt.rewrite(model, (x,), budget=0.7)
    assert "planned_autocast = graphckpt_planned_inputs_warn_if_autocast_differs('', " in rewritten.code
    with pytest.warns(UserWarning, match=r"called under autocast cpu:bfloat16, but the plan was made under autocast off"):
        _loss(under_autocast(rewritten)(x)).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        planned_under = graphckpt.rewrite(model, (x,), budget=0.7)
    with pytest.warns(UserWarning, match=r"called under autocast off, but the plan was made under autocast cpu:bfloat16"):
        _loss(planned_under(x)).backward()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")  # no backward: nothing saved
        planned_under(x)


def test_autocast_trains_like_eager_when_planned_under_it() -> None:
    """The checkpoint calls' autocast without its cache casts the same values: gradients equal."""
    reference, model = fresh_pair(zoo.make("mlp", depth=12, width=64, batch=32)[0])
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rewritten = graphckpt.rewrite(model, (x,), strategy="sqrt")
        assert_trains_like(reference, model, rewritten, (x,), loss_fn=zoo.scalar_loss)


def test_enable_planned_under_autocast_holds_its_peak_and_warns_under_another() -> None:
    """``enable``'s checkpointed blocks check the plan's autocast state at each call, as a
    rewritten module does: planned under bf16 the zoo GPT's step under it measures its
    simulated peak; the same plan run without autocast held 1.23-1.35x it (measured), so
    that call warns, and so does a plan made without autocast run under it."""
    model, inputs = zoo.make("gpt")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graphckpt.enable(model, inputs, budget=0.5)
    plan = enabled_plan(model)
    assert plan.autocast == "cpu:bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # called as planned: no warning
        measured = measure_step(under_autocast(model), inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert abs(measured / plan.peak_bytes - 1) <= MEASURE_TOLERANCE, (measured, plan.peak_bytes)
    with pytest.warns(UserWarning, match=r"called under autocast off, but the plan was made under autocast cpu:bfloat16"):
        zoo.scalar_loss(model(*inputs)).backward()
    graphckpt.enable(model, inputs, budget=0.5)  # planned again, without autocast
    with pytest.warns(UserWarning, match=r"called under autocast cpu:bfloat16, but the plan was made under autocast off"):
        zoo.scalar_loss(under_autocast(model)(*inputs)).backward()
