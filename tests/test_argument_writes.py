"""An op that writes one of its arguments after saving it for backward (``rrelu_with_noise``'s
noise) is never recomputed (:func:`graphckpt.op_kinds.writes_an_argument`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphckpt
from tests.equivalence import assert_trains_like, fresh_pair
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
    reference, model = fresh_pair(_RReLUChain())
    inputs = (torch.randn(32, 64, requires_grad=True),)
    rewritten = graphckpt.rewrite(model, inputs, **options)
    assert "recomputed in backward" in rewritten.code and " 0 of " not in rewritten.code.splitlines()[0]
    for _ in range(2):
        assert_trains_like(reference, model, rewritten, inputs, loss_fn=_loss)


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
