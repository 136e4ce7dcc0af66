"""Random DAG models, every strategy (and one segment run by saved-tensor hooks over the whole
graph, its values remade per group or at every use, and the exact solver's schedule): one
training step of the rewrite equals eager.

``model_specs`` draws a recipe (plain Python data) over values of shape (batch, width):
Linear, activations, add/mul, cat + Linear(2w, w), LayerNorm, BatchNorm1d, Dropout,
in-place ``ReLU(inplace=True)`` / ``add_`` / ``mul_`` on intermediates (norm and dropout
outputs included), one Linear / LayerNorm / BatchNorm1d / Dropout module called at several
places (one BatchNorm's running statistics updated several times, in eager's order), 1-3
outputs as a tensor, tuple or dict. Outputs, gradients, every buffer and dropout masks must
equal eager's. :class:`RecipeModel` interprets the
recipe in ``forward``; fx traces through the loop since the recipe holds no tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import graphckpt
from tests.thorough import examples

WIDTH, BATCH = 8, 4
STRATEGY_NAMES = ("sqrt", "articulation", "mincut", "auto", "optimal")
RTOL, ATOL = 1e-5, 1e-6

# Steps (each appends one value; operands are value indices, 0 is the input):
#   ("call", key, a)          modules[key](v[a])               Linear/LayerNorm/BatchNorm/Dropout/GELU
#   ("act", name, a)          relu | tanh | gelu (functional)
#   ("add", a, b), ("mul", a, b)
#   ("cat", key, a, b)        modules[key](torch.cat([v[a], v[b]], 1)), key a Linear(2w, w)
#   ("inplace", key, a)       modules[key](v[a]) with key a ReLU(inplace=True)
#   ("add_", a, b), ("mul_", a, b)   v[a].add_(v[b]) / v[a].mul_(v[b])
# An in-place step writes into v[a] and appends the same tensor as a new value; v[a] is read
# again afterwards only sometimes (fx then reads the node from before the write). Writes
# go only to storages no autograd node may have saved (neither the producer of its output
# nor a reader of its input), never to the input, so eager backward is valid.
MODULE_KINDS = {
    "linear": lambda: nn.Linear(WIDTH, WIDTH),
    "cat": lambda: nn.Linear(2 * WIDTH, WIDTH),
    "ln": lambda: nn.LayerNorm(WIDTH),
    "bn": lambda: nn.BatchNorm1d(WIDTH),
    "drop": lambda: nn.Dropout(p=0.3),
    "gelu": lambda: nn.GELU(),
    "relu_": lambda: nn.ReLU(inplace=True),
}
# Modules a recipe may call again at another place: one BatchNorm called three times updates
# its running statistics three times, in eager's order.
REUSABLE = ("linear", "ln", "bn", "drop")


@dataclass(frozen=True)
class ModelSpec:
    modules: tuple[tuple[str, str], ...]  # (key, kind) in creation order
    recipe: tuple[tuple, ...]
    outputs: tuple[int, ...]
    output_form: str  # "tensor" | "tuple" | "dict"
    input_requires_grad: bool
    seed: int


class RecipeModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.mods = nn.ModuleDict({key: MODULE_KINDS[kind]() for key, kind in spec.modules})
        with torch.no_grad():  # non-trivial affine parameters for the norms
            for module in self.mods.values():
                if isinstance(module, (nn.LayerNorm, nn.BatchNorm1d)):
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.5, 0.5)
        self.recipe = [tuple(step) for step in spec.recipe]
        self.outputs = list(spec.outputs)
        self.output_form = spec.output_form

    def forward(self, x: torch.Tensor) -> Any:
        values = [x]
        for step in self.recipe:
            op = step[0]
            if op in ("call", "inplace"):
                values.append(self.mods[step[1]](values[step[2]]))
            elif op == "act":
                function = {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}[step[1]]
                values.append(function(values[step[2]]))
            elif op == "add":
                values.append(values[step[1]] + values[step[2]])
            elif op == "mul":
                values.append(values[step[1]] * values[step[2]])
            elif op == "cat":
                values.append(self.mods[step[1]](torch.cat([values[step[2]], values[step[3]]], dim=1)))
            elif op == "add_":
                values.append(values[step[1]].add_(values[step[2]]))
            elif op == "mul_":
                values.append(values[step[1]].mul_(values[step[2]]))
            else:
                raise ValueError(f"unknown step {step!r}")
        results = [values[i] for i in self.outputs]
        if self.output_form == "tensor":
            return results[0]
        if self.output_form == "dict":
            return {f"out{i}": r for i, r in enumerate(results)}
        return tuple(results)


@st.composite
def model_specs(draw, max_steps: int = 16) -> ModelSpec:
    modules: list[tuple[str, str]] = []
    recipe: list[tuple] = []
    live = [0]  # values that may still be read
    storage = {0: 0}  # value -> the value whose storage it is (in-place results share it)
    pinned = {0}  # storages autograd may have saved, and the input's: never written in place

    def new_module(kind: str) -> str:
        key = f"{kind.rstrip('_')}{len(modules)}"
        modules.append((key, kind))
        return key

    def operand() -> int:
        return draw(st.sampled_from(live))

    for _ in range(draw(st.integers(1, max_steps))):
        writable = [v for v in live if storage[v] not in pinned]
        reusable = [key for key, kind in modules if kind in REUSABLE]
        choices = ["linear", "act", "add", "mul", "cat", "ln", "bn", "drop", "gelu"]
        choices += ["reuse"] * 3 * bool(reusable) + ["relu_", "add_", "mul_"] * bool(writable)
        choice = draw(st.sampled_from(choices))
        index = len(recipe) + 1  # the value this step appends
        storage[index] = index
        if choice in ("linear", "ln", "bn", "drop", "gelu", "reuse"):
            key = draw(st.sampled_from(reusable)) if choice == "reuse" else new_module(choice)
            step, saving = ("call", key, operand()), dict(modules)[key] != "drop"
            pinned |= {storage[step[2]]} if saving else set()
        elif choice == "act":
            name, a = draw(st.sampled_from(["relu", "tanh", "gelu"])), operand()
            step = ("act", name, a)
            pinned |= {storage[a]} if name == "gelu" else {index}
        elif choice in ("add", "mul", "cat"):
            a, b = operand(), operand()
            step = ("cat", new_module("cat"), a, b) if choice == "cat" else (choice, a, b)
            pinned |= {storage[a], storage[b]} if choice == "mul" else set()
        else:  # an in-place write into v[a]
            a = draw(st.sampled_from(writable))
            storage[index] = storage[a]
            if choice == "relu_":
                step = ("inplace", new_module("relu_"), a)
                pinned.add(storage[a])  # ReLU's backward reads its output
            else:
                b = draw(st.sampled_from([v for v in live if storage[v] != storage[a]]))
                step = (choice, a, b)
                pinned |= {storage[b]} if choice == "mul_" else set()
            if draw(st.booleans()):
                live.remove(a)
        recipe.append(step)
        live.append(index)
    count = draw(st.integers(1, min(3, len(live))))
    others = draw(st.lists(st.sampled_from(live[:-1]), min_size=count - 1, max_size=count - 1,
                           unique=True)) if count > 1 else []
    outputs = (live[-1], *others)
    form = draw(st.sampled_from(["tuple", "dict"] + ["tensor"] * (len(outputs) == 1)))
    return ModelSpec(tuple(modules), tuple(recipe), outputs, form, draw(st.booleans()),
                     draw(st.integers(0, 2**16)))


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [output[key] for key in sorted(output)]
    return list(output)


def _train_step(module: nn.Module, x: torch.Tensor, seed: int) -> tuple[type, list[torch.Tensor]]:
    torch.manual_seed(seed)
    output = module(x)
    tensors = _tensors(output)
    weights = torch.Generator().manual_seed(1234)
    loss = sum((t * torch.randn(t.shape, generator=weights)).sum() for t in tensors)
    if loss.requires_grad:  # no parameter or input reaches the outputs: nothing to train
        loss.backward()
    return type(output), [t.detach().clone() for t in tensors]


def _rewrite_keeping_values(model: nn.Module, x: torch.Tensor, strategy: str, segments: int | None) -> nn.Module:
    """The ``strategy`` plan with every other value its recomputed segments could keep kept
    from forward (:mod:`passes.keeps`; pointwise values too): per-value keeps on any DAG."""
    from graphckpt.api import Analysis, analyze, generate_rewrite
    from passes.keeps import add_keeps, ranked_keeps
    from passes.plan import plan_of_segments

    analysis = analyze(model, (x.clone(),), strategy=strategy, segments=segments)
    graph = analysis.cost_graph
    keeps = sorted(ranked_keeps(graph, analysis.plan.segments), key=lambda k: graph.nodes[k[1]]["order"])[::2]
    plan = plan_of_segments(graph, "keeps", add_keeps(graph, analysis.plan.segments, keeps))
    return generate_rewrite(model, Analysis(analysis.captured, graph, plan))


def _rewrite_rematerializing(model: nn.Module, x: torch.Tensor, strategy: str, segments: int | None) -> nn.Module:
    """A plan that rematerializes segment inputs (:mod:`passes.remat`): dropping every other
    value a plan could drop (:mod:`passes.drops`) and that still gives a plan with those before,
    or, when there is none, the ``strategy`` plan rematerializing every input it can."""
    from graphckpt.api import Analysis, analyze, generate_rewrite
    from passes.drops import drop_order, dropped_segments
    from passes.plan import plan_of_segments
    from passes.remat import greedy_remat
    from passes.segments import PlanError

    analysis = analyze(model, (x.clone(),), strategy=strategy, segments=segments)
    graph = analysis.cost_graph
    dropped: list[str] = []
    for value in drop_order(graph)[::2]:
        try:
            dropped_segments(graph, [*dropped, value])
        except PlanError:  # an op that saved it may not be recomputed, or its chain is not pure
            continue
        dropped.append(value)
    chosen = dropped_segments(graph, dropped) if dropped else greedy_remat(graph, analysis.plan.segments, PlanError)
    plan = plan_of_segments(graph, "remat", chosen)
    return generate_rewrite(model, Analysis(analysis.captured, graph, plan))


def _rewrite_one_hooked_segment(model: nn.Module, x: torch.Tensor, hooked: str) -> nn.Module:
    """One selective segment over the whole graph keeping its matmul outputs, as
    :mod:`passes.relaxed` builds them: run by saved-tensor hooks when its ops allow
    (dropouts drawn again), its dropped values made ``"per group"`` or at every use
    (``"each use"``, ``remake_each_use``), holding every other value it may once made
    (``"each use, held"``, ``remake_held``); the ``sqrt`` plan when such a segment is no valid plan."""
    from dataclasses import replace

    from graphckpt.api import Analysis, analyze, generate_rewrite
    from passes.hooked import holdable
    from passes.keeps import keepable, keeping, whole_graph
    from passes.plan import plan_of_segments
    from passes.segments import PlanError

    analysis = analyze(model, (x.clone(),), strategy="sqrt")
    graph = analysis.cost_graph
    kept = {name for name in graph if graph.nodes[name]["expensive"] and keepable(graph, name)}
    segments = tuple(replace(s, remake_each_use=hooked != "per group") for s in keeping(whole_graph(graph), kept))
    if hooked == "each use, held":
        segments = tuple(replace(s, remake_held=holdable(graph, s)[::2]) if s.recompute else s for s in segments)
    try:
        plan = plan_of_segments(graph, "one hooked segment", segments)
    except PlanError:
        plan = analysis.plan
    return generate_rewrite(model, Analysis(analysis.captured, graph, plan))


def _rewrite_exact(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """The exact solver's schedule at 0.6 of eager (:mod:`passes.exact`: values kept, let go
    and made again before each op's backward, only pure ops made again), or the ``sqrt``
    plan where no such schedule fits or the graph is too large."""
    from graphckpt.api import Analysis, analyze, generate_rewrite
    from passes.exact import exact_plan
    from passes.simulate import eager_peak

    analysis = analyze(model, (x.clone(),), strategy="sqrt")
    graph = analysis.cost_graph
    plan = exact_plan(graph, int(0.6 * eager_peak(graph)), time_limit=2) or analysis.plan
    return generate_rewrite(model, Analysis(analysis.captured, graph, plan))


def _check_same_step(spec: ModelSpec, strategy: str, segments: int | None, keep_values: bool = False,
                     remat: bool = False, hooked: str = "", exact: bool = False) -> None:
    model = RecipeModel(spec)
    model.train()
    reference = copy.deepcopy(model)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(spec.seed))
    # planned on what it trains on: an exact schedule holds only what its example's ops saved,
    # and ops save more when the input needs a gradient
    example = x.clone().requires_grad_(spec.input_requires_grad)
    if keep_values:
        rewritten = _rewrite_keeping_values(model, example, strategy, segments)
    elif remat:
        rewritten = _rewrite_rematerializing(model, example, strategy, segments)
    elif hooked:
        rewritten = _rewrite_one_hooked_segment(model, example, hooked)
    elif exact:
        rewritten = _rewrite_exact(model, example)
    else:
        rewritten = graphckpt.rewrite(model, (example.clone(),), strategy=strategy, segments=segments)
    plan = rewritten.meta["graphckpt_plan"]
    assert set(rewritten.state_dict()) == set(model.state_dict())

    x_ref = x.clone().requires_grad_(spec.input_requires_grad)
    x_new = x.clone().requires_grad_(spec.input_requires_grad)
    kind_ref, expected = _train_step(reference, x_ref, spec.seed + 1)
    kind_new, actual = _train_step(rewritten, x_new, spec.seed + 1)
    where = f"strategy={strategy} segments={segments} {hooked}\n{plan}"
    assert kind_new is kind_ref, where
    assert len(actual) == len(expected), where
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, i=index: f"output {i}: {m}\n{where}")
    if spec.input_requires_grad:
        assert (x_ref.grad is None) == (x_new.grad is None), where
        if x_ref.grad is not None:
            torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"input grad: {m}\n{where}")

    reference_parameters = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        want = reference_parameters[name].grad
        if want is None:
            assert parameter.grad is None, f"{name} has a gradient, eager has none\n{where}"
            continue
        assert parameter.grad is not None, f"{name} has no gradient\n{where}"
        torch.testing.assert_close(parameter.grad, want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"grad of {n}: {m}\n{where}")
    reference_buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, reference_buffers[name]), f"buffer {name} differs\n{where}"

    # Eval mode: running statistics used, Dropout off (and returning its input unchanged).
    model.eval()
    reference.eval()
    with torch.no_grad():
        x_ref, x_new = x.clone(), x.clone()
        for a, e in zip(_tensors(rewritten(x_new)), _tensors(reference(x_ref)), strict=True):
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"eval: {m}\n{where}")


# Found by the search below; kept as explicit examples so that they fail fast.
# One BatchNorm called three times side by side, the second call's result read last: the
# articulation plan (min-cut fallback) ran the third call before the second.
SHARED_NORM_ORDER = ModelSpec(
    modules=(("gelu0", "gelu"), ("linear1", "linear"), ("bn2", "bn"), ("linear3", "linear"), ("linear4", "linear"),
             ("linear5", "linear"), ("linear6", "linear"), ("linear7", "linear")),
    recipe=(("add", 0, 0), ("call", "gelu0", 1), ("mul_", 2, 0), ("call", "linear1", 0), ("call", "bn2", 0),
            ("call", "bn2", 0), ("call", "bn2", 4), ("call", "linear3", 0), ("call", "linear4", 0),
            ("call", "linear5", 0), ("call", "linear6", 6), ("call", "linear7", 0)),
    outputs=(12,), output_form="tuple", input_requires_grad=False, seed=0)
# Writes through a chain of in-place results (h.mul_ -> .add_ -> ReLU(inplace)) and a read of
# the first result afterwards: eager reads relu(2h + x).
INPLACE_CHAIN = ModelSpec(
    modules=(("linear0", "linear"), ("relu1", "relu_"), ("linear2", "linear")),
    recipe=(("call", "linear0", 0), ("mul_", 1, 0), ("add_", 2, 0), ("inplace", "relu1", 3),
            ("call", "linear2", 2)),
    outputs=(5,), output_form="tuple", input_requires_grad=False, seed=0)
# Two Dropouts, the second reading a Linear: the plan must not run the second one first.
DROPOUT_ORDER = ModelSpec(
    modules=(("linear0", "linear"), ("drop1", "drop"), ("drop2", "drop")),
    recipe=(("call", "linear0", 0), ("call", "drop1", 0), ("call", "drop2", 1), ("add", 3, 2)),
    outputs=(4,), output_form="tuple", input_requires_grad=False, seed=0)
# Dropout -> ReLU(inplace=True) with the Dropout's input read afterwards: in eval mode
# Dropout returns its input, so eager's ReLU writes into it.
DROPOUT_THEN_INPLACE = ModelSpec(
    modules=(("linear0", "linear"), ("drop1", "drop"), ("relu2", "relu_"), ("linear3", "linear")),
    recipe=(("call", "linear0", 0), ("call", "drop1", 1), ("inplace", "relu2", 2), ("call", "linear3", 3),
            ("add", 4, 1)),
    outputs=(5,), output_form="tuple", input_requires_grad=False, seed=0)

# In eval mode Dropout returns its input, so add_ writes into x; relu(x) runs before the
# write in eager and must stay before it (min-cut once moved it after).
READ_BEFORE_EVAL_WRITE = ModelSpec(
    modules=(("drop0", "drop"), ("ln1", "ln"), ("linear2", "linear"), ("linear3", "linear")),
    recipe=(("call", "drop0", 0), ("call", "ln1", 0), ("act", "relu", 0), ("act", "relu", 0), ("act", "relu", 0),
            ("add_", 1, 0), ("call", "linear2", 0), ("call", "linear3", 5)),
    outputs=(8,), output_form="tuple", input_requires_grad=False, seed=0)


SEGMENT_COUNTS = st.lists(st.sampled_from([None, 2, 3, 5]), min_size=5, max_size=5)


def _check_every_strategy(spec: ModelSpec, segments: list[int | None]) -> None:
    for strategy, count in zip(STRATEGY_NAMES, segments, strict=True):
        _check_same_step(spec, strategy, count)
    _check_same_step(spec, "mincut", segments[2], keep_values=True)
    _check_same_step(spec, "sqrt", segments[0], remat=True)
    for hooked in ("per group", "each use", "each use, held"):
        _check_same_step(spec, "sqrt", None, hooked=hooked)
    _check_same_step(spec, "exact", None, exact=True)


@pytest.mark.full_solver_time  # its exact schedules: as many as 2 s a solve finds (a few seconds in all)
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=model_specs(), segments=SEGMENT_COUNTS)
@example(spec=INPLACE_CHAIN, segments=[None, None, None, None, None])
@example(spec=DROPOUT_ORDER, segments=[2, 2, 2, 2, None])
@example(spec=DROPOUT_THEN_INPLACE, segments=[None, None, None, None, None])
@example(spec=READ_BEFORE_EVAL_WRITE, segments=[None, None, None, None, None])
@example(spec=SHARED_NORM_ORDER, segments=[None, None, None, None, None])
def test_rewrite_trains_like_eager(spec: ModelSpec, segments: list[int | None]) -> None:
    _check_every_strategy(spec, segments)


@pytest.mark.slow
@pytest.mark.full_solver_time
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=model_specs(max_steps=24), segments=SEGMENT_COUNTS)
def test_rewrite_trains_like_eager_many_models(spec: ModelSpec, segments: list[int | None]) -> None:
    """The search above, longer and on larger recipes (about 7 minutes on 2 busy cores)."""
    _check_every_strategy(spec, segments)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@pytest.mark.parametrize(("spec", "segments"), [
    pytest.param(INPLACE_CHAIN, None, id="inplace-chain"),
    pytest.param(DROPOUT_ORDER, 2, id="dropout-order"),
    pytest.param(DROPOUT_THEN_INPLACE, None, id="dropout-then-inplace-eval"),
    pytest.param(SHARED_NORM_ORDER, None, id="shared-norm-order"),
])
def test_found_examples(spec: ModelSpec, segments: int | None, strategy: str) -> None:
    _check_same_step(spec, strategy, segments)
