"""torch modules an fx capture would keep whole: PyTorch's transformer layers are traced into,
and torch modules that update their own buffers run once a step (:mod:`graphckpt.leaf_modules`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import graphckpt
from graphckpt.leaf_modules import stateful_modules
from graphckpt.tools.measure import measure_step
from passes.segments import PlanError
from tests.equivalence import assert_rewrite_trains_like, assert_trains_like, fresh_pair
from tests.test_enable import _checkpointed as checkpointed_blocks


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


class _Encoder(nn.Module):
    """The encoder a user builds from torch.nn alone, dropout on."""

    def __init__(self, layers: int = 4, d: int = 32) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


class _Seq2Seq(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.transformer = nn.Transformer(d, 4, 2, 2, 4 * d, dropout=0.1, batch_first=True)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.transformer(source, target)


@pytest.mark.parametrize("options", [{"strategy": "sqrt"}, {"budget": 0.5}], ids=["sqrt", "budget-0.5"])
def test_an_nn_transformer_encoder_is_planned_inside_and_trains_like_eager(options: dict) -> None:
    """Kept whole, ``nn.TransformerEncoder`` was the model's one op: "0 of 1 segments
    recomputed", nothing saved, no word said. Traced into, its layers are planned like any
    other: two steps with dropout equal eager's, and a budget of half of eager's measures
    below 0.6 of eager's peak."""
    torch.manual_seed(0)
    reference, model = fresh_pair(_Encoder())
    inputs = (torch.randn(8, 16, 32),)
    rewritten = graphckpt.rewrite(model, inputs, **options)
    assert "captured with export" in rewritten.code and " 0 of " not in rewritten.code.splitlines()[0]
    for _ in range(2):
        assert_trains_like(reference, model, rewritten, inputs, loss_fn=_loss)
    if "budget" in options:
        eager = measure_step(reference, inputs, _loss).peak_bytes
        assert measure_step(rewritten, inputs, _loss).peak_bytes < 0.6 * eager


def test_an_nn_transformer_with_its_decoder_trains_like_eager() -> None:
    torch.manual_seed(0)
    assert_rewrite_trains_like(_Seq2Seq(), (torch.randn(4, 10, 32), torch.randn(4, 7, 32)), _loss, strategy="sqrt")


class _SpectralBlock(nn.Module):
    """A residual block whose first Linear is spectrally normalised by parametrization: its
    forward updates the ``_u``/``_v`` buffers in place (the power iteration) in training."""

    def __init__(self, width: int = 32, spectral: bool = True) -> None:
        super().__init__()
        first = nn.Linear(width, width)
        self.first = parametrizations.spectral_norm(first) if spectral else first
        self.second = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(torch.tanh(self.first(torch.tanh(x))))


class _SpectralChain(nn.Module):
    def __init__(self, spectral: tuple[bool, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_SpectralBlock(spectral=s) for s in spectral])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("strategy", ["sqrt", "mincut", "optimal"])
def test_a_parametrized_spectral_norm_moves_its_buffers_once_a_step(strategy: str) -> None:
    """A recompute reran the power iteration: ``_u`` moved twice a step and backward got
    another weight than forward used, so the gradients of every layer before it differed
    from eager's without a word. Two steps now train like eager, buffers included, and
    ``gm.code`` names the Linears it never recomputes."""
    torch.manual_seed(0)
    reference, model = fresh_pair(_SpectralChain((True,) * 6))
    inputs = (torch.randn(16, 32, requires_grad=True),)
    rewritten = graphckpt.rewrite(model, inputs, strategy=strategy)
    assert "updating their own buffers run once a step" in rewritten.code
    assert "blocks.0.first" in rewritten.code
    for _ in range(2):
        assert_trains_like(reference, model, rewritten, inputs, loss_fn=_loss)


def test_enable_leaves_blocks_with_a_parametrized_spectral_norm_uncheckpointed() -> None:
    """Checkpointing a block whole reruns its power iteration; enable checkpoints the other
    blocks only, and trains like eager; with every block holding one it refuses, naming them."""
    torch.manual_seed(0)
    reference, model = fresh_pair(_SpectralChain((False, True, False, True)))
    inputs = (torch.randn(16, 32, requires_grad=True),)
    graphckpt.enable(model, inputs)
    assert checkpointed_blocks(model) == ["blocks.0", "blocks.2"]
    for _ in range(2):
        assert_trains_like(reference, model, model, inputs, loss_fn=_loss)
    with pytest.raises(PlanError, match=r"update buffers of their own \(blocks.0.first.parametrizations.weight.0"):
        graphckpt.enable(_SpectralChain((True, True)), inputs)


def test_stateful_modules_are_torch_modules_with_buffers_but_not_norms() -> None:
    """The model's own modules with buffers (a causal mask, rotary frequencies) are traced
    into, never kept whole, and are not counted; a norm's running statistics are not either."""
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(4, 4).tril())
            self.norm = nn.BatchNorm1d(4)
            self.linear = parametrizations.spectral_norm(nn.Linear(4, 4))

    assert stateful_modules(Masked()) == ["linear.parametrizations.weight.0"]
    assert stateful_modules(Masked(), prefix="blocks.3") == ["blocks.3.linear.parametrizations.weight.0"]


class _ShapeBranchingSpectralChain(_SpectralChain):
    """fx cannot trace the branch on a shape, so capture goes to torch.export, which records
    the power iteration inside a ``no_grad`` region (``wrap_with_set_grad_enabled``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * 0.5
        return super().forward(x)


@pytest.mark.parametrize("options", [{"strategy": "mincut"}, {"budget": 0.8}], ids=["mincut", "budget-0.8"])
def test_an_export_captured_spectral_norm_moves_its_buffers_once_a_step(options: dict) -> None:
    """The region's writes into ``_u``/``_v`` were hidden inside its subgraph: a recompute
    reran it and backward failed ("modified by an inplace operation"). They count as the
    region's own writes now (:func:`graphckpt.written.mutated_arguments`), so it runs once."""
    torch.manual_seed(0)
    inputs = (torch.randn(16, 32, requires_grad=True),)
    rewritten = assert_rewrite_trains_like(_ShapeBranchingSpectralChain((True,) * 6), inputs, _loss, **options)
    assert "captured with export" in rewritten.code


class _LSTMChain(nn.Module):
    """Linears and LSTMs whose final states (h, c) nothing uses: their gradients never come."""

    def __init__(self, depth: int = 4, width: int = 32) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.lstms = nn.ModuleList([nn.LSTM(width // 4, width // 4, batch_first=True) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, lstm in zip(self.linears, self.lstms, strict=True):
            x = lstm(linear(x).view(x.shape[0], 4, -1))[0].reshape(x.shape[0], -1)
        return x


@pytest.mark.parametrize("options", [{"strategy": "sqrt"}, {"budget": 0.6}], ids=["sqrt", "budget-0.6"])
def test_an_lstm_model_is_rewritten_and_trains_like_eager(options: dict) -> None:
    """Rewriting it failed twice over: the profile's gradient watch read the missing
    gradients of h and c (``'NoneType' object has no attribute 'shape'``), and replaying
    oneDNN's LSTM backward on stand-in values to measure its scratch crashed the process
    (a segmentation fault; now never replayed: :data:`graphckpt.scratch.OPAQUE_STATE_KERNELS`)."""
    torch.manual_seed(0)
    assert_rewrite_trains_like(_LSTMChain(), (torch.randn(16, 32, requires_grad=True),), _loss, **options)
