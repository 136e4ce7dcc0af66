"""A rewritten module's checks that a call runs as its plan was simulated: inputs the plan
was made for without gradients, and autocast, which the simulator does not model.

What an op saves for backward depends on whether what it reads needs a gradient: ``x * x``
on an input needing none saves nothing, on one needing it saves ``x`` twice. The cost graph
records what the example inputs did, so a plan made on an input that needed no gradient
holds more than its simulated peak when training passes one that does (a module rewritten
alone, whose input is the previous layer's output, planned on ``torch.randn``): a 6-layer
MLP with parameter-free ops on its input, planned at 0.7 of eager, measured 14% over its
simulated peak. Codegen emits one :func:`warn_if_needs_grad` per such input
(:attr:`passes.plan.Plan.inputs_without_grad`) at the top of the rewritten forward, so the
check is there to read in ``print(gm.code)``; a schedule run exactly refuses instead
(:class:`graphckpt.exact.ScheduledModule`: its backward would need values it never held).

Autocast is not modelled: the copies it makes of parameters (cached until the autocast
region ends, whether backward saves them or not) and of inputs are not counted, nor the
casts of gradients in backward. Measured on CPU with bf16 autocast around forward, the zoo
MLP (24 layers of 256, batch 32: the copies of its weights outweigh its activations) peaked
at 3.9-6.0x its fp32 plans' simulated peaks (min-cut, 0.5 and 0.3 of eager), the zoo GPT at
0.90-1.04x; planned under autocast, 1.9-3.2x and 1.24-1.40x (16 layers of 256, batch 512:
1.27-1.48x). At the zoo MLP's peak, the end of forward, all 24 bf16 weight copies are alive
(autocast's cache), though its recomputed segments save none of them. So planning under
autocast (:func:`warn_if_planned_under_autocast`) and a call under it
(:func:`warn_if_autocast`) warn that the budget is not guaranteed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import fx

from passes.units import format_bytes

AUTOCAST_DEVICES = ("cpu", "cuda")


def warn_if_needs_grad(value: Any, name: str, planned_peak_bytes: int) -> None:
    """Warn when ``value``, an input the plan was made for without a gradient, needs one now
    (with gradients enabled): the step may hold more than ``planned_peak_bytes``."""
    if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
        warnings.warn(
            f"graphckpt: input {name!r} requires grad, but the plan was made on example inputs where it "
            "did not: ops reading it now save tensors for backward that the plan did not count, so a step "
            f"may hold more than its simulated peak of {format_bytes(planned_peak_bytes)}. Rewrite "
            f"with example inputs that require grad as in training ({name}.requires_grad_())",
            stacklevel=2)


def autocast_enabled() -> bool:
    """Whether autocast is on now for the CPU or CUDA."""
    return any(torch.is_autocast_enabled(device) for device in AUTOCAST_DEVICES)


def warn_if_planned_under_autocast() -> None:
    """Warn, when a graph is costed under autocast, that its plan's peak is not what a step holds."""
    if autocast_enabled():
        warnings.warn("graphckpt: planning under autocast, which the memory simulator does not model yet: the "
                      "copies autocast makes of parameters and inputs are not counted, so a step can hold more "
                      "than the plan's simulated peak (a budget is not guaranteed; see graphckpt/planned_inputs.py "
                      "for what was measured)", stacklevel=3)


def warn_if_autocast(planned_peak_bytes: int) -> None:
    """Warn when the rewritten module is called, with gradients enabled, under autocast:
    the step may hold more than ``planned_peak_bytes``."""
    if torch.is_grad_enabled() and autocast_enabled():
        warnings.warn(f"graphckpt: called under autocast, which the memory simulator does not model yet: a step "
                      f"may hold more than the plan's simulated peak of {format_bytes(planned_peak_bytes)} (the "
                      "copies autocast makes of parameters and inputs are not counted; a budget is not "
                      "guaranteed)", stacklevel=2)


for _check in (warn_if_needs_grad, warn_if_autocast):
    getattr(fx.node, "has_side_effect", lambda function: function)(_check)  # fx's dead-code elimination
    # keeps them though they return nothing (torch releases without the registry never drop calls)


def emit_call_checks(graph: fx.Graph, inputs: dict[str, fx.Node], names: tuple[str, ...],
                     planned_peak_bytes: int) -> None:
    """Append to ``graph`` (codegen's top graph, just after its placeholders ``inputs`` by
    name) a :func:`warn_if_autocast` call and a :func:`warn_if_needs_grad` call for each
    input of ``names``."""
    graph.create_node("call_function", warn_if_autocast, (planned_peak_bytes,), name="planned_without_autocast")
    for name in names:
        graph.create_node("call_function", warn_if_needs_grad, (inputs[name], name, planned_peak_bytes),
                          name=f"planned_without_grad_{name}")
