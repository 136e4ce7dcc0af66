"""What a batch norm in training holds, simulated as measured: its saved batch statistics in
the dtype the real kernel makes them (under bf16 autocast on CPU torch's fake kernel says
bf16, the real one float32), and the scratch copies of its running statistics a recompute
updates instead of the model's, which its backward holds (MobileNetV2's bf16 plan at 0.5 of
eager measured 0.6% over its simulated peak for the two together). Both sides are measured on
this machine: no CPU's byte counts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import graphckpt
from graphckpt.api import Analysis, generate_rewrite, plan_cost_graph
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from graphckpt.torch_compat import FakeTensorMode, RealOutputDtypes
from passes.simulate import step_peak

MEASURE_TOLERANCE = 0.03  # as tests/test_autocast_memory.py


def test_a_fake_batch_norm_returns_its_statistics_in_the_real_kernels_dtype() -> None:
    """Under :class:`RealOutputDtypes` the fake kernel's outputs have the real kernel's dtypes,
    whatever those are on this machine's torch (on 2.13's CPU kernel float32 statistics for a
    bf16 input with float32 weights, where the fake one says bf16)."""
    def call(x: torch.Tensor, w: torch.Tensor) -> list[torch.dtype]:
        outputs = torch.ops.aten.native_batch_norm(x, w, torch.zeros_like(w), torch.zeros_like(w), torch.ones_like(w),
                                                   True, 0.1, 1e-5)
        return [t.dtype for t in outputs]

    real = call(torch.randn(4, 6, 3, dtype=torch.bfloat16), torch.ones(6))
    with FakeTensorMode(), RealOutputDtypes():
        fake = call(torch.randn(4, 6, 3, dtype=torch.bfloat16), torch.ones(6))
    assert fake == real


def _saved_statistics_bytes(norm: nn.BatchNorm2d, x: torch.Tensor) -> int:
    """Bytes a real forward of ``norm`` under bf16 autocast saves that are neither its input
    nor its parameters and buffers: its batch statistics, as this machine's kernel makes them."""
    owned = {t.untyped_storage().data_ptr() for t in (x, *norm.parameters(), *norm.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in owned:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    return sum(saved.values())


def test_a_batch_norm_under_autocast_is_priced_at_what_its_kernel_saves() -> None:
    """The cost graph's ``saved_extra_bytes`` of a batch norm run on a bf16 input is what the
    real kernel saves beyond values (half of it before: the fake kernel's bf16 statistics)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 96, 1), nn.BatchNorm2d(96), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = graphckpt.analyze(model, (x,)).cost_graph
        conv_out = model[0](x)
    norm = next(n for n in graph if graph.nodes[n]["saved_extra_bytes"] and "1" in n)
    assert graph.nodes[norm]["saved_extra_bytes"] == _saved_statistics_bytes(copy.deepcopy(model[1]), conv_out.detach())


class NormChain(nn.Module):
    """Batch norms on wide, short rows: their running statistics are as large as their
    activations, so a recompute's copies of them show in the step's peak."""

    def __init__(self, width: int = 4096, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.BatchNorm1d(width), nn.Tanh()) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 2
        return x


@pytest.mark.parametrize("strategy", ["sqrt", "mincut"])
def test_a_recomputes_copies_of_running_statistics_are_simulated(strategy: str) -> None:
    """A recomputed segment's batch norms update copies of their running statistics (the
    model's buffers move once a step) and save them for backward: the plan's step measures its
    simulated peak, and without the copies (``state_copy_bytes`` at 0) the simulator would be
    under the measured peak by more than the tolerance."""
    torch.manual_seed(0)
    model, x = NormChain(), torch.randn(2, 4096, requires_grad=True)
    analysis = graphckpt.analyze(model, (x,))
    graph = analysis.cost_graph
    plan = plan_cost_graph(graph, strategy)
    rewritten = generate_rewrite(model, Analysis(analysis.captured, graph, plan))
    assert any(s.recompute for s in plan.segments)
    copied = [n for n in graph if graph.nodes[n]["state_copy_bytes"]]
    assert copied and all(graph.nodes[n]["state_copy_bytes"] == 2 * 4096 * 4 for n in copied)
    measured = measure_step(rewritten, (x,), zoo.scalar_loss, repeats=1).peak_bytes
    assert abs(measured / plan.peak_bytes - 1) <= MEASURE_TOLERANCE, (measured, plan.peak_bytes)
    without = copy.deepcopy(graph)
    for name in copied:
        without.nodes[name]["state_copy_bytes"] = 0
    assert measured / step_peak(without, plan.segments) - 1 > MEASURE_TOLERANCE
