"""A rewritten module's checks that a call runs as its plan was simulated: inputs the plan
was made for without gradients, the autocast state it was made under, and the input shapes
an export-captured graph is fixed to.

What an op saves for backward depends on whether what it reads needs a gradient: ``x * x``
on an input needing none saves nothing, on one needing it saves ``x`` twice. The cost graph
records what the example inputs did, so a plan made on an input that needed no gradient
holds more than its simulated peak when training passes one that does (a module rewritten
alone, whose input is the previous layer's output, planned on ``torch.randn``): a 6-layer
MLP with parameter-free ops on its input, planned at 0.7 of eager, measured 14% over its
simulated peak. Codegen emits one :func:`warn_if_needs_grad` per such input
(:attr:`passes.plan.Plan.inputs_without_grad`) at the top of the rewritten forward, so the
check is there to read in ``print(gm.code)``; for a plan run by an exact schedule it emits
:func:`refuse_if_needs_grad` instead: that schedule's backward would need values it never held.

Autocast changes what a step holds: a plan is simulated for the autocast state its graph
was costed under (:func:`autocast_state`, kept as :attr:`passes.plan.Plan.autocast`), so
plan under the autocast you train with; :func:`warn_if_autocast_differs` warns at a call
under another state. Measured on CPU, bf16 autocast around the forward, zoo models at
mincut, optimal, 0.5 and 0.7 of eager: planned in float32, steps under autocast held
0.50-3.20x the simulated peaks (the MLP's plans run by hooks or an exact schedule keep
autocast's cached weight copies to the end of forward); planned under autocast, 0.97-1.00x
(MLP, GPT, ResNet, DenseNet, U-Net). What made the difference: checkpoint calls run with
autocast's cache of parameter casts off (:func:`graphckpt.dropping.autocast_uncached`), a
loss outside the model on 16-bit outputs is priced in float32 (``loss_widening`` in
:mod:`passes.costgraph`), a convolution's saved input counted alive during its backward
kernel's scratch (:meth:`graphckpt.backward_record.Recorder.backward_peak`), and the scratch
16-bit kernels allocate inside themselves measured: forward calls on 16-bit floats replayed
(:meth:`graphckpt.op_kinds.OpKinds._note_for_replay`), BatchNorm's backward replayed with the
float32 statistics its kernel gets. The corpus planned under bf16: docs/corpus_autocast.md.

A module captured by ``torch.export`` (Hugging Face models through :func:`graphckpt.rewrite`)
is fixed to its example inputs' shapes: :func:`refuse_if_shape_differs` says so at a call with
other shapes, before export's own guard fails deep inside the first segment. Export also fixes
the dtypes and devices of its parameters: :func:`refuse_if_parameter_differs` says so when the
model was cast or moved after rewriting; an fx capture runs so, but its plan was simulated for
the old dtype, and :func:`warn_if_parameter_differs` warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from graphckpt.torch_compat import has_side_effect
from passes.units import format_bytes

AUTOCAST_DEVICES = ("cpu", "cuda")


def _needs_grad_now(value: Any) -> bool:
    """Whether ``value`` is a tensor needing a gradient in a call that builds a backward graph."""
    return isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled()


def warn_if_needs_grad(value: Any, name: str, planned_peak_bytes: int) -> None:
    """Warn when ``value``, an input the plan was made for without a gradient, needs one now
    (with gradients enabled): the step may hold more than ``planned_peak_bytes``."""
    if _needs_grad_now(value):
        warnings.warn(
            f"graphckpt: input {name!r} requires grad, but the plan was made on example inputs where it "
            "did not: ops reading it now save tensors for backward that the plan did not count, so a step "
            f"may hold more than its simulated peak of {format_bytes(planned_peak_bytes)}. Rewrite "
            f"with example inputs that require grad as in training ({name}.requires_grad_())",
            stacklevel=2)


def refuse_if_needs_grad(value: Any, name: str, planned_peak_bytes: int) -> None:
    """Raise when ``value``, an input an exact schedule was planned for without a gradient,
    needs one now (with gradients enabled): ops reading it would save values for backward that
    the schedule does not hold, so its backward would fail part-way. ``planned_peak_bytes`` is
    unused: the signature is :func:`warn_if_needs_grad`'s, so codegen emits either."""
    if _needs_grad_now(value):
        raise RuntimeError(
            f"graphckpt: input {name!r} requires grad, but the exact schedule was planned on example inputs where "
            "it did not, so backward would need values the schedule does not hold: rewrite with example inputs "
            f"that require grad as in training ({name}.requires_grad_()), or plan without an exact schedule "
            "(graphckpt.rewrite(..., exact=False))")


def refuse_if_shape_differs(value: Any, name: str, shape: tuple[int, ...]) -> None:
    """Raise when ``value``, an input of a module captured by ``torch.export``, has another
    shape than the example input it was captured with: export fixes the graph to those shapes,
    and its own guard, deep in the first segment, only said ``Guard failed: ids.size()[1] == 16``."""
    if isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
        raise ValueError(
            f"graphckpt: input {name!r} has shape {list(value.shape)}, but this module was captured by "
            f"torch.export for shape {list(shape)}, and export fixes a graph to its example shapes. Rewrite with "
            "example inputs of this shape (one rewritten module per shape), or checkpoint the model in place "
            "with graphckpt.enable(model, example_inputs), which runs its own forward at any shape")


def _dtype_device(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} on {tensor.device}"


def warn_if_parameter_differs(value: torch.Tensor, name: str, planned: str, planned_peak_bytes: int) -> None:
    """Warn when ``value``, the model's first floating-point parameter, is not of the dtype and
    device ``planned`` (``"float32 on cpu"``) it had at rewrite time, with gradients enabled:
    activations then take other sizes than simulated, so the step may hold more than
    ``planned_peak_bytes``."""
    if _dtype_device(value) != planned and torch.is_grad_enabled():
        warnings.warn(
            f"graphckpt: parameter {name!r} is {_dtype_device(value)}, but the plan was made with it {planned}: "
            "activations take other sizes than simulated, so a step may hold more than its simulated peak of "
            f"{format_bytes(planned_peak_bytes)}. Rewrite after casting or moving the model "
            "(model.to(...), then graphckpt.rewrite(model, ...))", stacklevel=2)


def refuse_if_parameter_differs(value: torch.Tensor, name: str, planned: str, planned_peak_bytes: int) -> None:
    """Raise when ``value``, the first floating-point parameter of a model captured by
    ``torch.export``, is not of the dtype and device ``planned`` it was captured with: export
    fixes dtypes and devices in its graph, whose own check, deep in the first segment, only
    said ``Tensor dtype mismatch! Expected: Float, Got: c10::BFloat16``. ``planned_peak_bytes``
    is unused: the signature is :func:`warn_if_parameter_differs`'s, so codegen emits either."""
    if _dtype_device(value) != planned:
        raise RuntimeError(
            f"graphckpt: parameter {name!r} is {_dtype_device(value)}, but this module was captured by torch.export with "
            f"it {planned}, and export fixes dtypes and devices in its graph. Rewrite after casting or moving "
            "the model (model.to(...), then graphckpt.rewrite(model, ...)), or checkpoint it in place with "
            "graphckpt.enable(model, ...), which follows the model wherever it goes")


def first_floating_parameter(model: torch.nn.Module) -> tuple[str, torch.Tensor] | None:
    """The name and value of ``model``'s first floating-point parameter: a whole-model
    ``.to(dtype)``, ``.half()`` or ``.cuda()`` after rewriting changes it."""
    return next(((name, p) for name, p in model.named_parameters() if p.is_floating_point()), None)


def emit_parameter_check(graph: fx.Graph, model: torch.nn.Module, planned_peak_bytes: int, *, fixed: bool) -> None:
    """Append to ``graph`` a check that the model's first floating-point parameter is of the
    dtype and device it has now: :func:`refuse_if_parameter_differs` for a graph that
    ``fixed`` them (export's), :func:`warn_if_parameter_differs` otherwise."""
    found = first_floating_parameter(model)
    if found is not None:
        name, value = found
        check = refuse_if_parameter_differs if fixed else warn_if_parameter_differs
        graph.create_node("call_function", check, (graph.get_attr(name), name, _dtype_device(value), planned_peak_bytes),
                          name="planned_parameters")


def autocast_state() -> str:
    """The autocast state in force now, as ``"device:dtype"`` (``"cpu:bfloat16"``), ``""`` when off.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_state()
    'cpu:bfloat16'
    """
    for device in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            return f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}"
    return ""


def warn_if_autocast_differs(planned: str, planned_peak_bytes: int) -> None:
    """Warn when the rewritten module (or a block :func:`graphckpt.enable` checkpoints) is
    called, with gradients enabled, under another autocast state than its plan's
    (``planned``): the step may hold more than ``planned_peak_bytes``."""
    now = autocast_state()
    if now != planned and torch.is_grad_enabled():
        warnings.warn(f"graphckpt: called under autocast {now or 'off'}, but the plan was made under autocast "
                      f"{planned or 'off'}: ops make and save tensors of other dtypes than simulated, so a step "
                      f"may hold more than its simulated peak of {format_bytes(planned_peak_bytes)}. Plan under "
                      "the autocast you train with (with torch.autocast(...): graphckpt.rewrite(...), or "
                      "graphckpt.enable(...))",
                      stacklevel=2)


for _check in (warn_if_needs_grad, refuse_if_needs_grad, warn_if_autocast_differs, refuse_if_shape_differs,
               warn_if_parameter_differs, refuse_if_parameter_differs):
    has_side_effect(_check)  # fx's dead-code elimination keeps their calls though they return nothing


def emit_call_checks(graph: fx.Graph, inputs: dict[str, fx.Node], names: tuple[str, ...],
                     planned_peak_bytes: int, planned_autocast: str, *, exact: bool = False,
                     fixed_shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Append to ``graph`` (codegen's top graph, just after its placeholders ``inputs`` by
    name) a :func:`refuse_if_shape_differs` call for each input of ``fixed_shapes`` (an
    export-captured graph's), a :func:`warn_if_autocast_differs` call and, for each input of
    ``names``, a :func:`warn_if_needs_grad` call (:func:`refuse_if_needs_grad` for a plan run
    by an ``exact`` schedule)."""
    for name, shape in (fixed_shapes or {}).items():
        graph.create_node("call_function", refuse_if_shape_differs, (inputs[name], name, shape),
                          name=f"captured_shape_{name}")
    graph.create_node("call_function", warn_if_autocast_differs, (planned_autocast, planned_peak_bytes),
                      name="planned_autocast")
    check = refuse_if_needs_grad if exact else warn_if_needs_grad
    for name in names:
        graph.create_node("call_function", check, (inputs[name], name, planned_peak_bytes),
                          name=f"planned_without_grad_{name}")


def example_shapes(source: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """The shapes of ``source``'s tensor inputs as captured (their placeholders' example
    values), for those whose every size is fixed (no symbolic size)."""
    shapes = {}
    for node in source.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and all(isinstance(size, int) for size in value.shape):
            shapes[node.name] = tuple(value.shape)
    return shapes
