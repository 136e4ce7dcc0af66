"""Fake tensors made only where the profile needs them: a copy of the graph module that
shares the model's tensors and fakes each on first use (:class:`LazyFake`), and fake tensors
of a recorded layout with storages of their own (what a ghost of :mod:`graphckpt.op_dedup`
hands out instead of running its op)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from graphckpt.state import with_fixed_momentum
from graphckpt.torch_compat import FakeTensorMode, fake_empty, module_tree_copy


def strided_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the smallest storage holding ``tensor`` at offset 0 (what ``empty_strided`` makes)."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))) \
        * tensor.element_size()


def empty_like_layout(mode: FakeTensorMode, layout: tuple) -> torch.Tensor:
    """A fake tensor of ``layout`` (:func:`tensor_layout`) with a storage of its own."""
    shape, stride, _, dtype, device, _ = layout
    return fake_empty(mode, shape, stride, dtype, device)


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` gives."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def strides_like(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides for ``shape`` with the dimensions in ``stride``'s order in memory: what
    a pointwise kernel gives its output for an input of that layout (a transposed input's
    order is kept; an expanded dimension counts as outermost). Not
    ``torch._prims_common.compute_elementwise_output_strides``: it strides a size-1
    dimension otherwise than the CPU kernels do, and ghosts' layouts are compared exactly.

    >>> strides_like((2, 3), (1, 2))
    (1, 2)
    >>> strides_like((2, 3), (0, 1))
    (3, 1)
    """
    order = sorted(range(len(shape)), key=lambda d: (stride[d] == 0, stride[d], -d))  # innermost first
    dense, step = [0] * len(shape), 1
    for d in order:
        dense[d] = step
        step *= max(shape[d], 1)
    return tuple(dense)


@dataclass
class LazyFake:
    """A structural copy of the graph module sharing the model's tensors; each is swapped
    for a fake one the first time a profiled node uses it (a ghost never does), so a
    10k-layer model does not pay for converting every parameter."""

    mode: FakeTensorMode
    module: fx.GraphModule
    fakes: dict[int, torch.Tensor] = field(default_factory=dict)  # id(real tensor) -> its fake


def lazy_fake_copy(graph_module: fx.GraphModule) -> LazyFake:
    """A :class:`LazyFake` of ``graph_module`` (the real module is never changed). The
    copy's ``get_submodule`` is a dictionary lookup: the profile asks it several times a
    node, and walking a dotted path costs more than the rest of a ghost's bookkeeping."""
    module = module_tree_copy(graph_module)
    with_fixed_momentum(module.modules())
    modules = {name: m for name, m in module.named_modules(remove_duplicate=False) if m is not module}
    root = weakref.ref(module)  # not the module itself: that would be a reference cycle through its own attribute
    module.get_submodule = lambda target: modules[target] if target in modules else nn.Module.get_submodule(root(), target)
    return LazyFake(FakeTensorMode(allow_non_fake_inputs=True), module)
