"""Shared check: a rewritten module trains exactly like the model it came from."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import graphckpt
from graphckpt.tools import zoo

RTOL, ATOL = 1e-5, 1e-6


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for key in sorted(output) for t in _tensors(output[key])]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def default_loss(output: Any) -> torch.Tensor:
    """A scalar touching every floating output (sum of mean squares)."""
    return sum(t.float().pow(2).mean() for t in _tensors(output) if t.is_floating_point())


def train_step(module: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    output = module(*args, **kwargs)
    loss_fn(output).backward()
    return [t.detach().clone() for t in _tensors(output)]


def assert_trains_like(reference: nn.Module, model: nn.Module, rewritten: nn.Module, args: tuple,
                       kwargs: dict | None = None, loss_fn: Callable = default_loss, seed: int = 0,
                       rtol: float = RTOL, atol: float = ATOL) -> None:
    """One training step of ``rewritten`` (sharing ``model``'s tensors) against ``reference``
    (a deep copy of ``model`` taken before): outputs, every gradient and every buffer equal
    (within ``rtol`` and ``atol``: float32's by default)."""
    kwargs = kwargs or {}
    expected = train_step(reference, args, kwargs, loss_fn, seed)
    actual = train_step(rewritten, args, kwargs, loss_fn, seed)
    _assert_same_step(_after(reference, expected), _after(model, actual), rtol, atol)


Step = tuple[list[torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]
"""A training step's outputs, then the model's gradients and buffers after it, by name."""


def _after(model: nn.Module, outputs: list[torch.Tensor]) -> Step:
    return (outputs, {name: parameter.grad for name, parameter in model.named_parameters()},
            {name: buffer.detach().clone() for name, buffer in model.named_buffers()})


def _assert_same_step(want: Step, got: Step, rtol: float, atol: float) -> None:
    """Outputs, every gradient (``None`` where it is ``None``) and every buffer equal."""
    assert len(got[0]) == len(want[0])
    for e, a in zip(want[0], got[0], strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
    for name, expected in want[1].items():
        if expected is None:
            assert got[1][name] is None, name
            continue
        torch.testing.assert_close(got[1][name], expected, rtol=rtol, atol=atol, msg=f"grad of {name}")
    for name, expected in want[2].items():
        torch.testing.assert_close(got[2][name], expected, rtol=rtol, atol=atol, msg=f"buffer {name}")


def _stepped(model: nn.Module, module: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable, seed: int) -> Step:
    """One training step of ``module`` (sharing ``model``'s tensors) from no gradients."""
    model.zero_grad(set_to_none=True)
    return _after(model, train_step(module, args, kwargs, loss_fn, seed))


def assert_steps_alike(model: nn.Module, expected: nn.Module, actual: nn.Module, args: tuple,
                       kwargs: dict | None = None, loss_fn: Callable = default_loss, seed: int = 0,
                       rtol: float = RTOL, atol: float = ATOL) -> None:
    """One training step of ``actual`` against one of ``expected``, two programs sharing
    ``model``'s tensors, from the same buffers: outputs, every gradient and every buffer
    equal. Where :func:`assert_trains_like` compares a rewrite with the model's own code,
    this compares it with another program run on the model, such as the captured one it was
    made from: a difference the capture already makes is then not the rewrite's."""
    kwargs = kwargs or {}
    before = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    want = _stepped(model, expected, args, kwargs, loss_fn, seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(before[name])
    _assert_same_step(want, _stepped(model, actual, args, kwargs, loss_fn, seed), rtol, atol)


def fresh_pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(reference, model)``: a deep copy to compare against, and the model itself.

    The model must have no gradients yet: ``nn.Parameter``'s deep copy leaves ``.grad``
    behind, so the reference would start from none while the model adds to its own, and
    gradients would differ for no fault of the rewrite."""
    stale = [name for name, parameter in model.named_parameters() if parameter.grad is not None]
    assert not stale, f"fresh_pair: {len(stale)} parameters already have gradients ({stale[0]}, ...); build a fresh model"
    return copy.deepcopy(model), model


def zoo_pair(name: str) -> tuple[nn.Module, nn.Module, tuple]:
    """``(reference, model, inputs)`` for the zoo model ``name`` (see :func:`fresh_pair`)."""
    model, inputs = zoo.make(name)
    return (*fresh_pair(model), inputs)


def assert_trains_like_twice(reference: nn.Module, model: nn.Module, rewritten: nn.Module, args: tuple) -> None:
    """:func:`assert_trains_like` for two steps: the second checks that running statistics moved
    once per step and that the rewritten module's calls start afresh."""
    for _ in range(2):
        assert_trains_like(reference, model, rewritten, args)


def assert_backpropagates_twice(rewritten: nn.Module, model: nn.Module, args: tuple) -> None:
    """Two backwards of one retained graph of ``rewritten`` give ``model``'s parameters the
    same gradients (whatever a recompute made for the first is made again for the second)."""
    loss = zoo.scalar_loss(rewritten(*args))
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def assert_rewrite_trains_like(model: nn.Module, inputs: tuple, loss_fn: Callable, steps: int = 2,
                               **options: Any) -> nn.Module:
    """``graphckpt.rewrite(model, inputs, **options)``, checked to recompute something and to
    train ``steps`` steps like a deep copy of ``model`` taken before (:func:`fresh_pair`);
    returns the rewritten module."""
    reference, model = fresh_pair(model)
    rewritten = graphckpt.rewrite(model, inputs, **options)
    assert "recomputed in backward" in rewritten.code and " 0 of " not in rewritten.code.splitlines()[0]
    for _ in range(steps):
        assert_trains_like(reference, model, rewritten, inputs, loss_fn=loss_fn)
    return rewritten
