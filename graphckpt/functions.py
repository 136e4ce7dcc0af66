"""A model's own ``torch.autograd.Function``\\ s, kept whole through ``torch.export``.

Export traces *through* a custom autograd Function: its forward's ATen ops land in the
graph one by one and autograd then saves what each of them needs, not what the Function
chose to save. BLOOM's ``GeLUFunction`` saves its input only; inlined, the tanh-GELU saves
four tensors of the MLP's width and the captured model peaks 1.6x above the real one, so a
plan that beats the captured graph can still lose to the untouched model.

:func:`functions_kept_whole` makes each such call one graph node instead, the custom op
``graphckpt::autograd_function(key, tensors)``. Running it calls the Function's forward
(without autograd); its backward runs the Function's ``forward`` again on the saved inputs,
without autograd, to fill a ``ctx``, and then the Function's own ``backward``. What the
node saves is its tensor inputs, and its backward holds the Function's forward values for a
moment: the simulator sees both through the usual fake-tensor profile. Printed, a node
reads ``torch.ops.graphckpt.autograd_function('module.GeLUFunction', [x])``.

Functions defined inside torch, Functions called with keyword arguments or with
arguments that are neither tensors nor constants, and calls with gradients off are left
as export traces them. A Function that draws random numbers would draw again in its
backward, so :func:`functions_kept_whole` reports it (:attr:`Seen.random`) and the capture
is redone without keeping any Function whole. torch.fx's symbolic trace has no values to
run a Function on, so it traces through them; :func:`graphckpt.capture.capture` then
prefers ``torch.export`` when example inputs are given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from graphckpt.torch_compat import TorchDispatchMode, draws_random_numbers, storage_key

_TENSOR = object()  # where a tensor argument goes in a call's template
_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class _Call:
    """How to call one Function again: the class, and its arguments with tensors left out."""

    function: type
    template: tuple
    returns: list  # [None] for one tensor, [(True, False, ...)] for a tuple: tensor or None per place; set on first run
    random: list  # [True] when its forward draws random numbers; set on the first run while capturing


class _DrawsRandom(TorchDispatchMode):
    """Notices whether any ATen call under it draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.random = self.random or draws_random_numbers(func, args, kwargs)
        return func(*args, **(kwargs or {}))


_CALLS: dict[str, _Call] = {}


@dataclass
class Seen:
    """What one capture did with the model's autograd Functions."""

    kept: list[_Call] = field(default_factory=list)
    traced_through: list[str] = field(default_factory=list)  # called on fx proxies: inlined

    @property
    def random(self) -> list[str]:
        """Functions kept whole whose forward draws random numbers."""
        return sorted({call.function.__qualname__ for call in self.kept if call.random == [True]})


_SEEN: list[Seen] = []  # one per active functions_kept_whole
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]


def _apply(function: type, *args: Any) -> Any:
    """The Function's own ``apply``, never the capture's replacement."""
    return _ORIGINAL_APPLY.__func__(function, *args)


def _arguments(call: _Call, tensors: Sequence[torch.Tensor]) -> list[Any]:
    values = iter(tensors)
    return [next(values) if item is _TENSOR else item for item in call.template]


def _tensors(function: type, result: Any) -> list[torch.Tensor]:
    """The tensors a Function returned, in order (``None`` places left out)."""
    outputs = [result] if isinstance(result, torch.Tensor) else list(result)
    for output in outputs:
        if output is not None and not isinstance(output, torch.Tensor):
            raise TypeError(f"graphckpt keeps autograd.Function {function.__qualname__} whole, but it returned a "
                            f"{type(output).__name__}; only tensors and None can be outputs of a graph node. "
                            "Return the value as a tensor, or call the Function with gradients off")
    return [o for o in outputs if o is not None]


def _forward(key: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The Function's outputs as a list, none of them sharing storage with an input
    (a custom op may not return an alias of its arguments)."""
    call = _CALLS.get(key)
    if call is None:
        raise RuntimeError(
            f"graphckpt::autograd_function: {key!r} was kept whole when a model was captured "
            "in another process; rewrite the model in this process (graphckpt.rewrite) "
            "instead of loading a pickled rewrite")
    watch = _DrawsRandom() if not call.returns else contextlib.nullcontext()
    with torch.no_grad(), watch:
        result = _apply(call.function, *_arguments(call, tensors))
    outputs = _tensors(call.function, result)
    if not call.returns:
        call.returns.append(None if isinstance(result, torch.Tensor) else tuple(o is not None for o in result))
        call.random.append(watch.random)
    inputs = {storage_key(t) for t in tensors}
    return [t.clone() if storage_key(t) in inputs else t for t in outputs]


@torch.library.custom_op("graphckpt::autograd_function", mutates_args=())
def autograd_function(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the autograd Function registered as ``key`` on ``tensors`` (see module doc)."""
    return _forward(key, tensors)


@autograd_function.register_fake
def _(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return _forward(key, tensors)


class _Context:
    """What a Function's ``forward`` and ``backward`` use of ``ctx``, for calling them
    directly: saved tensors, ``needs_input_grad``, attributes they set themselves."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[torch.Tensor, ...] = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    @property
    def saved_variables(self) -> tuple[torch.Tensor, ...]:
        return self.saved_tensors


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    key, tensors = inputs
    ctx.key = key
    ctx.needs = [t.requires_grad for t in tensors]
    ctx.save_for_backward(*tensors)


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[None, list[torch.Tensor | None]]:
    """Gradients of the inputs from the Function's own ``backward``, given the ``ctx`` its
    ``forward`` fills when run again (without autograd) on the saved inputs."""
    call = _CALLS[ctx.key]
    needs = iter(ctx.needs)
    own = _Context(tuple(next(needs) if item is _TENSOR else False for item in call.template))
    arguments = _arguments(call, ctx.saved_tensors)
    with torch.no_grad():
        if _has_setup_context(call.function):
            outputs = call.function.forward(*arguments)
            call.function.setup_context(own, tuple(arguments), outputs)
        else:
            outputs = call.function.forward(own, *arguments)
    outputs = _tensors(call.function, outputs)
    if own.materialize_grads:
        grads = [torch.zeros_like(o) if g is None else g for o, g in zip(outputs, grads, strict=True)]
    del outputs
    if call.returns != [None]:  # a tuple: None where the Function returned None
        given = iter(grads)
        grads = [next(given) if is_tensor else None for is_tensor in call.returns[0]]
    result = call.function.backward(own, *grads)
    result = (result,) if not isinstance(result, tuple) else result
    return None, [g for g, item in zip(result, call.template, strict=False) if item is _TENSOR]


def _has_setup_context(function: type) -> bool:
    """The Function separates ``forward(*args)`` from ``setup_context(ctx, inputs, output)``."""
    return function.setup_context is not torch.autograd.Function.setup_context


autograd_function.register_autograd(_backward, setup_context=_setup_context)


def _key(function: type, template: tuple) -> str:
    """A readable name for a call: the Function's qualified name, and a number when the
    same Function is called with other constant arguments."""
    base = f"{function.__module__}.{function.__qualname__}"
    key, number = base, 1
    while key in _CALLS and (_CALLS[key].function, _CALLS[key].template) != (function, template):
        key, number = f"{base}#{number}", number + 1
    return key


def _keepable(function: type, args: tuple, kwargs: dict) -> bool:
    """A call this module can keep whole: a Function outside torch, positional tensors and
    constants only, some tensor needing a gradient."""
    return (not function.__module__.startswith("torch.") and not kwargs and torch.is_grad_enabled()
            and all(isinstance(a, (torch.Tensor, *_CONSTANTS)) for a in args)
            and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args))


def _kept_apply(function: type, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply`` while capturing: the custom op for a keepable call."""
    if any(isinstance(a, fx.Proxy) for a in args) and not function.__module__.startswith("torch."):
        _SEEN[-1].traced_through.append(function.__qualname__)  # fx: no values to run it on
    if not _keepable(function, args, kwargs):
        return _apply(function, *args, **kwargs)
    template = tuple(_TENSOR if isinstance(a, torch.Tensor) else a for a in args)
    key = _key(function, template)
    call = _CALLS.setdefault(key, _Call(function, template, [], []))
    _SEEN[-1].kept.append(call)
    outputs = autograd_function(key, [a for a in args if isinstance(a, torch.Tensor)])
    if call.returns == [None]:
        return outputs[0]
    found = iter(outputs)
    return tuple(next(found) if is_tensor else None for is_tensor in call.returns[0])


@contextlib.contextmanager
def functions_kept_whole() -> Iterator[Seen]:
    """While active, each call of a model's own autograd Function on tensors becomes one
    ``graphckpt::autograd_function`` node in what is captured (module doc). Yields what it
    saw: the calls kept, and the Functions that ran on fx proxies (traced through, since
    symbolic tracing has no values to learn their outputs from)."""
    seen = Seen()
    _SEEN.append(seen)
    torch.autograd.Function.apply = classmethod(_kept_apply)
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = _ORIGINAL_APPLY
        _SEEN.pop()
