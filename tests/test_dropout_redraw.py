"""Dropouts inside selective segments run by saved-tensor hooks (graphckpt.dropout,
passes.hooked.redrawn): the noise is dropped after forward and drawn again from forward's
generator state, so training matches eager, the random stream moves as in eager, and the
peak is where the simulator puts it. ``GRAPHCKPT_TEST_DEVICE=cuda`` runs them on a GPU,
where the noise is the fused kernel's mask."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from graphckpt.api import analyze
from graphckpt.codegen import generate
from graphckpt.dropout import dropout_call
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from graphckpt.torch_compat import dropout_and_saved
from passes.hooked import keeps_by_hooks, marked_values, redrawn, remake_groups, uses
from passes.plan import Candidate, Plan, plan_of_segments, selective, simulated
from tests.device import DEVICE, on_test_device
from tests.equivalence import assert_backpropagates_twice, assert_trains_like_twice, fresh_pair

GPT = {"layers": 2, "d": 64, "heads": 4, "seq": 32, "batch": 4, "dropout": 0.1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_and_saved_is_dropout_bit_for_bit(dtype: torch.dtype) -> None:
    """Same output, same gradient, the generator left where F.dropout leaves it, and the
    tensor returned beside the output is the one autograd saves."""
    x = torch.randn(8, 3, 32, dtype=dtype, device=DEVICE).transpose(0, 2).requires_grad_()
    torch.manual_seed(5)
    expected = F.dropout(x, 0.3, training=True)
    after_expected = torch.rand(4, device=DEVICE)
    saved: list[torch.Tensor] = []
    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        actual, noise = dropout_and_saved(x, 0.3)
    assert torch.equal(torch.rand(4, device=DEVICE), after_expected)
    assert torch.equal(actual, expected)
    (want,) = torch.autograd.grad(expected.sum(), x)
    (got,) = torch.autograd.grad(actual.sum(), x)
    assert torch.equal(got, want)
    assert [t.data_ptr() for t in saved] == [noise.data_ptr()]


class _Dropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop, self.feature, self.inplace = nn.Dropout(0.2), nn.Dropout2d(0.2), nn.Dropout(0.2, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(x) + F.dropout(x, 0.3, training=True) + F.dropout(x, 0.3, training=False)
        return self.feature(self.inplace(y + 1)) + torch.ops.aten.dropout.default(x, 0.25, True)


def test_which_nodes_are_dropouts_drawn_again() -> None:
    """nn.Dropout (its p and training read from the module), F.dropout and ATen's dropout in
    training; not Dropout2d, an in-place dropout or one not training."""
    module = _Dropouts()
    traced = fx.symbolic_trace(module)
    found = {n.name: dropout_call(traced, n) for n in traced.graph.nodes}
    drawn = {name: (call.p, call.module) for name, call in found.items() if call is not None}
    assert drawn == {"drop": (0.2, "drop"), "dropout": (0.3, None), "dropout_default": (0.25, None)}, drawn
    module.eval()
    assert dropout_call(module, next(n for n in traced.graph.nodes if n.name == "drop")) is None


def _selective_gpt(**sizes: object) -> tuple[nn.Module, nn.Module, tuple, object, Plan]:
    model, inputs = on_test_device(*zoo.make("gpt", **{**GPT, **sizes}))
    reference, model = fresh_pair(model)
    analysis = analyze(model, inputs, strategy="mincut")
    graph = analysis.cost_graph
    plan = simulated(graph, selective(graph, Candidate(analysis.plan.strategy, analysis.plan.segments)))
    return reference, model, inputs, analysis, plan


def test_hooked_segments_draw_dropout_again_and_train_like_eager() -> None:
    """A GPT with dropout: selective segments holding dropouts run by hooks, and two steps
    give eager's outputs, gradients and masks (the random stream after them is eager's)."""
    reference, model, inputs, analysis, plan = _selective_gpt()
    graph = analysis.cost_graph
    drawing = [s for s in plan.segments if s.recompute and keeps_by_hooks(graph, s) and redrawn(graph, s)]
    assert drawing, "no hooked segment holds a dropout"
    for segment in drawing:
        assert set(redrawn(graph, segment)) <= set(marked_values(graph, segment))
    rewritten = generate(analysis.captured.graph_module, model, plan)
    assert "draw(hooks, 'drop'" in rewritten.code.replace("graphckpt_dropout_draw", "draw")
    assert_trains_like_twice(reference, model, rewritten, inputs)
    torch.manual_seed(3)
    zoo.scalar_loss(reference(*inputs)).backward()
    expected = torch.rand(3, device=DEVICE)
    torch.manual_seed(3)
    zoo.scalar_loss(rewritten(*inputs)).backward()
    assert torch.equal(torch.rand(3, device=DEVICE), expected)
    reference.eval(), rewritten.eval()
    torch.testing.assert_close(rewritten(*inputs), reference(*inputs), rtol=1e-5, atol=0)


def test_a_retained_graph_with_dropout_backpropagates_twice() -> None:
    """Each backward draws the noise again from the same state: equal gradients. (Only the
    hooked segments recompute: torch's selective checkpointing refuses a second backward.)"""
    _, model, inputs, analysis, plan = _selective_gpt()
    graph = analysis.cost_graph
    segments = tuple(s if not s.recompute or keeps_by_hooks(graph, s) else replace(s, recompute=False, saved_inside=())
                     for s in plan.segments)
    rewritten = generate(analysis.captured.graph_module, model, plan_of_segments(graph, "hooked only", segments))
    assert rewritten.hooked
    assert_backpropagates_twice(rewritten, model, inputs)


def test_hooked_dropout_segments_peak_where_simulated() -> None:
    _, model, inputs, analysis, plan = _selective_gpt(d=128, seq=64, batch=8)
    graph = analysis.cost_graph
    assert any(redrawn(graph, s) for s in plan.segments if s.recompute and keeps_by_hooks(graph, s))
    rewritten = generate(analysis.captured.graph_module, model, plan)
    measured = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert abs(plan.peak_bytes / measured - 1) < 0.03, (plan.peak_bytes, measured)


def test_only_dropouts_are_drawn_again() -> None:
    """A segment with a random op that is no dropout (or a dropout it keeps) stays on torch's
    selective checkpointing, which replays the whole segment's draws."""
    _, _, _, analysis, plan = _selective_gpt()
    graph = analysis.cost_graph
    segment = next(s for s in plan.segments if s.recompute and keeps_by_hooks(graph, s) and redrawn(graph, s))
    dropout = redrawn(graph, segment)[0]
    other = graph.copy()  # a graph of its own: the passes read a cost graph's attributes once
    other.nodes[dropout]["redrawable"] = False
    assert not keeps_by_hooks(other, segment)
    assert not keeps_by_hooks(graph, replace(segment, saved_inside=(*segment.saved_inside, dropout)))


def test_remaking_each_use_runs_a_recipe_per_unpack_and_trains_like_eager() -> None:
    """The same segments made again at every use (``remake_each_use``): a value several ops
    saved (a layer norm's output, read by the query, key and value matmuls) is made once per
    unpack, each dropout draws forward's noise again every time, and two steps give eager's
    outputs, gradients and masks; the peak is where the simulator puts it."""
    reference, model, inputs, analysis, plan = _selective_gpt(d=128, seq=64, batch=8)
    graph = analysis.cost_graph
    segments = tuple(replace(s, remake_each_use=True) if s.recompute and keeps_by_hooks(graph, s) else s
                     for s in plan.segments)
    each = plan_of_segments(graph, "each use", segments)
    expected = sum(len(uses(graph, s)) for s in segments if s.remake_each_use)
    assert expected > sum(len(remake_groups(graph, s)) for s in segments if s.remake_each_use)
    rewritten = generate(analysis.captured.graph_module, model, each)
    zoo.scalar_loss(rewritten(*inputs)).backward()
    assert sum(module.recomputations for _, module in rewritten.hooked) == expected
    model.zero_grad(set_to_none=True)
    assert_trains_like_twice(reference, model, rewritten, inputs)
    measured = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=1).peak_bytes
    assert abs(each.peak_bytes / measured - 1) < 0.03, (each.peak_bytes, measured)
