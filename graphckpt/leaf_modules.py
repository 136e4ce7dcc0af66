"""Which modules an fx capture keeps whole, and which of those a recompute may not run again.

torch.fx keeps every torch.nn module whole (one ``call_module`` node) and traces through the
model's own modules. graphckpt's tracer (:class:`CaptureTracer`) changes that three times:

- buffers are traced as values (fx's ``proxy_buffer_attributes``). fx's default hands forward
  the real buffer, so a write into it in the model's own code ran once, on the real model,
  while it was traced, and was missing from the graph. timm's ``BatchNormAct2d`` (EfficientNet,
  MobileNetV3, RegNet, DenseNet, CSPNet... in timm) counts its batches so: every rewritten or
  enabled timm model ended a step with ``num_batches_tracked`` off by one. Traced as a value,
  the write is an op of the graph, run once a step (:mod:`graphckpt.state`). Code that
  assigns a buffer (``self.seen += 1``) cannot be traced so; :func:`trace_model` puts the
  buffer back and fails, and capture falls back to torch.export;

- a module with call hooks is kept whole, so that its hooks run (:mod:`graphckpt.module_hooks`);
- PyTorch's transformer stacks and layers (:data:`COMPOSITE_TORCH_LAYERS`) are traced into.
  Kept whole, an ``nn.TransformerEncoder`` is one op, and no plan saves anything inside it:
  graphckpt used to report "0 of 1 segments recomputed" and change nothing. Their forward
  branches on tensor properties (the fast path), which fx cannot trace, so such a model is
  captured by torch.export, which records every op inside them.

A torch module kept whole that updates buffers of its own as it runs
(``torch.nn.utils.parametrizations.spectral_norm``'s power iteration, a quantization observer)
must run once a step: a recompute would move its buffers a second time and hand backward
another weight than forward used. :func:`stateful_calls` names those calls; the cost graph
marks them ``recomputable=False``, and ``graphckpt.enable`` does not checkpoint a block holding
such a module (:func:`stateful_modules`). Norm layers' running statistics are not counted:
a recompute updates scratch copies of them (:func:`graphckpt.state.frozen_running_stats`).
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from graphckpt.module_hooks import hook_kinds
from graphckpt.torch_compat import NormBase

COMPOSITE_TORCH_LAYERS = (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
                          nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
"""torch.nn modules that run whole layers of other modules: traced into, not kept whole."""

_TORCH_LIBRARIES = ("torch.nn.", "torch.ao.")


class CaptureTracer(fx.Tracer):
    """fx's tracer, keeping every module with call hooks whole and tracing into
    :data:`COMPOSITE_TORCH_LAYERS` (see the module's docstring)."""

    proxy_buffer_attributes = True

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if hook_kinds(module):
            return True
        return not isinstance(module, COMPOSITE_TORCH_LAYERS) and super().is_leaf_module(module, qualified_name)


def trace_model(model: nn.Module, concrete_args: dict[str, Any] | None = None) -> fx.GraphModule:
    """``torch.fx.symbolic_trace(model, concrete_args)`` by :class:`CaptureTracer`.

    Raises ``fx.proxy.TraceError`` naming the buffer when forward assigned one (``self.seen
    += 1``): fx cannot record that, and the trace stored its stand-in on the model; the
    buffer is put back first."""
    buffers = dict(model.named_buffers())
    tracer = CaptureTracer()
    try:
        graph = tracer.trace(model, concrete_args)
    finally:
        assigned = _put_back_assigned(model, buffers)
    if assigned:
        raise fx.proxy.TraceError(f"fx cannot record forward assigning buffer {assigned[0]} (an in-place write "
                                  "such as .add_(1) it can)")
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _put_back_assigned(model: nn.Module, buffers: dict[str, Any]) -> list[str]:
    """The paths of ``model``'s buffers that are no longer the tensors in ``buffers``, each put back."""
    assigned = []
    for name, buffer in buffers.items():
        owner, _, attribute = name.rpartition(".")
        module = model.get_submodule(owner)
        if getattr(module, attribute, None) is not buffer:
            setattr(module, attribute, buffer)
            assigned.append(name)
    return assigned


def updates_own_buffers(module: nn.Module) -> bool:
    """Whether ``module`` is a torch library module (torch.nn, torch.ao: parametrizations and
    observers included) with buffers of its own, other than a norm layer's running statistics:
    such a module may update them each time it runs.

    >>> from torch.nn.utils import parametrizations
    >>> linear = parametrizations.spectral_norm(nn.Linear(2, 2))
    >>> updates_own_buffers(linear.parametrizations.weight[0]), updates_own_buffers(nn.BatchNorm1d(2))
    (True, False)
    """
    if isinstance(module, NormBase) or not type(module).__module__.startswith(_TORCH_LIBRARIES):
        return False
    return next(module.named_buffers(recurse=False), None) is not None


def stateful_modules(module: nn.Module, prefix: str = "") -> list[str]:
    """The paths (under ``prefix``) of the modules in ``module``'s tree, itself included, that
    :func:`updates_own_buffers`."""
    return [f"{prefix}.{name}" if prefix and name else prefix or name
            for name, inner in module.named_modules() if updates_own_buffers(inner)]


def stateful_calls(graph_module: fx.GraphModule) -> dict[str, str]:
    """The ``call_module`` nodes of ``graph_module`` whose module holds one that
    :func:`updates_own_buffers`, by node name, with the module's path: each must run once a
    step, so none is recomputed."""
    return {node.name: node.target for node in graph_module.graph.nodes
            if node.op == "call_module" and stateful_modules(graph_module.get_submodule(node.target))}
