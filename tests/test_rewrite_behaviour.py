"""What users rely on beyond equal numbers: signatures, modes, in-place ops, errors."""

from __future__ import annotations

import copy
import operator
import random
import re

import pytest
import torch
from torch import nn

import graphckpt
from graphckpt import runtime
from graphckpt.capture import CaptureError
from tests.equivalence import assert_trains_like, fresh_pair


class TwoInputsDictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.b = nn.Linear(8, 8)

    def forward(self, x, y, scale=None):
        h = x
        for layer in self.a:
            h = torch.tanh(layer(h)) + y
        if scale is not None:
            h = h * scale
        return {"h": h, "pair": (self.b(h), h.sum())}


class InPlaceChain(nn.Module):
    """In-place writes on values that would make tempting boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = x
        for index, layer in enumerate(self.layers):
            h = layer(h)
            h.mul_(1.5)
            h.add_(0.25)
            if index % 2:
                h = self.relu(h)
            else:
                h.relu_()
        return h


def test_multiple_inputs_kwargs_and_nested_outputs() -> None:
    reference, model = fresh_pair(TwoInputsDictOut())
    x, y, scale = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    rewritten = graphckpt.rewrite(model, (x, y), example_kwargs={"scale": scale}, strategy="sqrt")
    assert_trains_like(reference, model, rewritten, (x, y), {"scale": scale})


@pytest.mark.parametrize("strategy", ["sqrt", "articulation", "mincut"])
def test_inplace_ops_cannot_corrupt_a_kept_boundary(strategy: str) -> None:
    reference, model = fresh_pair(InPlaceChain())
    x = torch.randn(4, 16)
    for segments in (2, 3, 5, 8):
        rewritten = graphckpt.rewrite(model, (x,), strategy=strategy, segments=segments)
        assert_trains_like(reference, model, rewritten, (x,))


class InPlaceWithTensor(nn.Module):
    """An in-place product with a tensor (its out-of-place form saves other tensors), an
    in-place sum with one, then the in-place ReLU family, with the written tensor read again
    after each write."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.relu = nn.Linear(16, 16), nn.Linear(16, 16), nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.a(x)
        h.mul_(x)
        h += x
        h.mul_(2)
        self.relu(h)
        g = self.b(h)
        torch.sigmoid_(g)
        return g * h


def test_inplace_relu_and_scalar_writes_run_out_of_place_without_a_copy() -> None:
    """``ReLU(inplace=True)``, ``relu_``, ``sigmoid_``, ``mul_(2)`` and ``+=`` a tensor of the
    same dtype run as their out-of-place twins (one pass over memory instead of a ``clone``
    and the write), named after the twin (``mul_4 = layers_4.mul(1.5)``, not ``mul__4``); an
    in-place product with a tensor keeps its ``clone``. Gradients are eager's either way."""
    for module, inputs, clones in ((InPlaceChain(), (torch.randn(4, 16),), 0),
                                   (InPlaceWithTensor(), (torch.randn(4, 16),), 1)):
        reference, model = fresh_pair(module)
        rewritten = graphckpt.rewrite(model, inputs, strategy="sqrt", segments=2)
        code = "\n".join(m.code for m in rewritten.modules() if isinstance(m, torch.fx.GraphModule))
        assert re.findall(r"\.[a-z]+_\(", code) == [".mul_("] * clones, code
        assert code.count(".clone()") == clones, code
        for name, method in re.findall(r"(\w+) = \w+\.(\w+)\(", code):  # a twin is named after itself
            assert method.endswith("_") or not (name.endswith("_") or "__" in name), f"{name} = ....{method}("
        assert_trains_like(reference, model, rewritten, inputs)


def test_eval_and_no_grad_run_without_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = InPlaceChain()
    x = torch.randn(4, 16)
    rewritten = graphckpt.rewrite(model, (x,), segments=4)

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint used without grad")

    monkeypatch.setattr(runtime, "checkpoint", refuse)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), model(x))
    assert all(segment.recomputations == 0 for _, segment in rewritten.segments)


def test_recompute_happens_in_backward() -> None:
    model = InPlaceChain()
    x = torch.randn(4, 16)
    rewritten = graphckpt.rewrite(model, (x,), segments=4)
    rewritten(x).sum().backward()
    counts = [segment.recomputations for _, segment in rewritten.segments]
    assert counts and all(count == 1 for count in counts)


def test_a_profiler_trace_names_each_segment_and_its_recompute() -> None:
    """What graphckpt runs shows in a user's profile under the names ``print(gm.code)`` uses:
    each segment's forward, its recompute in backward, and the remakes of segments run by
    hooks (a budget plan of the zoo GPT has all three, and a nested segment)."""
    from graphckpt.tools import zoo

    model, inputs = zoo.make("gpt")
    rewritten = graphckpt.rewrite(model, inputs, budget=0.4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        zoo.scalar_loss(rewritten(*inputs)).backward()
    ranges = {event.name for event in profiler.events() if event.name.startswith("graphckpt ")}
    labels = [name for name, module in rewritten.named_modules() if hasattr(module, "label") and name]
    assert labels
    for name in labels:
        label = name.rsplit(".", 1)[-1]
        assert f"graphckpt {label}" in ranges, (label, sorted(ranges))
    assert any(r.endswith(" recompute") for r in ranges) and any(" remake " in r for r in ranges), sorted(ranges)


def test_code_shows_segments_and_what_they_keep() -> None:
    model = InPlaceChain()
    rewritten = graphckpt.rewrite(model, (torch.randn(4, 16),), strategy="mincut", segments=3)
    code = rewritten.code
    assert "# graphckpt: strategy mincut" in code
    assert "self.segment_0(" in code and "def segment_0(self" in code
    assert "recomputes" in code and "keeps" in code
    plan = rewritten.meta["graphckpt_plan"]
    for name in plan.checkpoints:
        assert name in code
    assert "segment 0 (recomputed" in str(plan)


def test_deepcopy_keeps_state_dict_keys_and_behaviour() -> None:
    model = TwoInputsDictOut()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rewritten = graphckpt.rewrite(model, (x, y))
    clone = copy.deepcopy(rewritten)
    assert set(clone.state_dict()) == set(model.state_dict())
    torch.testing.assert_close(clone(x, y)["h"], rewritten(x, y)["h"])
    clone.load_state_dict(model.state_dict())
    model.load_state_dict(clone.state_dict())
    with pytest.raises(TypeError):  # traced for scale=None: passing it must not be ignored
        rewritten(x, y, scale=torch.ones(4, 8))


def test_plan_without_example_inputs_counts_nodes() -> None:
    plan = graphckpt.plan(TwoInputsDictOut(), strategy="sqrt")
    assert plan.recomputed_segments
    assert plan.forward_flops == sum(1 for s in plan.segments for _ in s.nodes)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.linear(x)
        return x


class ShapeBranch(nn.Module):
    """fx cannot trace the branch on a shape; torch.export can, at the example shape."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.rest = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))

    def forward(self, x):
        h = self.first(x)
        if h.shape[0] > 1:
            h = torch.relu(self.norm(h))
        for layer in self.rest:
            h = torch.tanh(layer(h))
        return h


def test_untraceable_without_inputs_names_the_line() -> None:
    with pytest.raises(CaptureError, match=r"if x.sum\(\) > 0.*example_inputs"):
        graphckpt.rewrite(DataDependent())


def test_data_dependent_control_flow_is_a_clear_error() -> None:
    with pytest.raises(CaptureError, match=r"neither torch\.fx nor torch\.export"):
        graphckpt.rewrite(DataDependent(), (torch.randn(3, 4),))


def test_export_fallback_trains_like_eager() -> None:
    reference, model = fresh_pair(ShapeBranch())
    x = torch.randn(8, 4)
    rewritten = graphckpt.rewrite(model, (x,), strategy="sqrt")
    assert "captured with export" in rewritten.code
    assert set(rewritten.state_dict()) == set(model.state_dict())
    assert_trains_like(reference, model, rewritten, (x,))


def test_non_tensor_inputs_stay_inputs() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))

        def forward(self, x, scale: float):
            return self.layers(x) * scale

    model = Scaled()
    x = torch.randn(2, 4)
    rewritten = graphckpt.rewrite(model, (x, 2.0))
    torch.testing.assert_close(rewritten(x, 3.0), model(x, 3.0))


def test_inplace_without_example_inputs_asks_for_them() -> None:
    with pytest.raises(CaptureError, match="example_inputs"):
        graphckpt.rewrite(InPlaceChain())


def test_empty_graph_is_a_no_op() -> None:
    class Identity(nn.Module):
        def forward(self, x):
            return x

    x = torch.randn(3)
    rewritten = graphckpt.rewrite(Identity(), (x,))
    assert rewritten.meta["graphckpt_plan"].segments == ()
    assert rewritten(x) is x


def test_model_without_parameters() -> None:
    class Waves(nn.Module):
        def forward(self, x):
            for _ in range(9):
                x = torch.sin(x) * 2
            return x

    x = torch.randn(5, requires_grad=True)
    expected = torch.autograd.grad(Waves()(x).sum(), x)[0]
    rewritten = graphckpt.rewrite(Waves(), (x,), segments=3)
    torch.testing.assert_close(torch.autograd.grad(rewritten(x).sum(), x)[0], expected)


def test_unknown_strategy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        graphckpt.rewrite(InPlaceChain(), (torch.randn(2, 16),), strategy="magic")


def test_not_a_module() -> None:
    with pytest.raises(CaptureError, match=r"nn\.Module"):
        graphckpt.rewrite(lambda x: x, (torch.randn(2),))


def test_rng_state_is_kept_only_where_recompute_may_draw() -> None:
    """Dropout masks replay exactly; segments without random ops skip keeping the RNG state
    (5 KiB each on CPU), except without example inputs, where nobody knows which ops draw."""
    from graphckpt.tools import zoo

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(16, 16), nn.Dropout(0.3))])
    x = torch.randn(4, 16)
    reference, model = fresh_pair(model)
    profiled = graphckpt.rewrite(model, (x,), strategy="sqrt")
    assert all(segment.replays_rng for _, segment in profiled.segments)
    assert_trains_like(reference, model, profiled, (x,))
    unknown = graphckpt.rewrite(model, strategy="sqrt")
    assert all(segment.replays_rng for _, segment in unknown.segments)
    assert_trains_like(reference, model, unknown, (x,))
    mlp, inputs = zoo.make("mlp", depth=8, width=16)
    assert not any(segment.replays_rng for _, segment in graphckpt.rewrite(mlp, inputs).segments)


def test_keyword_only_example_inputs_are_profiled() -> None:
    model = TwoInputsDictOut()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rewritten = graphckpt.rewrite(model, example_kwargs={"x": x, "y": y})
    assert rewritten.meta["graphckpt_plan"].eager_peak_bytes > 4 * 8 * 4, "planned on unit costs"
    reference, model = fresh_pair(model)
    assert_trains_like(reference, model, graphckpt.rewrite(model, example_kwargs={"x": x, "y": y}), (),
                       {"x": x, "y": y})


def test_an_inplace_flag_passed_by_position_is_a_write() -> None:
    """``F.relu(h, True)`` writes ``h`` as ``F.relu(h, inplace=True)`` does: both are seen
    as writes (and run out of place); ``F.dropout(h, 0.1, True, True)`` too (it keeps a clone)."""
    import torch.nn.functional as F

    from graphckpt.written import mutated_arguments

    def forward(x):
        h = x * 3
        return F.relu(h, True), F.relu(h, inplace=True), F.dropout(h, 0.1, True, True), F.relu(h)

    graph_module = torch.fx.symbolic_trace(forward)
    calls = [node for node in graph_module.graph.nodes if node.op == "call_function" and node.target is not operator.mul]
    h = next(node for node in graph_module.graph.nodes if node.name == "mul")
    assert [mutated_arguments(graph_module, node) for node in calls] == [[h], [h], [h], []]


def test_a_second_backward_through_a_selective_segment_says_what_to_do() -> None:
    """torch's selective checkpointing hands the outputs it kept to one backward only; a
    second backward through the same forward failed with torch's "aten.empty_like.default
    encountered during backward but not found in storage". It now names the segment, the
    cause and the strategies that support it, whose plan then backpropagates twice."""
    from graphckpt.tools import zoo
    from tests.equivalence import assert_backpropagates_twice

    model, inputs = zoo.make("gpt", layers=2, d=32, seq=16, heads=2, batch=2)
    rewritten = graphckpt.rewrite(model, inputs, strategy="optimal")
    assert any(s.recompute and s.saved_inside for s in rewritten.meta["graphckpt_plan"].segments)
    loss = zoo.scalar_loss(rewritten(*inputs))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"segment_\d+ a second time .*strategy='sqrt'") as raised:
        loss.backward()
    assert "not found in storage" in str(raised.value.__cause__)
    assert_backpropagates_twice(graphckpt.rewrite(model, inputs, strategy="sqrt"), model, inputs)


class TrainingBranches(nn.Module):
    """Python reading ``self.training``, which a trace freezes in its training branch."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.dropout(torch.tanh(layer(x)), 0.3, training=self.training)
        return x * 2 if self.training else x


def test_eval_runs_the_models_own_forward() -> None:
    """A traced ``training=self.training`` stays True: eval output was dropped out and
    doubled. In eval mode the rewritten module runs the model's forward (its code says
    so), also on its deep copies, and goes back to its graph for training."""
    reference, model = fresh_pair(TrainingBranches())
    x = torch.randn(8, 16)
    rewritten = graphckpt.rewrite(model, (x,), strategy="sqrt")
    assert "eval() runs TrainingBranches's own forward" in rewritten.code
    for module in (rewritten, copy.deepcopy(rewritten)):
        module.eval()
        reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(module(x), reference(x))
        torch.testing.assert_close(module(torch.randn(3, 16)).shape, torch.Size([3, 16]))
        module.train()
        reference.train()
    assert model.training, "eval() of the rewritten module left the model's root in eval mode"
    assert_trains_like(reference, model, rewritten, (x,), seed=3)


def test_a_model_cast_after_rewriting_warns_that_its_plan_was_for_another_dtype() -> None:
    model = InPlaceChain()
    rewritten = graphckpt.rewrite(model, (torch.randn(4, 16),), segments=3)
    reference = copy.deepcopy(model).double()
    rewritten.double()
    x = torch.randn(4, 16, dtype=torch.float64)
    with pytest.warns(UserWarning, match="is float64 on cpu, but the plan was made with it float32 on cpu"):
        output = rewritten(x)
    torch.testing.assert_close(output, reference(x))


class GradModeAndAutocastInside(nn.Module):
    """A target computed without gradients and a layer run under bf16 autocast, inside forward:
    fx runs both switches while tracing but cannot put them in its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        with torch.no_grad():
            target = self.layers[1](h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.layers[2](h)
        return torch.tanh(self.layers[3](h.float())) + target


@pytest.mark.parametrize("strategy", ["sqrt", "optimal"])
def test_grad_mode_and_autocast_switched_in_forward_are_captured_by_export(strategy: str) -> None:
    """fx's graph ran both regions with gradients and in float32: the target's layer and the
    layers before it got gradients they must not get, and the autocast layer's output
    differed from eager by 0.3%. The switches send the capture to torch.export, which records
    them; without example inputs the error names the line."""
    reference, model = fresh_pair(GradModeAndAutocastInside())
    x = torch.randn(8, 16, requires_grad=True)
    rewritten = graphckpt.rewrite(model, (x,), strategy=strategy)
    assert "captured with export" in rewritten.code
    assert_trains_like(reference, model, rewritten, (x,))
    with pytest.raises(CaptureError, match=r"fx cannot record switching grad mode \(at .*test_rewrite_behaviour.py:\d+: "
                                           r"`with torch.no_grad\(\):`\); autocast \(at .*Pass example_inputs"):
        graphckpt.rewrite(GradModeAndAutocastInside())


class PythonLayerDrop(nn.Module):
    """LayerDrop decided by Python's ``random``: a trace keeps the capture's draws."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if not (self.training and random.random() < 0.5):
                x = layer(x)
        return x


def test_python_random_draws_in_forward_are_refused() -> None:
    with pytest.raises(CaptureError, match="PythonLayerDrop's forward drew random numbers from Python's random"):
        graphckpt.rewrite(PythonLayerDrop(), (torch.randn(4, 8),))
