"""The attention masks tracing made, taken back out of a captured graph.

Hugging Face models skip the attention mask in eager mode when there is no padding, but
build it as a tensor when traced; :func:`fold_constant_masks` folds each mask that depends
on no input away where it says nothing (part of :func:`graphckpt.capture.trace_export`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

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
