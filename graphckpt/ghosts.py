"""Ghosts of :mod:`graphckpt.op_dedup`: what a repeated call takes from the first of its
kind (a :class:`Template`, or a :class:`ViewTemplate` for a call that makes no memory) and
the autograd function that stands in for it (:class:`Ghost`): outputs of the
representative's layouts, and in backward gradients laid out as the op's own backward
would lay them out (:func:`gradient_strides`), checked afterwards by the dedup run."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from graphckpt.lazy_fake import contiguous_strides, empty_like_layout, strides_like
from graphckpt.node_cost import NodeCost
from graphckpt.op_keys import tensor_layout
from graphckpt.torch_compat import FakeTensorMode, fake_empty, unset_fake_temporarily


@dataclass(frozen=True)
class Template:
    """A representative's figures and output layouts, for the ghosts of its key."""

    name: str
    cost: NodeCost
    spec: Any
    outputs: tuple[tuple, ...]
    requires_grad: tuple[bool, ...]
    saved: tuple[int | None, ...]  # per saved name: the input slot whose owner it is; None: the node itself
    eval_alias: int | None  # the input slot whose owner ``cost.eval_alias_of`` is

    @property
    def grads_like_incoming(self) -> bool:
        """Whether its backward lays input gradients out like the incoming one (not a matmul
        or convolution: :func:`gradient_strides`)."""
        return not self.cost.expensive


@dataclass(frozen=True)
class ViewTemplate:
    """A representative that makes no memory (a view, a reshape that can view, a check):
    its copies run their op as it is, cheaply and unmeasured, and take its forward figures.
    Where the representative's backward calls are on record (a slice's backward makes a
    gradient of its input's size), each copy's are recorded under its own name, and its
    backward figures come from them as any profiled node's do."""

    name: str
    cost: NodeCost
    alias: int | None  # the input slot whose memory the outputs lie in (``cost.alias_of``'s)
    recorded: bool  # the representative's backward calls are recorded


@dataclass(frozen=True)
class GhostCall:
    """What a ghost's backward needs: the fake mode, where to note the gradient layouts it
    gives each input slot, its representative's template."""

    mode: FakeTensorMode
    emitted: dict[int, Counter]  # slot -> gradient layouts given
    template: Template
    slots: tuple[int | None, ...]  # per tensor input: its first slot when it has a grad_fn, else None


class Ghost(torch.autograd.Function):
    """Outputs of the representative's layouts; in backward, gradients for the inputs
    (:func:`gradient_strides`), whose layouts are checked afterwards against the
    representative's."""

    @staticmethod
    def forward(ctx: Any, call: GhostCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.inputs = [(tuple(t.shape), t.dtype, t.device) for t in tensors]
        outputs = tuple(empty_like_layout(call.mode, layout) for layout in call.template.outputs)
        ctx.mark_non_differentiable(*(o for o, rg in zip(outputs, call.template.requires_grad, strict=True) if not rg))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        call, result = ctx.call, []
        incoming = grads if call.template.grads_like_incoming else ()
        for index, (shape, dtype, device) in enumerate(ctx.inputs):
            if not ctx.needs_input_grad[index + 1]:
                result.append(None)
                continue
            result.append(fake_empty(call.mode, shape, gradient_strides(shape, incoming), dtype, device))
            if call.slots[index] is not None:
                call.emitted.setdefault(call.slots[index], Counter())[tensor_layout(result[-1])] += 1
        return None, *result


def gradient_strides(shape: tuple[int, ...], incoming: tuple[Any, ...]) -> tuple[int, ...]:
    """The strides of the gradient a ghost hands an input of ``shape``, as its op's backward
    would make it from the ``incoming`` gradients (given for an op that is not a matmul or
    a convolution; none for those): laid out like the first of the input's shape, else like a view of
    one with as many elements (a reshape's), else contiguous (a matmul's). A guess, which
    the check after the backward confirms; the ghosts along a transposed attention input
    (rotary embeddings) need more than contiguous ones, and a retry costs a whole run.

    >>> gradient_strides((2, 3), (torch.empty(3, 2).t(),))  # a transposed gradient: transposed
    (1, 2)
    >>> gradient_strides((3, 2), (torch.empty(2, 3),))  # a reshape's: a view of it
    (2, 1)
    >>> gradient_strides((2, 3), ())  # a matmul's
    (3, 1)
    """
    grads = [g for g in incoming if isinstance(g, torch.Tensor)]
    for grad in grads:
        if tuple(grad.shape) == shape:
            return strides_like(shape, grad.stride())
    for grad in grads:
        if grad.numel() == math.prod(shape):
            with unset_fake_temporarily():
                try:
                    return torch.empty_strided(grad.shape, grad.stride(), device="meta").view(shape).stride()
                except RuntimeError:
                    pass
    return contiguous_strides(shape)


def first_slots(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Per tensor input, the first position the same tensor object has among them."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), index) for index, t in enumerate(tensors))
