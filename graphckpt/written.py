"""What each node of a captured graph writes in place.

:func:`mutated_arguments` is the one answer the pipeline asks (:mod:`graphckpt.inplace`
makes recomputation safe around what it names; profiling and timing leave those nodes' inputs
alone): ATen ops by their schema, torch functions and methods by their name or ``inplace=``
flag, norm layers' running statistics, and the regions torch.export wraps in a higher-order
call (a ``no_grad`` or autocast region) by what their subgraph writes.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from graphckpt.state import FUNCTIONAL_NORMS, NORMS_WRITING_RUNNING_STATS
from graphckpt.torch_compat import OpOverload, op_schema

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.setitem}


@functools.cache
def schema_writes(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """``(position, name, is_out)`` of each argument an ATen op's schema marks written
    (``(a!)``): the one reading of a schema's writes, for captured nodes
    (:func:`mutated_arguments`) and for the calls the profile sees (:mod:`graphckpt.op_kinds`).

    >>> schema_writes(torch.ops.aten.sigmoid_.default), schema_writes(torch.ops.aten.sigmoid.default)
    (((0, 'self', False),), ())
    """
    return tuple((i, a.name, a.is_out) for i, a in enumerate(op_schema(func).arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _schema_written_arguments(node: fx.Node) -> list[fx.Node]:
    """Arguments an ATen op writes: those its schema marks ``(a!)``, plus the running
    statistics of a training-mode batch norm (which its schema does not mark)."""
    schema = op_schema(node.target)
    bound = {argument.name: node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
             for i, argument in enumerate(schema.arguments)}
    written = [bound[name] for _, name, _ in schema_writes(node.target)]
    if schema.name.split("::")[-1] in NORMS_WRITING_RUNNING_STATS and bound.get("training", True):
        written += [bound.get("running_mean"), bound.get("running_var")]
    return [value for value in written if isinstance(value, fx.Node)]


def _functional_norm_written(node: fx.Node) -> list[fx.Node]:
    """Running statistics a ``torch.nn.functional.batch_norm``-style call updates (what
    ``torch.compile`` graphs call, with the module's buffers as graph inputs): those it is
    passed while in training mode (or ``use_input_stats``); a flag that is itself a value of
    the graph counts as on."""
    (mean, var), (flag, position, default) = FUNCTIONAL_NORMS[node.target]
    names = ("running_mean", "running_var")
    on = node.args[position] if position < len(node.args) else node.kwargs.get(flag, default)
    if on is False:
        return []
    written = [node.args[i] if i < len(node.args) else node.kwargs.get(name)
               for i, name in zip((mean, var), names, strict=True)]
    return [value for value in written if isinstance(value, fx.Node)]


def mutated_arguments(module: torch.nn.Module, node: fx.Node) -> list[fx.Node]:
    """The values ``node`` writes into in place (empty if it writes nothing).

    ``call_module`` norm layers are not listed: :class:`graphckpt.runtime.SegmentModule` keeps
    their running statistics from being updated twice.
    """
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if node.op == "call_module":
        return first if getattr(module.get_submodule(node.target), "inplace", False) is True else []
    if node.op == "call_method":
        name = node.target
        return first if name.endswith("_") and not name.endswith("__") else []
    if node.op != "call_function":
        return []
    if isinstance(node.target, OpOverload):
        return _schema_written_arguments(node)
    if (wrapped := _wrapped_subgraph(module, node)) is not None:
        return _wrapped_written(*wrapped)
    if node.target in FUNCTIONAL_NORMS:
        return _functional_norm_written(node)
    if node.target in _INPLACE_OPERATORS or inplace_flag(node):
        return first
    name = getattr(node.target, "__name__", "")
    return first if name.endswith("_") and not name.startswith("_") else []


def _wrapped_subgraph(module: torch.nn.Module, node: fx.Node) -> tuple[fx.GraphModule, Sequence[Any]] | None:
    """The subgraph a higher-order call runs and the operands it passes it, when its arguments
    are a subgraph followed by the operands: how torch.export records a region under
    ``no_grad`` or autocast (``wrap_with_set_grad_enabled(False, submod, *operands)``,
    ``wrap_with_autocast(..., submod, *operands)``)."""
    for position, argument in enumerate(node.args):
        if isinstance(argument, fx.Node) and argument.op == "get_attr":
            try:
                body = module.get_submodule(argument.target)
            except AttributeError:  # a parameter, buffer or constant
                continue
            if isinstance(body, fx.GraphModule):
                return body, node.args[position + 1:]
    return None


def _wrapped_written(body: fx.GraphModule, operands: Sequence[Any]) -> list[fx.Node]:
    """The operands that ``body`` writes in place: ``parametrizations.spectral_norm``'s power
    iteration writes its ``_u`` and ``_v`` buffers inside the ``no_grad`` region export wraps."""
    placeholders = {node: i for i, node in enumerate(n for n in body.graph.nodes if n.op == "placeholder")}
    written = (placeholders.get(value) for inner in body.graph.nodes for value in mutated_arguments(body, inner))
    return [operands[i] for i in written if i is not None and i < len(operands) and isinstance(operands[i], fx.Node)]


def inplace_flag(node: fx.Node) -> bool:
    """Whether a call passes ``inplace=True``, by keyword or by position (``F.relu(x, True)``)."""
    if node.kwargs.get("inplace") is True:
        return True
    position = _inplace_position(node.target)
    return position is not None and position < len(node.args) and node.args[position] is True


@functools.cache
def _inplace_position(function: Any) -> int | None:
    """Where a function takes ``inplace`` among its positional parameters; ``None`` if it does not."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    return names.index("inplace") if "inplace" in names else None
