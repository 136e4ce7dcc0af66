"""Every kind of torch.nn layer a user's model is made of, in blocks of a small residual
model: ``rewrite`` (two strategies) and ``enable`` (every block, and a budget) train like
eager for two steps, buffers included, or refuse naming why. A sweep like this one found
RReLU, a GRU in a selective segment, ``parametrizations.spectral_norm``, LSTMs and
BatchNorm's cumulative average wrong or failing (2026-12-03)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import graphckpt
from passes.segments import PlanError
from tests.equivalence import assert_trains_like

WIDTH = 32


class _Sequence(nn.Module):
    """A recurrent or attention layer over the features cut into 4 steps."""

    def __init__(self, layer: nn.Module, takes_three: bool = False) -> None:
        super().__init__()
        self.layer, self.takes_three = layer, takes_three

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = x.view(x.shape[0], 4, -1)
        out = self.layer(steps, steps, steps) if self.takes_three else self.layer(steps)
        return out[0].reshape(x.shape[0], -1)


LAYERS: dict[str, Callable[[], nn.Module]] = {
    "GELU": nn.GELU,
    "RReLU": nn.RReLU,
    "PReLU": nn.PReLU,
    "Dropout": lambda: nn.Dropout(0.3),
    "Softmax": lambda: nn.Softmax(-1),
    "ReLU(inplace)": lambda: nn.ReLU(inplace=True),
    "LeakyReLU(inplace)": lambda: nn.LeakyReLU(0.1, inplace=True),
    "LayerNorm": lambda: nn.LayerNorm(WIDTH),
    "BatchNorm1d": lambda: nn.BatchNorm1d(WIDTH),
    "BatchNorm1d(momentum=None)": lambda: nn.BatchNorm1d(WIDTH, momentum=None),
    "LSTM": lambda: _Sequence(nn.LSTM(WIDTH // 4, WIDTH // 4, batch_first=True)),
    "GRU(2 layers, dropout)": lambda: _Sequence(nn.GRU(WIDTH // 4, WIDTH // 4, 2, dropout=0.2, batch_first=True)),
    "MultiheadAttention": lambda: _Sequence(nn.MultiheadAttention(WIDTH // 4, 2, dropout=0.1, batch_first=True), True),
    "spectral_norm": lambda: parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH)),
}
RUN_ONCE_A_STEP = {"RReLU", "spectral_norm"}  # never recomputed: enable refuses when every block holds one


class _Block(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.before, self.layer, self.after = nn.Linear(WIDTH, WIDTH), layer, nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.after(self.layer(self.before(x)))


def _pair(name: str) -> tuple[nn.Module, nn.Module]:
    """Two identical models (built from one seed: a deep copy cannot copy every layer)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(nn.Sequential(*[_Block(LAYERS[name]()) for _ in range(6)]))
    return models[0], models[1]


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


INPUTS = (torch.randn(128, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True),)


@pytest.mark.parametrize("strategy", ["sqrt", "mincut"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_rewrite_trains_like_eager(name: str, strategy: str) -> None:
    reference, model = _pair(name)
    rewritten = graphckpt.rewrite(model, INPUTS, strategy=strategy)
    for _ in range(2):
        assert_trains_like(reference, model, rewritten, INPUTS, loss_fn=_loss)


@pytest.mark.parametrize("budget", [None, 0.7])
@pytest.mark.parametrize("name", list(LAYERS))
def test_enable_trains_like_eager_or_says_why_not(name: str, budget: float | None) -> None:
    reference, model = _pair(name)
    if name in RUN_ONCE_A_STEP:
        with pytest.raises(PlanError, match="no block can be recomputed whole"):
            graphckpt.enable(model, INPUTS, budget=budget)
        return
    graphckpt.enable(model, INPUTS, budget=budget)
    for _ in range(2):
        assert_trains_like(reference, model, model, INPUTS, loss_fn=_loss)
