"""Capture a model's forward as a ``torch.fx.GraphModule``.

``torch.fx.symbolic_trace`` first: it keeps the model's own modules as ``call_module``
nodes and works for any input shape. When fx cannot trace the model (data-dependent
Python, unsupported constructs) and example inputs are given, ``torch.export`` (non-strict)
is the fallback: it traces real tensor operations, at the example inputs' shapes.
"""

from __future__ import annotations

import inspect
import operator
import os
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx, nn

from graphckpt.blocks import find_blocks, join_path
from graphckpt.functions import functions_kept_whole
from graphckpt.module_hooks import trace_keeping_hooks, warn_global_hooks, warn_hooks_traced_in
from graphckpt.progress import paused_gc
from graphckpt.stamping import export_stamped
from graphckpt.torch_compat import export_training_graph

CaptureMethod = Literal["fx", "export"]
_TORCH_DIR = os.path.dirname(torch.__file__)


class CaptureError(RuntimeError):
    """The model could not be turned into a graph; the message says why and what to try."""


@dataclass(frozen=True)
class Captured:
    """A traced forward, how it was traced, and the model it came from."""

    graph_module: fx.GraphModule
    method: CaptureMethod
    model: nn.Module


def user_frame(error: BaseException) -> str:
    """``file:line: code`` of the innermost frame outside torch where ``error`` arose."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
              and "graphckpt" not in os.path.basename(os.path.dirname(f.filename))]
    if not frames:
        return "inside torch"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def unused_defaults(model: nn.Module, args: tuple | None,
                    kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Forward parameters the example call leaves at their default, with those defaults.

    fx traces them as constants (``concrete_args``): an optional argument left at ``None``
    must not become a proxy that every ``is None`` test calls not-None.
    """
    given = set(kwargs or {})
    concrete = {}
    parameters = list(inspect.signature(model.forward).parameters.values())
    for index, parameter in enumerate(parameters):
        positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        supplied = parameter.name in given or (positional and args is not None and index < len(args))
        if not supplied and parameter.default is not parameter.empty:
            concrete[parameter.name] = parameter.default
    return concrete


def trace_fx(model: nn.Module, args: tuple | None = None,
             kwargs: Mapping[str, Any] | None = None) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` sharing the model's modules and parameters, keeping each
    module with hooks whole (:mod:`graphckpt.module_hooks`); arguments the example call
    does not pass are fixed at their defaults."""
    return trace_keeping_hooks(model, unused_defaults(model, args, kwargs) or None)


def trace_export(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> fx.GraphModule:
    """``torch.export`` (non-strict) at the example inputs, unlifted back to a module, with
    the model's own autograd Functions kept one node each (:mod:`graphckpt.functions`;
    traced through when one of them draws random numbers) and the attention masks that
    tracing materialised taken back out (:func:`fold_constant_masks`). A run of like layers
    is traced a few layers deep and stamped for the rest (:mod:`graphckpt.stamping`)."""
    args, kwargs = tuple(args), dict(kwargs)
    return export_stamped(model, args, kwargs, _export_folded) or _export_folded(model, args, kwargs)


def _export_folded(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """:func:`_export_whole` with constant masks folded: before stamping, so that the copies
    inherit the folded calls and the stamped graph is generated once."""
    return fold_constant_masks(_export_whole(model, args, kwargs))


def _export_whole(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """Every op of ``model`` exported, its own autograd Functions kept whole unless random."""
    with functions_kept_whole() as seen:
        graph_module = export_training_graph(model, args, kwargs)
    if seen.random:
        graph_module = export_training_graph(model, args, kwargs)
    return graph_module


def capture(model: nn.Module, example_inputs: tuple | None = None,
            example_kwargs: Mapping[str, Any] | None = None) -> Captured:
    """Trace ``model`` with fx, falling back to ``torch.export`` when inputs are given, and
    preferring it for a model with its own autograd Functions, which export keeps whole
    (:mod:`graphckpt.functions`) where fx traces through them.

    Raises :class:`CaptureError` naming the construct fx choked on and what to try.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected an nn.Module, got {type(model).__name__}")
    warn_global_hooks()
    traced = None
    try:
        with functions_kept_whole() as seen, paused_gc():  # a 50k-node trace: 4.2 s -> 3.4 s
            traced = trace_fx(model, example_inputs, example_kwargs)
        if not seen.traced_through or example_inputs is None:
            return Captured(traced, "fx", model)
        fx_reason = "fx traced through autograd.Function " + ", ".join(sorted(set(seen.traced_through)))
    except Exception as fx_error:
        fx_reason = f"{_first_line(fx_error)} (at {user_frame(fx_error)})"
        if example_inputs is None:
            raise CaptureError(
                f"torch.fx could not trace {type(model).__name__}: {fx_reason}. Pass "
                "example_inputs so graphckpt can fall back to torch.export, or make that "
                "code traceable (torch.fx.wrap the function, or move the Python control flow "
                "out of forward)."
            ) from fx_error
    try:
        with paused_gc():  # an 80-layer HF LLaMA's export: 8.3-9.2 s -> 7.9-8.0 s
            exported = Captured(trace_export(model, example_inputs, example_kwargs or {}), "export", model)
        warn_hooks_traced_in(model)
        return exported
    except Exception as export_error:
        if traced is not None:  # fx's trace, with the Functions inlined, is still a capture
            return Captured(traced, "fx", model)
        raise CaptureError(
            f"neither torch.fx nor torch.export could capture {type(model).__name__}.\n"
            f"  torch.fx: {fx_reason}\n"
            f"  torch.export: {_first_line(export_error)} (at {user_frame(export_error)})\n"
            "Data-dependent control flow (an `if` on a tensor's values) cannot be captured: "
            "use torch.where / torch.cond, or checkpoint that model by hand."
        ) from export_error


def block_paths(model: nn.Module, names: Sequence[str] | None = None) -> tuple[str, ...]:
    """Qualified names (as ``model.named_modules()`` gives them) of the blocks per-block
    checkpointing wraps: the repeated layers :func:`find_blocks` finds, or the modules
    ``names`` lists (a name of a ``ModuleList``/``Sequential`` stands for its children).

    >>> block_paths(nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU())))
    ('0',)
    """
    modules = dict(model.named_modules())
    if names is None:
        path_of = {id(module): name for name, module in modules.items()}
        return tuple(join_path(path_of[id(container)], child) for container, child in find_blocks(model))
    unknown = [name for name in names if name not in modules]
    if unknown:
        raise CaptureError(f"blocks {unknown} are not modules of {type(model).__name__}; "
                           f"some of its modules: {list(modules)[1:8]}")
    found: list[str] = []
    for name in names:
        module = modules[name]
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            found += [join_path(name, child) for child, _ in module.named_children()]
        else:
            found.append(name)
    return tuple(found)


def node_blocks(graph_module: fx.GraphModule, paths: Sequence[str]) -> dict[str, str]:
    """The block (one of ``paths``) each node of the graph runs in, by the module stack fx
    and torch.export record on every node (``nn_module_stack``); ``""`` outside every block.
    A node without a recorded stack (one graphckpt inserted) sits in the block of the nodes
    on both sides of it when they agree."""
    wanted = set(paths)
    recorded: dict[str, str | None] = {}
    for node in graph_module.graph.nodes:
        stack = [entry[0] for entry in (node.meta.get("nn_module_stack") or {}).values()]
        recorded[node.name] = next((path for path in stack if path in wanted), "") if stack else None
    names = list(recorded)
    before = _nearest_known([recorded[n] for n in names])
    after = _nearest_known([recorded[n] for n in reversed(names)])[::-1]
    return {name: recorded[name] if recorded[name] is not None else (before[i] if before[i] == after[i] else "")
            for i, name in enumerate(names)}


def _nearest_known(blocks: Sequence[str | None]) -> list[str]:
    """For each position, the last recorded block at or before it (``""`` when none):
    one sweep, so filling gaps stays linear on graphs of tens of thousands of nodes."""
    known, last = [], ""
    for block in blocks:
        last = block if block is not None else last
        known.append(last)
    return known


# ---------------------------------------------------------------- attention masks tracing made

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MASK_ARGUMENT, CAUSAL_ARGUMENT = 3, 5  # query, key, value, attn_mask, dropout_p, is_causal


def fold_constant_masks(graph_module: fx.GraphModule) -> fx.GraphModule:
    """``graph_module`` with each attention mask that depends on no input folded away where
    it says nothing: an all-true mask is dropped, a causal one becomes ``is_causal=True``.

    Hugging Face models skip the mask in eager mode when there is no padding (``None``, or
    ``is_causal=True``) but build it as a tensor when traced. On a GPU a mask changes which
    fused attention kernel runs: more memory and time, and with attention dropout other
    random draws than the model's own (ViT on CUDA trained differently). Folding restores
    the model's call. A mask computed from the inputs (padding) or from the model's
    parameters or buffers (a learned position bias) is left alone: only a mask that can
    never change is folded (:func:`_reads_inputs_or_state`); but such a mask with an all-true
    one added to it is passed without it (:func:`_allowing_addend_dropped`).
    """
    changed = False
    meanings: dict[fx.Node, str | None] = {}  # one mask serves every layer: evaluated once
    state: set[int] | None = None  # ids of the parameters and buffers, found at the first mask
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or len(node.args) <= MASK_ARGUMENT:
            continue
        mask = node.args[MASK_ARGUMENT]
        if not isinstance(mask, fx.Node):
            continue
        state = _state_ids(graph_module) if state is None else state
        meaning = _constant_meaning(graph_module, mask, meanings, state)
        if meaning is None:
            changed = _allowing_addend_dropped(graph_module, node, meanings, state) or changed
            continue
        if meaning == "causal" and _is_causal(node):
            continue
        args = [*node.args[:MASK_ARGUMENT], None, *node.args[MASK_ARGUMENT + 1:]]
        if meaning == "causal" and len(args) > CAUSAL_ARGUMENT:
            args[CAUSAL_ARGUMENT] = True
        elif meaning == "causal":
            node.kwargs = {**node.kwargs, "is_causal": True}
        node.args = tuple(args)
        _erase_unused(mask)
        changed = True
    if changed:
        graph_module.recompile()
    return graph_module


def _allowing_addend_dropped(graph_module: fx.GraphModule, attention: fx.Node, meanings: dict[fx.Node, str | None],
                             state: set[int]) -> bool:
    """Pass ``attention`` the float mask ``x`` where its mask is ``x + c`` and ``c`` a constant
    that lets every query see every key (all true, or all zero): adding it changes no
    attention (a boolean's ``+1`` is the same for every key of a row, which softmax ignores),
    but materialises a mask of the batch's size. Hugging Face's BEiT, traced, adds its padding
    mask, all true, to its learned position bias: a [batch, heads, q, k] float mask per layer
    where eager passes the [1, heads, q, k] bias (its bf16 floor plan was 0.72x of eager
    against per-block checkpointing's 0.65x). Returns whether it changed the call."""
    mask = attention.args[MASK_ARGUMENT]
    if mask.target is not torch.ops.aten.add.Tensor or len(mask.args) != 2 or mask.kwargs:
        return False
    for kept, addend in (mask.args, mask.args[::-1]):
        if not (isinstance(kept, fx.Node) and isinstance(addend, fx.Node)):
            continue
        value, result = kept.meta.get("val"), mask.meta.get("val")
        if not (isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor)
                and value.is_floating_point() and value.dtype == result.dtype):
            continue
        if _constant_meaning(graph_module, addend, meanings, state) == "none":
            attention.args = (*attention.args[:MASK_ARGUMENT], kept, *attention.args[MASK_ARGUMENT + 1:])
            _erase_unused(mask)
            return True
    return False


def _constant_meaning(graph_module: fx.GraphModule, mask: fx.Node, meanings: dict[fx.Node, str | None],
                      state: set[int]) -> str | None:
    """:func:`mask_meaning` of ``mask``'s value where it can never change (it reads no input,
    parameter or buffer: :func:`_reads_inputs_or_state`), else ``None``; evaluated once per
    node, in ``meanings`` (one mask serves every layer)."""
    if mask not in meanings:
        ancestors = _ancestors(mask)
        fixed = not _reads_inputs_or_state(graph_module, ancestors, state)
        meanings[mask] = mask_meaning(_evaluate(graph_module, mask, ancestors), None) if fixed else None
    return meanings[mask]


def mask_meaning(mask: torch.Tensor, attention: fx.Node) -> str | None:
    """``"none"`` for a mask that lets every query see every key, ``"causal"`` for the
    lower-triangular one (square, not already causal, every batch and head alike), else
    ``None``. Boolean masks allow where true; additive float masks where zero and block
    with ``-inf`` or the dtype's lowest value.

    >>> mask_meaning(torch.ones(2, 1, 3, 3, dtype=torch.bool), None)
    'none'
    >>> mask_meaning(torch.ones(3, 3, dtype=torch.bool).tril(), None)
    'causal'
    """
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        blocked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | blocked).all()):
            return None
        allowed = mask == 0
    else:
        return None
    if bool(allowed.all()):
        return "none"
    length = allowed.shape[-1]
    already_causal = attention is not None and _is_causal(attention)
    if allowed.dim() < 2 or allowed.shape[-2] != length or already_causal:
        return None
    causal = torch.ones(length, length, dtype=torch.bool, device=allowed.device).tril()
    return "causal" if bool((allowed == causal).all()) else None


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it depends on."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(current.all_input_nodes)
    return found


def _state_ids(graph_module: fx.GraphModule) -> set[int]:
    """``id`` of every parameter and buffer of ``graph_module``, tied ones under each name."""
    return ({id(t) for _, t in graph_module.named_parameters(remove_duplicate=False)}
            | {id(t) for _, t in graph_module.named_buffers(remove_duplicate=False)})


def _reads_inputs_or_state(graph_module: fx.GraphModule, ancestors: set[fx.Node], state: set[int]) -> bool:
    """Whether a value computed from ``ancestors`` reads an input, a parameter or a buffer
    (``state``: :func:`_state_ids`), and so may differ at another call: Swin's relative
    position bias table starts at zeros, so the additive mask it makes lets every query see
    every key when captured, and folding it away would leave the table out of forward and
    without a gradient for good."""
    return any(n.op not in ("call_function", "get_attr")
               or (n.op == "get_attr" and id(operator.attrgetter(n.target)(graph_module)) in state)
               for n in ancestors)


def _is_causal(attention: fx.Node) -> bool:
    """Whether an attention call already asks for the causal mask itself."""
    return bool(attention.kwargs.get("is_causal", False) or (
        len(attention.args) > CAUSAL_ARGUMENT and attention.args[CAUSAL_ARGUMENT]))


def _evaluate(graph_module: fx.GraphModule, node: fx.Node, ancestors: set[fx.Node]) -> torch.Tensor:
    """The value of ``node``, computed from its ``ancestors`` (plain ops and attributes only)."""
    values: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for current in graph_module.graph.nodes:  # in order: inputs before their users
            if current not in ancestors:
                continue
            if current.op == "get_attr":
                values[current] = operator.attrgetter(current.target)(graph_module)
            else:
                args, kwargs = fx.node.map_arg((current.args, current.kwargs), values.__getitem__)
                values[current] = current.target(*args, **kwargs)
    return values[node]


def _erase_unused(node: fx.Node) -> None:
    """Erase ``node`` and then its inputs, each once nothing uses it any more."""
    stack, erased = [node], set()
    while stack:
        current = stack.pop()
        if current in erased or current.users or current.op not in ("call_function", "get_attr"):
            continue
        inputs = current.all_input_nodes
        current.graph.erase_node(current)
        erased.add(current)
        stack.extend(inputs)
