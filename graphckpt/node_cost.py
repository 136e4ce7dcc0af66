"""One node's costs as the fake-tensor profile (:mod:`graphckpt.profile`) records them
(:class:`NodeCost`), and the small rules that turn what the profile saw into its fields."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from graphckpt.torch_compat import allocation_size


@dataclass(frozen=True)
class NodeCost:
    """Costs of one node's value, as measured on fake tensors."""

    bytes: int
    alias_of: str | None
    flops: int
    saved: tuple[str, ...]
    saved_extra_bytes: int
    requires_grad: bool
    random: bool
    expensive: bool
    param_grad_bytes: int
    shape: str
    dtype: str
    backward_extra_bytes: int = 0
    forward_extra_bytes: int = 0
    cached_rerun_extra_bytes: int | None = None  # the cost graph's attribute: forward_extra_bytes of a cached rerun
    selective_forward_extra_bytes: int | None = None  # the cost graph's attribute: under selective's dispatch mode
    autocast_cache_bytes: int = 0
    grad_views: bool = False
    grad_bytes: int | None = None  # the cost graph's attribute: a view's gradient buffer, when not its storage's size
    selective_extra_bytes: int = 0
    saves_from: str = "outputs"  # the cost graph's attribute: "nothing", "inputs" or "outputs"
    param_grad_cast_bytes: int = 0  # the cost graph's attribute: of param_grad_bytes, those made by casting up
    param_grad_narrow_bytes: int = 0  # the cost graph's attribute: the 16-bit gradients cast up
    param_grads: tuple[tuple[str, int], ...] = ()  # the cost graph's attribute: (name, bytes) per parameter inside
    released_early: tuple[str, ...] = ()  # the cost graph's attribute: saved values let go before backward's peak
    unpack_held_bytes: int = 0  # the cost graph's attribute: what its backward holds at its first unpack
    backward_allocates: bool = False  # the cost graph's attribute: its backward makes a new storage
    eval_alias_of: str | None = None  # owner of the input memory the node returns in eval mode (a Dropout's input)
    writes_argument: bool = False  # an op of it writes one of its arguments: never recomputed (op_kinds.writes_an_argument)
    kernels_written: bool = False  # the cost graph's attribute: an op of it writes into its own kernels' outputs


def describe_tensors(tensors: list[torch.Tensor]) -> tuple[str, str]:
    """The ``shape`` and ``dtype`` a cost graph shows of a node's output tensors."""
    if not tensors:
        return "", ""
    shapes = ", ".join(str(list(t.shape)) for t in tensors)
    dtypes = ", ".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors}))
    return shapes, dtypes


def trainable_bytes(tensors: Any) -> int:
    """Bytes of the gradients of the trained parameters among ``tensors``."""
    return sum(allocation_size(t.numel() * t.element_size(), t.device) for t in tensors
               if isinstance(t, torch.nn.Parameter) and t.requires_grad)


def selective_extra(inner_bytes: int, remade_bytes: int) -> int:
    """The cost graph's ``selective_extra_bytes`` of a node whose matmul outputs inside it
    come to ``inner_bytes``: what selective checkpointing caches beyond the node's value,
    which the simulator holds as a kept value. Where the value is no matmul output
    (attention under bf16 autocast returns a bf16 cast of its float32 product), it is not
    cached but made again from the cached outputs: its ``remade_bytes`` are counted in
    them already (T5 planned under bf16: 16 KiB more than measured per attention a
    selective segment kept, 3.5% over its plan's measured peak at 0.5 of eager, stop 69)."""
    return max(inner_bytes - remade_bytes, 0)


def with_forward_scratch(temporaries: int, heights: list[int], scratches: list[int]) -> int:
    """A node's ``forward_extra_bytes`` with the kernel scratch of its replayed calls:
    the most of its ``temporaries``' peak and each call's scratch on what the node held while
    it ran (``heights``: :meth:`graphckpt.op_kinds.OpKinds.scratch_heights`), above what it ends
    with. Laid on the whole temporaries' peak instead, the 64 KiB of scratch of the ``add``
    that puts T5's float32 position bias on its attention scores, early in the math kernel
    under bf16, over-simulated its plans by 5-7% (stop 69).

    >>> with_forward_scratch(100, [-20, 40, 90], [0, 50, 0]), with_forward_scratch(100, [-20], [300])
    (100, 280)
    """
    return max([temporaries, *(height + scratch for height, scratch in zip(heights, scratches, strict=True) if scratch)])


def with_plain_forward(cost: NodeCost, plain: int) -> NodeCost:
    """``cost`` with the temporaries its op makes outside a dispatch mode, measured (``plain``:
    :func:`graphckpt.scratch.plain_forward_temporaries`), as its ``forward_extra_bytes``; those
    the profile saw under its own mode become its ``selective_forward_extra_bytes``, as under
    selective checkpointing's mode the op takes the same branch."""
    return replace(cost, forward_extra_bytes=plain, selective_forward_extra_bytes=cost.forward_extra_bytes)
