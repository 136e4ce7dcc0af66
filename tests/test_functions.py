"""A model's own autograd Functions are kept whole through capture (graphckpt.functions):
the rewrite trains like the untouched model and its memory is the model's, not that of
the Function's forward traced op by op."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphckpt
from graphckpt.api import cost_model
from graphckpt.capture import capture
from graphckpt.functions import _forward
from graphckpt.tools.measure import peak_memory
from passes.simulate import eager_peak
from tests.equivalence import assert_trains_like, default_loss, fresh_pair


class TanhGate(torch.autograd.Function):
    """``x * tanh(x) * scale`` saving only ``x``, as BLOOM's GeLUFunction saves its input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.tanh(x) * x * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        t = torch.tanh(x)
        return grad * ctx.scale * (t + x * (1 - t * t)), None


class ScaleShift(torch.autograd.Function):
    """Two outputs, a constant tensor input that needs no gradient, ``setup_context`` style."""

    @staticmethod
    def forward(x: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2 + shift, x.sin()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, _ = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor, grad_b: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad_a * 2 + grad_b * x.cos(), None


class Tripled(torch.autograd.Function):
    """Returns a tensor and ``None``, as some Functions return an optional second value."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x * 3, None

    @staticmethod
    def backward(ctx, grad: torch.Tensor, nothing: None) -> torch.Tensor:
        return grad * 3


class NoisyGate(torch.autograd.Function):
    """Draws random numbers in forward: must be traced through, never run again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.rand_like(x) > 0.3).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask


class Stack(nn.Module):
    """Residual layers, each through ``function`` (a wide one, so its saves dominate)."""

    def __init__(self, function: str, layers: int = 6, width: int = 64) -> None:
        super().__init__()
        self.function = function
        self.up = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(layers))
        self.register_buffer("shift", torch.linspace(-1, 1, 4 * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down, strict=True):
            h = up(x)
            if self.function == "gate":
                h = TanhGate.apply(h, 0.5)
            elif self.function == "pair":
                a, b = ScaleShift.apply(h, self.shift)
                h = a * b
            elif self.function == "tripled":
                h, nothing = Tripled.apply(h)
                assert nothing is None
            else:
                h = NoisyGate.apply(h)
            x = x + down(h)
        return x


def _model(function: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(function), torch.randn(32, 64, requires_grad=True)


@pytest.mark.parametrize("function", ["gate", "pair", "tripled"])
@pytest.mark.parametrize("strategy", ["sqrt", "articulation", "optimal"])
def test_a_function_kept_whole_trains_like_the_model(function: str, strategy: str) -> None:
    model, x = _model(function)
    reference, model = fresh_pair(model)
    rewritten = graphckpt.rewrite(model, (x,), strategy=strategy)
    assert "torch.ops.graphckpt.autograd_function" in rewritten.code
    assert_trains_like(reference, model, rewritten, (x,))


def test_fx_prefers_export_for_a_model_with_its_own_function() -> None:
    model, x = _model("gate")
    assert capture(model, (x,)).method == "export"
    assert capture(model).method == "fx"  # no inputs to export with: fx's trace, the Function inlined


def test_a_function_that_draws_random_numbers_is_traced_through() -> None:
    model, x = _model("noisy")
    reference, model = fresh_pair(model)
    rewritten = graphckpt.rewrite(model, (x,), strategy="sqrt")
    assert "autograd_function" not in rewritten.code
    assert_trains_like(reference, model, rewritten, (x,))


def test_the_captured_eager_peak_is_the_models_own() -> None:
    """Inlined, the tanh gate saves three tensors of the wide layer where the Function
    saves one: the simulated eager peak is checked against the untouched model's."""
    model, x = _model("gate")
    untouched = copy.deepcopy(model)

    def step() -> None:
        default_loss(untouched(x)).backward()

    step()
    measured = peak_memory(step)
    simulated = eager_peak(cost_model(model, (x,))[1])
    assert abs(simulated - measured) <= 0.03 * measured, (simulated, measured)
    rewritten = graphckpt.rewrite(model, (x,), budget=0.5)

    def rewritten_step() -> None:
        default_loss(rewritten(x)).backward()

    rewritten_step()
    planned, used = rewritten.meta["graphckpt_plan"].peak_bytes, peak_memory(rewritten_step)
    assert used <= 0.5 * simulated * 1.03 and abs(planned - used) <= 0.03 * used, (planned, used)


def test_a_rewrite_loaded_in_another_process_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="rewrite the model in this process"):
        _forward("some.module.NeverCaptured", [torch.ones(2)])
