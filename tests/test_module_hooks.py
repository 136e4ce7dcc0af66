"""A model's module hooks run in its rewritten module as in eager: once a step, on the
values eager gives them (:mod:`graphckpt.module_hooks`)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import graphckpt
from graphckpt.module_hooks import INACTIVE_HOOK_MODULES, hooked_modules
from graphckpt.tools import zoo
from graphckpt.tools.measure import measure_step
from passes.segments import PlanError
from tests.equivalence import assert_trains_like
from tests.test_enable import _checkpointed as checkpointed_blocks

PLANS = [{"strategy": "sqrt"}, {"strategy": "mincut"}, {"strategy": "optimal"}, {"budget": 0.6}]
PLAN_IDS = ["sqrt", "mincut", "optimal", "budget-0.6"]


def _chain(depth: int = 8, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.Tanh())
                           for _ in range(depth)])


def _inputs(width: int = 64) -> tuple[torch.Tensor]:
    torch.manual_seed(1)
    return (torch.randn(32, width, requires_grad=True),)


def _step(module: nn.Module, inputs: tuple) -> None:
    module(*inputs).pow(2).mean().backward()


@pytest.mark.parametrize("options", PLANS, ids=PLAN_IDS)
def test_a_forward_hook_on_a_block_runs_once_a_step_on_real_values(options: dict) -> None:
    """A hook on a block fx would trace through (a ``Sequential``) collects that block's
    output once a step, the very tensor eager's hook sees; gradients equal eager's."""
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "rewritten": []}
    reference, model = _chain(), _chain()
    reference[3].register_forward_hook(lambda module, args, output: seen["eager"].append(output.detach()))
    model[3].register_forward_hook(lambda module, args, output: seen["rewritten"].append(output.detach()))
    rewritten = graphckpt.rewrite(model, _inputs(), **options)
    assert "calls 3 whole and never recomputes it" in rewritten.code
    seen["rewritten"].clear()  # the hook also ran while the graph was profiled
    assert_trains_like(reference, model, rewritten, _inputs(), loss_fn=lambda y: y.pow(2).mean())
    assert len(seen["rewritten"]) == len(seen["eager"]) == 1
    torch.testing.assert_close(seen["rewritten"][0], seen["eager"][0], rtol=1e-5, atol=1e-6)


def test_spectral_norm_moves_its_power_iteration_once_a_step() -> None:
    """``spectral_norm``'s forward pre-hook updates ``weight_u`` in place and normalises the
    weight from it: were it rerun by a recompute, backward would see another weight. Two
    steps of every plan train like eager, buffers included."""
    def model_with_spectral_norm() -> nn.Sequential:
        model = _chain()
        nn.utils.spectral_norm(model[2][0])
        return model

    for options in PLANS:
        reference, model = model_with_spectral_norm(), model_with_spectral_norm()
        model[2][0].weight_u.copy_(reference[2][0].weight_u)  # profiling ran the hook on real inputs
        rewritten = graphckpt.rewrite(model, _inputs(), **options)
        model[2][0].weight_u.copy_(reference[2][0].weight_u)
        for seed in (0, 1):
            assert_trains_like(reference, model, rewritten, _inputs(), loss_fn=lambda y: y.pow(2).mean(), seed=seed)


def test_a_backward_hook_on_a_block_sees_eager_gradients() -> None:
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "rewritten": []}
    reference, model = _chain(), _chain()
    for module, key in ((reference, "eager"), (model, "rewritten")):
        module[5].register_full_backward_hook(lambda m, grad_in, grad_out, key=key: seen[key].append(grad_out[0]))
    rewritten = graphckpt.rewrite(model, _inputs(), budget=0.5)
    assert rewritten.meta["graphckpt_plan"].recomputed_segments
    seen["rewritten"].clear()  # the hook also ran while the graph was profiled
    _step(reference, _inputs())
    _step(rewritten, _inputs())
    assert len(seen["rewritten"]) == len(seen["eager"]) == 1
    torch.testing.assert_close(seen["rewritten"][0], seen["eager"][0], rtol=1e-5, atol=1e-6)


def test_the_models_own_hooks_run_around_the_rewritten_forward() -> None:
    """The model's forward pre-hook changes what forward receives (here its width): the plan
    is made for what forward receives, and the rewritten module runs the pre-hook and the
    forward hook, sharing them with the model (removing one removes it from both)."""
    def widened() -> nn.Sequential:
        model = _chain()
        model.register_forward_pre_hook(lambda module, args: (torch.cat([args[0], args[0]], dim=-1),))
        model.register_forward_hook(lambda module, args, output: output * 2)
        return model

    narrow = (torch.randn(32, 32, requires_grad=True),)
    reference, model = widened(), widened()
    rewritten = graphckpt.rewrite(model, narrow, budget=0.6)
    assert "own hooks (forward, forward_pre) around forward" in rewritten.code
    assert_trains_like(reference, model, rewritten, narrow, loss_fn=lambda y: y.pow(2).mean())
    handles = list(model._forward_hooks)
    del model._forward_hooks[handles[0]]
    torch.testing.assert_close(rewritten(*narrow), model(*narrow))


def test_a_plan_around_hooked_blocks_measures_what_it_simulates() -> None:
    """The hooked blocks are kept whole in the plan's memory as in the step's: the measured
    peak stays within 3% of the simulated one, and below eager's."""
    model, inputs = _chain(depth=10, width=256), (torch.randn(256, 256, requires_grad=True),)
    for index in (2, 6):
        model[index].register_forward_hook(lambda module, args, output: None)
    eager = measure_step(_chain(depth=10, width=256), inputs, lambda y: y.pow(2).mean(), repeats=1).peak_bytes
    rewritten = graphckpt.rewrite(model, inputs, budget=0.5)
    simulated = rewritten.meta["graphckpt_plan"].peak_bytes
    measured = measure_step(rewritten, inputs, lambda y: y.pow(2).mean(), repeats=1).peak_bytes
    assert measured < 0.6 * eager
    assert abs(measured / simulated - 1) < 0.03, (measured, simulated)


class _ShapeBranch(nn.Module):
    """fx cannot trace a branch on a shape; torch.export, at the example's shape, can."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _chain(depth=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) if x.shape[0] > 1 else x


def test_export_captured_hooks_are_named_in_a_warning() -> None:
    model = _ShapeBranch()
    model.layers[1].register_forward_hook(lambda module, args, output: None)
    with pytest.warns(UserWarning, match=r"torch.export, which ran the hooks of layers.1 \(forward\) once"):
        rewritten = graphckpt.rewrite(model, _inputs(), strategy="sqrt")
    assert "captured with export" in rewritten.code


def test_global_module_hooks_are_named_in_a_warning() -> None:
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        with pytest.warns(UserWarning, match="global module hooks"):
            graphckpt.rewrite(*zoo.make("mlp", depth=4, width=16, batch=4), strategy="sqrt")
    finally:
        handle.remove()


def test_enable_leaves_a_block_holding_a_hooked_module_unrecomputed() -> None:
    """Per-block checkpointing reruns a block whole: the block holding ``spectral_norm``'s
    layer is kept, the others are checkpointed, and the model trains like eager."""
    def model_with_spectral_norm() -> nn.Sequential:
        model = _chain()
        nn.utils.spectral_norm(model[2][0])
        return model

    reference, model = model_with_spectral_norm(), model_with_spectral_norm()
    graphckpt.enable(model, _inputs())
    model[2][0].weight_u.copy_(reference[2][0].weight_u)  # profiling ran the hook on real inputs
    assert "2" not in checkpointed_blocks(model) and {"1", "3"} <= set(checkpointed_blocks(model))
    for seed in (0, 1):
        assert_trains_like(reference, model, model, _inputs(), loss_fn=lambda y: y.pow(2).mean(), seed=seed)


def test_enable_checkpoints_blocks_with_hooks_of_their_own() -> None:
    """A block's own hooks (FSDP2's ``fully_shard`` per layer registers such) run outside its
    checkpoint, once a step: they do not keep the block from being recomputed."""
    calls: list[str] = []
    model = _chain()
    for index, block in enumerate(model):
        block.register_forward_pre_hook(lambda module, args, index=index: calls.append(f"pre {index}"))
    graphckpt.enable(model, _inputs())
    assert not calls, "planning ran the blocks' own hooks"
    assert checkpointed_blocks(model) == [str(index) for index in range(7)]  # the last block ends forward
    _step(model, _inputs())
    assert calls == [f"pre {index}" for index in range(8)]


def test_enable_says_why_no_block_can_be_recomputed() -> None:
    model = _chain(depth=4)
    for block in model:
        block[0].register_forward_hook(lambda module, args, output: None)
    with pytest.raises(PlanError, match=r"no block can be recomputed whole: modules inside them have hooks or "
                                        r"update buffers of their own \(0.0, 1.0, 2.0, ...\).*graphckpt.rewrite"):
        graphckpt.enable(model, _inputs())


def test_a_deep_copy_keeps_the_models_own_hooks() -> None:
    calls: list[str] = []
    model = _chain()
    model.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    clone = copy.deepcopy(graphckpt.rewrite(model, _inputs(), strategy="sqrt"))
    calls.clear()
    for training in (True, False):
        clone.train(training)
        clone(*_inputs())
    assert calls == ["pre", "pre"]


def test_hugging_face_output_recorders_do_not_count_as_hooks() -> None:
    """Hugging Face installs an output recorder on the layers of many models at their first
    call (Wav2Vec2, HuBERT); it does nothing unless hidden states are asked for, so it keeps
    no module whole and draws no warning."""
    def recorder(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        return None

    recorder.__module__ = INACTIVE_HOOK_MODULES[0]
    model = _chain(depth=4)
    for block in model:
        block.register_forward_hook(recorder)
    assert hooked_modules(model) == {}
    rewritten = graphckpt.rewrite(model, _inputs(), strategy="sqrt")
    assert "whole and never recomputes" not in rewritten.code


def test_a_hook_registered_after_rewriting_on_an_inlined_module_is_named_at_the_first_call() -> None:
    """The graph runs a container's code, not its call: a hook added to it afterwards never
    runs in training, and the first call says so, once. A hook added to a module called
    whole inside a recomputed segment runs twice a step, and is named too; one on a module
    called whole that is not recomputed runs once and is not named. An export capture's
    hooks from before rewriting are not named."""
    calls: list[str] = []
    model = _chain()
    rewritten = graphckpt.rewrite(model, _inputs(), strategy="sqrt")
    recomputed = sorted(rewritten.graphckpt_hook_watch.rerun)
    assert "3.0" in recomputed and "7.0" not in recomputed
    model[4].register_forward_hook(lambda module, args, output: calls.append("4"))
    model[3][0].register_forward_hook(lambda module, args, output: calls.append("3.0"))
    model[7][0].register_forward_hook(lambda module, args, output: calls.append("7.0"))
    with pytest.warns(UserWarning) as warned:
        _step(rewritten, _inputs())
    messages = [str(w.message) for w in warned if "after the model was rewritten" in str(w.message)]
    assert len(messages) == 2, messages
    assert "registered on 4 (forward)" in messages[0] and "will not run in training steps" in messages[0]
    assert "registered on 3.0 (forward)" in messages[1] and "will run twice a training step" in messages[1]
    assert sorted(calls) == ["3.0", "3.0", "7.0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(rewritten, _inputs())

    exported = _ShapeBranch()
    exported.layers[1].register_forward_hook(lambda module, args, output: None)
    with pytest.warns(UserWarning, match="which ran the hooks of layers.1"):
        rewritten = graphckpt.rewrite(exported, _inputs(), strategy="sqrt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(rewritten, _inputs())
