"""An op that writes one of its arguments after saving it for backward (``rrelu_with_noise``'s
noise) is never recomputed (:func:`graphckpt.op_kinds.writes_an_argument`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphckpt
from tests.equivalence import assert_rewrite_trains_like, assert_trains_like, fresh_pair
from tests.test_enable import _checkpointed as checkpointed_blocks


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


class _RReLUChain(nn.Module):
    def __init__(self, depth: int = 8, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.acts = nn.ModuleList([nn.RReLU() for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, act in zip(self.layers, self.acts, strict=True):
            x = act(layer(x))
        return x


@pytest.mark.parametrize("options", [{"strategy": "sqrt"}, {"strategy": "mincut"}, {"budget": 0.8}],
                         ids=["sqrt", "mincut", "budget-0.8"])
def test_rrelu_is_never_rerun_and_trains_like_eager(options: dict) -> None:
    """``rrelu_with_noise`` saves its ``noise`` argument for backward, then writes the random
    slopes into it. torch's checkpoint stops a recompute once every saved tensor is packed,
    before that write, so backward read a noise never filled (torch's own
    ``checkpoint(use_reentrant=False)`` gives RReLU wrong gradients so): every gradient
    upstream of an RReLU differed from eager's, silently. An op writing an argument is now
    never recomputed."""
    torch.manual_seed(0)
    assert_rewrite_trains_like(_RReLUChain(), (torch.randn(32, 64, requires_grad=True),), _loss, **options)


def test_enable_does_not_checkpoint_a_block_with_an_rrelu() -> None:
    class Block(nn.Module):
        def __init__(self, rrelu: bool) -> None:
            super().__init__()
            self.linear, self.act = nn.Linear(32, 32), nn.RReLU() if rrelu else nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.act(self.linear(x))

    model = nn.Sequential(Block(False), Block(True), Block(False), Block(True))
    torch.manual_seed(0)
    reference, model = fresh_pair(model)
    inputs = (torch.randn(16, 32, requires_grad=True),)
    graphckpt.enable(model, inputs)
    assert checkpointed_blocks(model) == ["0", "2"]
    for _ in range(2):
        assert_trains_like(reference, model, model, inputs, loss_fn=_loss)


class _GRUChain(nn.Module):
    """Linears and two-layer GRUs with dropout between their layers: on CPU a GRU runs
    ``addmm`` per step and applies ``sigmoid_``/``tanh_`` in place to the gates it made."""

    def __init__(self, depth: int = 6, width: int = 32) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.grus = nn.ModuleList([nn.GRU(width // 4, width // 4, num_layers=2, dropout=0.2, batch_first=True)
                                   for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, gru in zip(self.linears, self.grus, strict=True):
            x = gru(linear(x).view(x.shape[0], 4, -1))[0].reshape(x.shape[0], -1)
        return x


@pytest.mark.parametrize("budget", [0.6, 0.8])
def test_a_gru_is_never_recomputed_selectively(budget: float) -> None:
    """A selective segment kept the GRU's ``addmm`` outputs by reference, which its
    ``sigmoid_`` then overwrote: the recompute applied the gates' activations twice, and the
    gradients of the layers before it differed from eager's, silently (torch's own selective
    checkpoint does the same to a GRU). Such a node is recomputed whole, or kept."""
    torch.manual_seed(0)
    reference, model = fresh_pair(_GRUChain())
    inputs = (torch.randn(16, 32, requires_grad=True),)
    rewritten = graphckpt.rewrite(model, inputs, budget=budget)
    for _ in range(2):
        assert_trains_like(reference, model, rewritten, inputs, loss_fn=_loss)


def test_enable_never_recomputes_a_gru_block_selectively() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 32)
            self.gru = nn.GRU(8, 8, num_layers=2, dropout=0.2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.gru(self.linear(x).view(x.shape[0], 4, -1))[0].reshape(x.shape[0], -1)

    torch.manual_seed(0)
    reference, model = fresh_pair(nn.Sequential(*[Block() for _ in range(6)]))
    inputs = (torch.randn(16, 32, requires_grad=True),)
    graphckpt.enable(model, inputs, budget=0.6)  # a budget the old block plan met selectively
    assert checkpointed_blocks(model)
    for _ in range(2):
        assert_trains_like(reference, model, model, inputs, loss_fn=_loss)


def test_enable_never_recomputes_selectively_a_block_writing_a_matmul_output_in_place() -> None:
    """``LeakyReLU(inplace=True)`` on a Linear's output: the rewritten graph runs it out of
    place, but enable runs the model's own forward, where it writes the very tensor torch's
    selective checkpoint keeps; every backward failed ("Tensor cached during selective
    activation checkpoint has been mutated") at the budgets that chose selective blocks."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
            self.act = nn.LeakyReLU(0.1, inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.up(x))
            return x + self.down(torch.tanh(h) * torch.sigmoid(h) + torch.sin(h))

    for budget in (0.9, 0.6):
        torch.manual_seed(0)
        reference, model = fresh_pair(nn.Sequential(*[Block() for _ in range(6)]))
        inputs = (torch.randn(64, 64, requires_grad=True),)
        graphckpt.enable(model, inputs, budget=budget)
        assert checkpointed_blocks(model)
        for _ in range(2):
            assert_trains_like(reference, model, model, inputs, loss_fn=_loss)
