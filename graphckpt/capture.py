"""Capture a model's forward as a ``torch.fx.GraphModule``.

``torch.fx.symbolic_trace`` first: it keeps the model's own modules as ``call_module``
nodes and works for any input shape. When fx cannot trace the model (data-dependent
Python, unsupported constructs) or cannot record what it runs (a switch of grad mode or
autocast inside forward, ``with torch.no_grad():``) and example inputs are given,
``torch.export`` (non-strict) is the fallback: it traces real tensor operations, at the
example inputs' shapes, and records such switches.
"""

from __future__ import annotations

import inspect
import os
import random
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx, nn

from graphckpt.blocks import find_blocks, join_path
from graphckpt.functions import functions_kept_whole
from graphckpt.kv_cache import cache_off_while_captured
from graphckpt.leaf_modules import trace_model
from graphckpt.masks import fold_constant_masks
from graphckpt.module_hooks import warn_global_hooks, warn_hooks_traced_in
from graphckpt.progress import paused_gc
from graphckpt.stamping import export_stamped
from graphckpt.torch_compat import ModeSwitch, export_training_graph, mode_switches

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
    return _innermost_user_frame(traceback.extract_tb(error.__traceback__))


def _innermost_user_frame(frames: traceback.StackSummary) -> str:
    """``file:line: code`` of the innermost of ``frames`` outside torch and graphckpt."""
    frames = [f for f in frames if not os.path.abspath(f.filename).startswith(_TORCH_DIR)
              and "graphckpt" not in os.path.basename(os.path.dirname(f.filename))]
    if not frames:
        return "inside torch"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"


def _unrecorded_switches(switches: Sequence[ModeSwitch]) -> str:
    """What fx ran but could not record, each once, with where: ``grad mode (at file:line: code)``."""
    named = dict.fromkeys(f"{switch.what} (at {_innermost_user_frame(switch.stack)})" for switch in switches)
    return "; ".join(named)


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
    module with hooks whole and tracing into PyTorch's transformer layers
    (:mod:`graphckpt.leaf_modules`); arguments the example call does not pass are fixed at
    their defaults."""
    return trace_model(model, unused_defaults(model, args, kwargs) or None)


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


def _python_random_states() -> tuple:
    """The states of Python's ``random`` and of ``numpy.random`` (when numpy is installed)."""
    try:
        import numpy
    except ImportError:
        return (random.getstate(),)
    _, keys, position, *_ = numpy.random.get_state()
    return random.getstate(), keys.tobytes(), position


def capture(model: nn.Module, example_inputs: tuple | None = None,
            example_kwargs: Mapping[str, Any] | None = None) -> Captured:
    """Trace ``model`` with fx, falling back to ``torch.export`` when inputs are given, and
    preferring it for a model with its own autograd Functions, which export keeps whole
    (:mod:`graphckpt.functions`) where fx traces through them.

    Raises :class:`CaptureError` naming the construct fx choked on and what to try, and
    when forward draws from Python's ``random`` or ``numpy.random`` while it is captured: a
    graph keeps what was drawn as constants, so every step would reuse the same draws.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"expected an nn.Module, got {type(model).__name__}")
    states = _python_random_states()
    with cache_off_while_captured(model):  # a training step builds no KV cache (graphckpt.kv_cache)
        captured = _capture(model, example_inputs, example_kwargs)
    if _python_random_states() != states:
        raise CaptureError(
            f"{type(model).__name__}'s forward drew random numbers from Python's random or numpy.random while "
            "it was captured: a graph keeps those draws as constants, so every training step would reuse them "
            "(Hugging Face speech models draw SpecAugment's masks so: mask_time_prob, mask_feature_prob). Draw "
            "them with torch (torch.rand, torch.randint), switch them off, or checkpoint the model in place with "
            "graphckpt.enable(model, example_inputs), which runs its own forward.")
    return captured


def _capture(model: nn.Module, example_inputs: tuple | None,
             example_kwargs: Mapping[str, Any] | None) -> Captured:
    """:func:`capture`'s choice of fx or export."""
    warn_global_hooks()
    traced = switches = None
    try:
        with functions_kept_whole() as seen, paused_gc(), mode_switches() as switches:  # 50k nodes: 4.2 s -> 3.4 s
            traced = trace_fx(model, example_inputs, example_kwargs)
        if switches:
            fx_reason = f"fx cannot record switching {_unrecorded_switches(switches)}"
            traced = None  # a graph without the switch computes something else
        elif not seen.traced_through or example_inputs is None:
            return Captured(traced, "fx", model)
        else:
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
    if switches and example_inputs is None:
        raise CaptureError(f"torch.fx cannot capture {type(model).__name__} as it runs: {fx_reason}. Pass "
                           "example_inputs so graphckpt can capture it with torch.export, which records such switches.")
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
