"""State updates (running statistics, batch counters) under every plan: a step of the rewrite
updates the model's buffers exactly as eager does, once per step and in eager's order.

A norm layer called at several places updates one set of buffers several times; the
updates do not commute (momentum), so no plan may reorder them. Captured with
``torch.export`` a BatchNorm is an ``aten.batch_norm`` writing ``get_attr`` buffers plus an
``add_`` on its counter: those writes must stay recomputable (or no plan saves memory) and a
recompute must leave the buffers alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn

import graphckpt
import graphckpt.capture
from graphckpt.api import analyze
from graphckpt.codegen import generate
from graphckpt.leaf_modules import trace_model
from passes.plan import Candidate, selective, simulated
from tests.equivalence import assert_trains_like, fresh_pair

STRATEGIES = ["sqrt", "articulation", "mincut", "auto", "optimal"]
WIDTH, BATCH, DEPTH = 32, 64, 40


class SharedNorm(nn.Module):
    """One BatchNorm1d applied to three values next to each other, one of them read only at
    the end. A min-cut boundary once put the third call before the second (keeping the
    second's output across the boundary costs bytes, its input is free): running
    statistics off by ~5e-3 under articulation, mincut and optimal. ``all_used``: every
    call's result reaches the output (then optimal alone reordered them)."""

    def __init__(self, all_used: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.all_used = all_used
        self.norm = nn.BatchNorm1d(WIDTH)
        self.first = nn.Linear(WIDTH, WIDTH)
        self.chain = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.late = nn.Linear(WIDTH, WIDTH)
        self.last = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unused = torch.nn.functional.gelu(x + x)
        a = self.first(x)
        p = self.norm(x)
        q = self.norm(x)
        r = self.norm(a)
        h = x
        for layer in self.chain:
            h = torch.tanh(layer(h))
        if self.all_used:
            return self.late(q) + self.last(h) + (p * r).sum()
        del unused, p, r  # computed (and counted by the norm) but not used: a probe, say
        return self.late(q) + self.last(x)


class DeepSharedNorm(nn.Module):
    """One BatchNorm1d at the start, in the middle and at the end of a deep chain: deep
    enough for budgets of 0.5 and 0.3 (nested segments)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.first = nn.Linear(WIDTH, WIDTH)
        self.chain = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.last = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(x + x)
        a = self.norm(self.first(x))
        b = self.norm(x)
        c = self.norm(a)
        for layer in self.chain:
            h = torch.tanh(layer(h))
        return self.last(h * b) + c


class SharedFunctionalNorm(nn.Module):
    """``F.batch_norm`` on one pair of the module's own buffers at three places."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.register_buffer("mean", torch.zeros(WIDTH))
        self.register_buffer("var", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = []
        for index, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if index % 13 == 12:
                x = nn.functional.batch_norm(x, self.mean, self.var, training=self.training)
                outputs.append(x)
        return sum(outputs)


def _check(make: Callable[[], nn.Module], **options) -> None:
    reference, model = fresh_pair(make().train())
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    rewritten = graphckpt.rewrite(model, (x,), **options)
    assert rewritten.segments or rewritten.scheduled, "nothing is recomputed"
    for _ in range(2):  # the second step also checks each step counts its batch once
        assert_trains_like(reference, model, rewritten, (x,))


STRATEGY_PLANS = [pytest.param({"strategy": s}, id=s) for s in STRATEGIES] + [
    pytest.param({"strategy": s, "segments": n}, id=f"{s}-{n}") for s in ("sqrt", "articulation", "mincut")
    for n in (2, 3, 6)]
BUDGET_PLANS = [pytest.param({"budget": b}, id=f"budget-{b}") for b in (0.5, 0.3)]


@pytest.mark.parametrize("options", STRATEGY_PLANS)
@pytest.mark.parametrize("all_used", [False, True], ids=["some-unused", "all-used"])
def test_norm_layer_called_at_several_places_updates_like_eager(all_used: bool, options: dict) -> None:
    _check(partial(SharedNorm, all_used), **options)


@pytest.mark.parametrize("options", STRATEGY_PLANS + BUDGET_PLANS)
def test_norm_layer_called_along_a_deep_chain_updates_like_eager(options: dict) -> None:
    _check(DeepSharedNorm, **options)


@pytest.mark.parametrize("options", STRATEGY_PLANS + BUDGET_PLANS)
def test_functional_norm_on_shared_buffers_updates_like_eager(options: dict) -> None:
    _check(SharedFunctionalNorm, **options)


@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_budget_plans_nest_segments_around_shared_norms(budget: float) -> None:
    """The budget tests above exercise nested segments (at 0.3 at least)."""
    plan = graphckpt.plan(DeepSharedNorm().train(), (torch.randn(BATCH, WIDTH),), budget=budget)
    assert plan.peak_bytes <= budget * plan.eager_peak_bytes
    if budget == 0.3:
        assert max(s.depth for s in plan.segments) >= 2


@pytest.mark.parametrize("model_class", [SharedNorm, DeepSharedNorm, SharedFunctionalNorm])
def test_updates_of_one_buffer_keep_their_order_in_the_cost_graph(model_class: type[nn.Module]) -> None:
    x = torch.randn(BATCH, WIDTH)
    graph = analyze(model_class().train(), (x,), strategy="mincut").cost_graph
    norms = [n for n, label in graph.nodes(data="label") if label == "norm" or label == "batch_norm"]
    assert len(norms) == 3
    assert all(graph.nodes[n]["ordered"] and graph.nodes[n]["recomputable"] for n in norms)


@pytest.mark.parametrize("model_class", [SharedNorm, DeepSharedNorm, SharedFunctionalNorm])
def test_selective_plans_update_like_eager(model_class: type[nn.Module]) -> None:
    reference, model = fresh_pair(model_class().train())
    x = torch.randn(BATCH, WIDTH)
    analysis = analyze(model, (x,), strategy="mincut", segments=3)
    plan = simulated(analysis.cost_graph, selective(analysis.cost_graph, Candidate("mincut", analysis.plan.segments)))
    assert any(s.saved_inside for s in plan.segments)
    rewritten = generate(analysis.captured.graph_module, model, plan)
    for _ in range(2):
        assert_trains_like(reference, model, rewritten, (x,))


def test_export_captured_shared_norm_recomputes_and_updates_like_eager(monkeypatch) -> None:
    """The same model through torch.export: aten.batch_norm on get_attr buffers and an
    add_ on the counter, three times each, all recomputed, all in order."""

    def no_fx(*args, **kwargs):
        raise RuntimeError("fx disabled for this test")

    monkeypatch.setattr(graphckpt.capture, "trace_fx", no_fx)
    for strategy in STRATEGIES:
        reference, model = fresh_pair(SharedNorm(all_used=True).train())
        x = torch.randn(BATCH, WIDTH)
        rewritten = graphckpt.rewrite(model, (x,), strategy=strategy, segments=None if strategy in ("auto", "optimal")
                                      else 3)
        assert "captured with export" in rewritten.meta["graphckpt_header"]
        graph = analyze(SharedNorm(all_used=True).train(), (x,)).cost_graph
        assert all(graph.nodes[n]["recomputable"] for n in graph if graph.nodes[n]["kind"] == "op")
        for _ in range(2):
            assert_trains_like(reference, model, rewritten, (x,))


class _ConvNormChain(nn.Module):
    def __init__(self, momentum: float | None = 0.1, depth: int = 4, channels: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(depth) for m in (
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels, momentum=momentum), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _square(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


@pytest.mark.parametrize("options", [{"strategy": "sqrt"}, {"budget": 0.6}], ids=["sqrt", "budget-0.6"])
def test_a_batch_norm_keeping_a_cumulative_average_is_rewritten(options: dict) -> None:
    """``momentum=None`` reads the batch count as a Python number, which the fake-tensor
    profile could not give: rewrite failed with ``DataDependentOutputException``. Profiled
    with a fixed momentum, three steps update the running statistics (and the count) as
    eager's do."""
    torch.manual_seed(0)
    reference, model = fresh_pair(_ConvNormChain(momentum=None))
    inputs = (torch.randn(4, 8, 16, 16, requires_grad=True),)
    rewritten = graphckpt.rewrite(model, inputs, **options)
    for _ in range(3):
        assert_trains_like(reference, model, rewritten, inputs, loss_fn=_square)
    assert model.body[1].num_batches_tracked.item() == 3


@pytest.mark.parametrize("momentum", [0.1, None])
def test_enable_recomputes_a_block_with_batch_norms_selectively(momentum: float | None) -> None:
    """A selective block's recompute made the scratch copies of its running statistics under
    torch's selective mode, which took the clones for forward's ops and failed backward
    ("aten.clone.default encountered during backward but not found in storage")."""
    torch.manual_seed(0)
    reference, model = fresh_pair(nn.Sequential(*[_ConvNormChain(momentum) for _ in range(4)]))
    inputs = (torch.randn(4, 8, 16, 16, requires_grad=True),)
    graphckpt.enable(model, inputs, budget=0.6)
    assert any(getattr(m.__dict__.get("forward"), "selective", False) for m in model.modules())
    for _ in range(3):
        assert_trains_like(reference, model, model, inputs, loss_fn=_square)


class _BatchNormInPython(nn.BatchNorm1d):
    """timm's ``BatchNormAct2d`` pattern: the batch counted in the module's own code, then
    ``F.batch_norm``. fx handed that code the real counter, so the count ran once while the
    model was traced and was missing from the graph: every timm EfficientNet, MobileNetV3,
    RegNet, DenseNet, CSPNet... ended each step under rewrite and enable with
    ``num_batches_tracked`` off by one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                        self.training, self.momentum, self.eps)


class _SeenCounter(nn.Module):
    """Counts the samples it has seen in a buffer nothing else reads; ``assigned`` assigns
    the count (``self.seen = self.seen + n``), which fx cannot record (capture falls back to
    torch.export), instead of writing it in place."""

    def __init__(self, assigned: bool = False) -> None:
        super().__init__()
        self.assigned = assigned
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.assigned:
            self.seen += x.shape[0]
        else:
            self.seen.add_(x.shape[0])
        return x


BUFFER_WRITERS = {"batch-norm-in-python": lambda: _BatchNormInPython(WIDTH), "counter": _SeenCounter,
                  "counter-assigned": lambda: _SeenCounter(assigned=True)}


@pytest.mark.parametrize("how", ["sqrt", "mincut", "enable"])
@pytest.mark.parametrize("writer", list(BUFFER_WRITERS))
def test_buffers_written_by_the_models_own_code_move_once_a_step(writer: str, how: str) -> None:
    """Capture leaves the buffers alone, and three steps move them as eager's do (``enable``:
    a recompute writes scratch copies of whatever its block's forward wrote)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), BUFFER_WRITERS[writer](), nn.Tanh())
                            for _ in range(6)])
    reference, model = fresh_pair(model)
    inputs = (torch.randn(BATCH, WIDTH),)
    if how == "enable":
        rewritten = graphckpt.enable(model, inputs)
    else:
        rewritten = graphckpt.rewrite(model, inputs, strategy=how)
        assert " 0 of " not in rewritten.code.splitlines()[0]
    for (name, buffer), (_, untouched) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(buffer, untouched), f"capture moved {name}"
    for _ in range(3):
        assert_trains_like(reference, model, rewritten, inputs, loss_fn=_square)


def test_fx_refuses_a_forward_assigning_a_buffer_and_puts_it_back() -> None:
    """fx cannot record ``self.seen += n``; its trace stored a stand-in on the model. The
    buffer is put back and the error names it, so capture falls back to torch.export."""
    model = nn.Sequential(nn.Linear(2, 2), _SeenCounter(assigned=True))
    seen = model[1].seen
    with pytest.raises(torch.fx.proxy.TraceError, match=r"assigning buffer 1\.seen"):
        trace_model(model)
    assert model[1].seen is seen and model[1].seen.item() == 0
