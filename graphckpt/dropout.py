"""Dropout drawn again: how a selective segment run by saved-tensor hooks
(:mod:`passes.hooked`, :mod:`graphckpt.hooked`) holds a training-mode dropout.

A dropout saves its noise for backward (CPU: the scaled Bernoulli draws; a GPU: the mask of
the fused kernel), a tensor as large as its input that is no value of the graph. In a hooked
segment the dropout runs as :func:`draw`, which returns that tensor beside the output, so the
segment's hooks drop it after forward like a value the segment made; before it draws, the
call keeps the generator's state (``hooks.stash_generator``). The remake of its group runs
:func:`redraw`, which puts that state back first: the same noise again, and the model's own
random stream, restored after the remake (:func:`restored_generators`), moves as in eager.

``print(gm.code)`` shows ``draw(hooks, 'name', x, p, training)`` in a hooked body and
``redraw(generator_states, 'name', x, p, training)`` in its remake.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.operator_schemas import normalize_function

from graphckpt.torch_compat import dropout_and_saved

_FUNCTIONS = (F.dropout, torch.dropout, torch.ops.aten.dropout.default)


class DropoutCall(NamedTuple):
    """A dropout node as :func:`draw` runs it: the fx node it reads, its ``p`` and whether it
    drops (constants, as the graph passes them), and for an ``nn.Dropout`` called as a
    module that module's path (``p`` and ``training`` then read from it when it runs, so
    ``eval()`` still turns it off)."""

    input: fx.Node
    p: float
    training: bool
    module: str | None = None


def dropout_call(owner: nn.Module, node: fx.Node) -> DropoutCall | None:
    """How ``node`` runs as a dropout the hooked runtime can draw again, or ``None`` for any
    other node (Dropout2d, alpha dropout, in place, ``p`` not in (0, 1), not training)."""
    if node.op == "call_module":
        module = owner.get_submodule(str(node.target))
        if type(module) is not nn.Dropout or module.inplace or not (0 < module.p < 1 and module.training):
            return None
        (source,) = node.all_input_nodes
        return DropoutCall(source, module.p, module.training, str(node.target))
    if node.op != "call_function" or node.target not in _FUNCTIONS:
        return None
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if normalized is None:
        return None
    arguments = normalized.kwargs
    source, p = arguments.get("input"), arguments.get("p", 0.5)
    training = arguments.get("training", arguments.get("train", True))
    if not isinstance(source, fx.Node) or arguments.get("inplace", False) or training is not True:
        return None
    if not isinstance(p, float) or not 0 < p < 1:
        return None
    return DropoutCall(source, p, True)


def generator_state(device: torch.device) -> torch.Tensor:
    """The state of the generator that ops on ``device`` draw from (a copy)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    """Put ``state`` (:func:`generator_state`) back into ``device``'s generator."""
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


@contextlib.contextmanager
def restored_generators(devices: Iterable[torch.device]) -> Iterator[None]:
    """Run the body and give ``devices``' generators back the states they had before it: a
    remake's draws leave the model's random stream where forward and backward left it."""
    before = [(device, generator_state(device)) for device in dict.fromkeys(devices)]
    try:
        yield
    finally:
        for device, state in before:
            set_generator_state(device, state)


def draw(hooks: Any, name: str, x: torch.Tensor, p: float, training: bool) -> tuple[torch.Tensor, Any]:
    """Dropout ``name`` in a hooked segment's forward: its output and the tensor its backward
    saves (``None`` when not training, the output then ``x`` itself, as ``F.dropout``); the
    call (``hooks``, ``None`` when no backward will run) keeps the generator state it drew from."""
    if not training or x.numel() == 0:
        return x, None
    if hooks is not None:
        hooks.stash_generator(name, x.device)
    return dropout_and_saved(x, p)


def redraw(states: dict[str, tuple[torch.device, torch.Tensor]], name: str, x: torch.Tensor, p: float,
           training: bool) -> tuple[torch.Tensor, Any]:
    """Dropout ``name`` in a remake: :func:`draw` again from the generator state it drew
    from in forward (``states``, by dropout), so the same noise."""
    if not training or x.numel() == 0:
        return x, None
    set_generator_state(*states[name])
    return dropout_and_saved(x, p)
