"""Attention masks that tracing materialises are folded back to what the model calls eagerly
(``graphckpt.masks.fold_constant_masks``): Hugging Face passes no mask, or ``is_causal``, in
eager mode but a mask tensor when traced, which on a GPU picks another fused kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphckpt.capture import trace_export
from graphckpt.masks import mask_meaning

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(nn.Module):
    """One attention call whose mask is all true, causal, a learned bias, or the caller's."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.project = nn.Linear(8, 24)
        self.bias_table = nn.Parameter(torch.zeros(9))  # a learned relative position bias, at zero as Swin's starts

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x).unsqueeze(1).chunk(3, dim=-1)
        length = x.shape[1]
        positions = torch.arange(length, device=x.device)
        if self.kind == "all":
            mask = (positions[None, :] >= 0).expand(length, length)
        elif self.kind == "causal":
            mask = positions[None, :] <= positions[:, None]
        elif self.kind in ("learned", "learned+all"):
            mask = self.bias_table[positions[None, :] - positions[:, None] + length - 1]
            if self.kind == "learned+all":  # Hugging Face's BEiT, traced, adds its padding mask, all true
                mask = mask + (positions >= 0).expand(x.shape[0], 1, length, length)
        else:
            mask = padding[:, None, None, :].expand(-1, 1, length, length)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attention_call(kind: str) -> tuple[torch.fx.Node, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Attention(kind)
    x, padding = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool)
    graph_module = trace_export(model, (x, padding), {})
    (call,) = [n for n in graph_module.graph.nodes if n.target is SDPA]
    return call, graph_module(x, padding), model(x, padding)


def test_an_all_true_mask_is_dropped() -> None:
    call, captured, eager = _attention_call("all")
    assert call.args[3] is None and not call.kwargs.get("is_causal", False)
    torch.testing.assert_close(captured, eager)


def test_a_causal_mask_becomes_is_causal() -> None:
    call, captured, eager = _attention_call("causal")
    assert call.args[3] is None and call.kwargs["is_causal"] is True
    torch.testing.assert_close(captured, eager)


def test_a_mask_read_from_the_inputs_stays() -> None:
    call, captured, eager = _attention_call("padding")
    assert isinstance(call.args[3], torch.fx.Node)
    torch.testing.assert_close(captured, eager)


def test_mask_meaning_of_additive_masks() -> None:
    blocked = torch.finfo(torch.float32).min
    causal = torch.zeros(4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), blocked)
    assert mask_meaning(causal, None) == "causal"
    assert mask_meaning(torch.zeros(2, 1, 4, 4), None) == "none"
    assert mask_meaning(causal.transpose(0, 1), None) is None
    assert mask_meaning(torch.full((4, 4), 0.5), None) is None


def test_a_mask_made_from_parameters_stays() -> None:
    """A learned bias is all zeros when captured (Swin's table starts so) but is no constant:
    folded away, the table would never reach forward nor get a gradient."""
    torch.manual_seed(0)
    model = Attention("learned")
    x, padding = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool)
    graph_module = trace_export(model, (x, padding), {})
    (call,) = [n for n in graph_module.graph.nodes if n.target is SDPA]
    assert isinstance(call.args[3], torch.fx.Node)
    graph_module(x, padding).square().sum().backward()
    captured = model.bias_table.grad.clone()
    model.zero_grad()
    model(x, padding).square().sum().backward()
    assert captured.abs().sum() > 0
    torch.testing.assert_close(captured, model.bias_table.grad)


def test_an_all_true_mask_added_to_a_learned_bias_is_dropped() -> None:
    """A learned bias plus an all-true mask (a boolean's ``+1``, the same for every key,
    which softmax ignores) is passed as the bias alone: no [batch, heads, q, k] float mask
    per layer. Outputs and the bias table's gradient are the model's."""
    torch.manual_seed(0)
    model = Attention("learned+all")
    x, padding = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool)
    graph_module = trace_export(model, (x, padding), {})
    (call,) = [n for n in graph_module.graph.nodes if n.target is SDPA]
    assert call.args[3].meta["val"].shape == (5, 5)  # the bias, not the [2, 1, 5, 5] sum
    captured = graph_module(x, padding)
    captured.square().sum().backward()
    table = model.bias_table.grad.clone()
    model.zero_grad()
    eager = model(x, padding)
    eager.square().sum().backward()
    torch.testing.assert_close(captured, eager)
    assert table.abs().sum() > 0
    torch.testing.assert_close(table, model.bias_table.grad)
