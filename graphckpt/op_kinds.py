"""What kinds of ATen ops a node runs, seen from under it while the profile runs it
(:class:`OpKinds`): random draws, matmuls and convolutions (what a selective segment keeps,
:func:`kept_by_selective`), ops that are neither views nor pointwise, ops writing one of
their arguments (:func:`writes_an_argument`), the temporaries
its calls make and free inside the node (``forward_extra_bytes``), and the parameter casts
autocast's cache keeps to the end of forward (``autocast_cache_bytes``). Split from
:mod:`graphckpt.profile`, which runs the nodes and turns this into a ``NodeCost``."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from graphckpt.scratch import layouts_of
from graphckpt.state import RUNNING_STATS
from graphckpt.torch_compat import (
    TorchDispatchMode,
    allocated_bytes,
    draws_random_numbers,
    is_cast,
    op_schema,
    storage_key,
    storage_key_and_ref,
    tree_leaves,
)
from graphckpt.written import schema_writes

NARROW_FLOATS = (torch.float16, torch.bfloat16)


def caching_devices() -> frozenset[str]:
    """The device types whose autocast region caches parameter casts now (autocast on, its
    cache on); asked outside any dispatch mode, which sees autocast as off."""
    if not torch.is_autocast_cache_enabled():
        return frozenset()
    return frozenset(device for device in ("cpu", "cuda") if torch.is_autocast_enabled(device))


def narrows_a_trained_leaf(source: Any, cast: Any) -> bool:
    """Whether ``cast``, a ``_to_copy`` of ``source``, makes a float32 leaf that requires grad
    (a parameter) 16-bit: autocast's cast of a weight, whose gradient backward makes 16-bit and
    then casts up (the cost graph's ``param_grad_cast_bytes``)."""
    return (isinstance(source, torch.Tensor) and isinstance(cast, torch.Tensor) and source.dtype == torch.float32
            and source.requires_grad and source.is_leaf and cast.dtype in NARROW_FLOATS)


def cached_by_autocast(source: Any, cast: Any, devices: frozenset[str]) -> bool:
    """Whether autocast's cache keeps ``cast``, a ``_to_copy`` of ``source``, until its region
    ends: a parameter made 16-bit (:func:`narrows_a_trained_leaf`) on a device whose autocast
    caches (ATen's ``cached_cast``)."""
    return narrows_a_trained_leaf(source, cast) and source.device.type in devices


CONVOLUTION_OPS = frozenset({"convolution", "_convolution", "mkldnn_convolution", "convolution_overrideable",
                             "cudnn_convolution"})
EXPENSIVE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", *CONVOLUTION_OPS, "_scaled_dot_product_flash_attention",
                           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"})
# CPU's fused attention (``_scaled_dot_product_flash_attention_for_cpu``) is left out on purpose:
# a selective segment keeps every expensive output it holds, with no choice per segment, and
# keeping attention's made HF GPT-2's plans at torch.compile 0.5's peak slower, predicted and
# measured (commit 703200b).
ATTENTION_CALLS = frozenset({torch.nn.functional.scaled_dot_product_attention,
                             torch.ops.aten.scaled_dot_product_attention.default})
"""A graph node's targets that run attention: by a fused kernel (an op named
``_scaled_dot_product_*``) or else by the math kernel's chain of ATen calls, which branches on
a dispatch mode being active (:func:`graphckpt.scratch.plain_forward_temporaries`)."""

SCRATCH_AT_ANY_WIDTH = frozenset({*CONVOLUTION_OPS, "_safe_softmax"})
"""Ops whose kernels allocate inside themselves at every float width, so their forward calls
are replayed for scratch in float32 too (:func:`replayed_for_scratch`): oneDNN's convolution,
and the math attention's ``_safe_softmax``, which builds a boolean mask of its input's
``-inf`` entries and each row's ``all`` of it beside its output."""


def kept_by_selective(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether a selective segment keeps this call's outputs from forward: matmuls,
    convolutions and fused attention (:data:`EXPENSIVE_OPS`), except a call that draws random
    numbers (fused attention with dropout). That one must run again in the recompute: a
    cached result draws nothing, so every later random op of the segment would draw from
    another place in the stream (T5 on CUDA got other dropout masks in backward, and
    gradients 60% off). The profile and the runtime's policy both ask this one function.
    """
    return func.overloadpacket.__name__ in EXPENSIVE_OPS and not draws_random_numbers(func, args, kwargs)


@functools.cache
def writes_an_argument(func: Any) -> bool:
    """Whether a functional ATen op (not an in-place or ``out=`` variant) writes one of its
    arguments, a norm's running statistics aside. ``rrelu_with_noise`` saves ``noise`` for
    backward, then writes RReLU's random slopes into it; torch's checkpoint ends a recompute
    once every saved tensor is packed, before that write, so backward read a noise never
    filled (``torch.utils.checkpoint(use_reentrant=False)`` gives RReLU wrong gradients so:
    pytorch/pytorch#193671).
    Such an op is never recomputed. Training backward does not read running statistics, and
    a recompute updates scratch copies of them (:mod:`graphckpt.state`); a buffer named
    ``out`` is the op's own result written in place (FA3's
    ``_flash_attention_forward_no_dropout_inplace``), not an input it saved.

    >>> writes_an_argument(torch.ops.aten.rrelu_with_noise.default), writes_an_argument(torch.ops.aten.relu_.default)
    (True, False)
    """
    return not op_schema(func).name.endswith("_") and any(
        not is_out and name not in (*RUNNING_STATS, "out") for _, name, is_out in schema_writes(func))


GRADIENT_VIEW_OPS = frozenset({"cat", "stack"})  # backward slices the output's gradient
CAST_METHODS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16"})
CAST_OPS = frozenset({"to", "_to_copy", "type_as"})


def is_cast_node(node: Any) -> bool:
    """Whether an fx node is a cast of its own (``x.to(dtype)``, ``x.float()``, exported
    ``aten.to``/``aten._to_copy``), not an op autocast casts the inputs of inside it: a
    selective segment keeping such a node whole keeps its cast
    (:func:`graphckpt.segment_calls.keep_begin`)."""
    if node.op == "call_method":
        return node.target in CAST_METHODS
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and (node.target is torch.Tensor.to
                                           or getattr(packet, "__name__", None) in CAST_OPS)


def mixes_float_widths(args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether a call reads tensors (not 0-d) of several floating dtypes: on CPU a pointwise
    kernel copies the narrower ones to the common dtype first (TensorIterator's promotion),
    scratch no dispatch mode sees (a float32 residual added to a bf16 attention output under
    autocast: 128 KiB over a small self-attention model's simulated peak)."""
    dtypes = {t.dtype for t in tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.dim() and t.dtype.is_floating_point}
    return len(dtypes) > 1


def replayed_for_scratch(func: Any, opaque: bool, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward call's kernel scratch is measured (:meth:`OpKinds._note_for_replay`): an
    ``opaque`` call, or one mixing float widths (:func:`mixes_float_widths`), on 16-bit floats;
    and one of :data:`SCRATCH_AT_ANY_WIDTH` of any width. oneDNN's float32 convolution allocates
    inside itself too: LeViT's stem (3 -> 4 channels, stride 2, 8 images of 64x64) takes 512 KiB
    beside its 128 KiB output, and its recompute in backward measured 12% over its plan's
    simulated peak. A 6-block Swin's float32 floor plan measured 3.1% over its simulated peak
    for want of its attention softmax's 34 KiB of mask."""
    if func.overloadpacket.__name__ in SCRATCH_AT_ANY_WIDTH:
        return True
    return (opaque or mixes_float_widths(args, kwargs)) and any(
        isinstance(t, torch.Tensor) and t.dtype in NARROW_FLOATS for t in tree_leaves((args, kwargs)))


class OpKinds(TorchDispatchMode):
    """Notices which kinds of ATen ops run under it: random draws, matmuls/convolutions, and
    ops that are neither views nor pointwise (``opaque``).

    It follows the storages those calls make (:meth:`forward_extra_bytes`), and notes the
    parameter casts autocast's cache will keep to the end of forward (``cached_casts``,
    :func:`cached_by_autocast`). Only an opaque
    op can need scratch memory in its backward: views allocate nothing, and
    the derivatives of pointwise ops are pointwise ops (and sums for broadcasting), kernels
    that write straight into their outputs (every one replayed on the zoo measured 0 bytes).
    """

    def __init__(self) -> None:
        super().__init__()
        self.random = False
        self.writes_argument = False  # an op wrote one of its arguments (:func:`writes_an_argument`)
        self.kernel_output_written = False  # an op wrote in place into a kept_by_selective call's output
        self.expensive = False
        self.opaque = False
        self.fused_attention = False  # a ``_scaled_dot_product_*`` kernel ran (:data:`ATTENTION_CALLS`)
        self.last = ""  # the last op: ``cat`` or ``stack`` hands its inputs views of its gradient
        self.expensive_outputs: list[tuple[int, Any, int]] = []  # what a selective checkpoint policy keeps:
        # (storage key, weak reference, bytes), never the tensor, which would outlive its use here and hide a
        # temporary from forward_extra_bytes (attention's last matmul output under bf16: 66 KB on ViT)
        self.made: list[int] = []  # bytes of each storage a call made, in order
        self.cached_made: set[int] = set()  # indices into ``made`` of the outputs selective checkpointing keeps
        self.events: list[int] = []  # indices into ``made``: ``i`` made, ``-i - 1`` freed, in time order
        self.tensors: dict[int, list[int]] = {}  # storage key -> [index in ``made``, tensors alive on it]
        self.scratch_calls: list[tuple] = []  # (func, args, kwargs as layouts): see :meth:`_note_for_replay`
        self.scratch_at: list[int] = []  # for each of them, its place in ``events``: just after its results
        self.scratch_kernel: list[bool] = []  # for each of them, whether selective checkpointing would keep its
        # outputs (a matmul's): a rerun served from the cache does not call it, nor make its scratch
        self.caching = caching_devices()
        self.cached_casts: list[tuple[int, Any, int]] = []  # (storage key, weak reference, bytes): parameter
        # casts autocast's cache keeps to the end of forward (passes.costgraph's ``autocast_cache_bytes``)
        self.parameter_casts: list[tuple[int, int]] = []  # (bytes of the 16-bit copy, of the parameter) of each
        # parameter this node casts (passes.costgraph's ``param_grad_narrow_bytes``, ``param_grad_cast_bytes``)
        self.running = True

    def __exit__(self, *exc: Any) -> Any:
        self.running = False  # what is freed after the node ran is no scratch of it
        return super().__exit__(*exc)

    def _follow(self, tensor: torch.Tensor, new: bool, kept: bool = False) -> None:
        """Count ``tensor`` among those keeping its storage alive (one ``new`` to it makes
        the storage an allocation of the node, ``kept`` by selective checkpointing's cache
        when a matmul's); the storage is freed with the last of them."""
        key = storage_key(tensor)
        if new:
            if kept:
                self.cached_made.add(len(self.made))
            self.tensors[key] = [len(self.made), 0]
            self.events.append(len(self.made))
            self.made.append(allocated_bytes(tensor))
        elif key not in self.tensors:
            return
        self.tensors[key][1] += 1
        weakref.finalize(tensor, self._dropped, key)

    def _dropped(self, key: int) -> None:
        entry = self.tensors[key]
        entry[1] -= 1
        if entry[1] == 0 and self.running:
            self.events.append(-entry[0] - 1)
            del self.tensors[key]

    def _note_for_replay(self, func: Any, layouts: tuple, kernel: bool) -> None:
        """Keep a call :func:`replayed_for_scratch` names for replay (:attr:`scratch_calls`, its
        args and kwargs as ``layouts``), and where it ran among the node's storages
        (:meth:`scratch_heights`), after its results are followed: on CPU such kernels allocate
        inside themselves, where no dispatch mode sees it (``mean`` of bf16 copies its input to
        float32, ``slow_conv2d`` builds its im2col buffer), and this scratch is part of the
        node's forward peak. wav2vec2 planned under bf16 measured 1.05x its simulated peak for
        want of its pooling ``mean``'s copy. Float32 calls are not replayed: the corpus keeps
        its budgets without it, and replays cost profile time; convolutions are the exception
        (:func:`replayed_for_scratch`)."""
        self.scratch_calls.append((func, *layouts))
        self.scratch_at.append(len(self.events))
        self.scratch_kernel.append(kernel)

    def _running(self, served_from_cache: bool) -> list[int]:
        """Bytes of the storages the node's calls made and had not freed, before its first
        event and after each one. ``served_from_cache``: as a selective segment's recompute
        reruns the node, its matmul outputs handed back by the cache: alive from the start
        (made in forward, held by the cache) rather than made where the kernel ran. Swin's
        attention under bf16 holds its second matmul's float32 product, cached, while the
        rerun adds the mask: 16 KiB its plans measured over their simulated peaks."""
        cached = self.cached_made if served_from_cache else set()
        running = [sum(self.made[index] for index in cached)]
        for event in self.events:
            if event >= 0:
                running.append(running[-1] + (0 if event in cached else self.made[event]))
            else:
                running.append(running[-1] - self.made[-event - 1])
        return running

    def scratch_heights(self, served_from_cache: bool = False) -> list[int]:
        """For each call of :attr:`scratch_calls`, the bytes of the storages the node's calls
        had made and not freed while it ran (its own results among them), above those alive
        when the node ended: what its kernel scratch sits on, on top of what the node makes
        and saves (:func:`graphckpt.node_cost.with_forward_scratch`); ``served_from_cache``:
        in a rerun served from selective checkpointing's cache (:meth:`_running`). Negative
        for a call before the node's results were made."""
        running = self._running(served_from_cache)
        return [running[position] - running[-1] for position in self.scratch_at]

    def forward_extra_bytes(self, served_from_cache: bool = False) -> int:
        """Peak bytes of the storages the node's calls made, above those still alive when it
        ended (what it returns and saves): the temporaries of an op run as a chain of ATen
        calls (attention by the math kernel scales the query, builds a mask). 0 for a node of
        only views and pointwise ops, whose steps eager runs one by one as well.
        ``served_from_cache``: in a rerun served from selective checkpointing's cache
        (:meth:`_running`), the node's ``cached_rerun_extra_bytes`` before kernel scratch."""
        if not self.opaque:
            return 0
        running = self._running(served_from_cache)
        return max(running) - running[-1]

    def _writes_kernel_output(self, func: Any, args: tuple, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call writes in place into a storage a matmul or convolution of this node
        made (a GRU's ``sigmoid_`` on its gates): selective checkpointing keeps those outputs by
        reference, so a recompute would be handed the written value, and apply the write again."""
        written = [args[i] if i < len(args) else kwargs.get(name) for i, name, _ in schema_writes(func)]
        if not written:
            return False
        kernels = {key for key, _, _ in self.expensive_outputs}
        return any(isinstance(t, torch.Tensor) and storage_key(t) in kernels for t in written)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten":  # not prim::device and other metadata queries
            self.last = func.overloadpacket.__name__
            self.fused_attention = self.fused_attention or self.last.startswith("_scaled_dot_product_")
        self.random = self.random or draws_random_numbers(func, args, kwargs)
        self.writes_argument = self.writes_argument or writes_an_argument(func)
        if self.expensive_outputs and not self.kernel_output_written:
            self.kernel_output_written = self._writes_kernel_output(func, args, kwargs or {})
        is_expensive = kept_by_selective(func, args, kwargs or {})
        self.expensive = self.expensive or is_expensive
        opaque = not (func.is_view or torch.Tag.pointwise in func.tags)
        self.opaque = self.opaque or opaque
        replayed = replayed_for_scratch(func, opaque, args, kwargs or {})
        layouts = layouts_of(args, kwargs or {}) if replayed else ()  # as it is called (an in-place call writes)
        result = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                self._follow(tensor, new=not func.is_view and storage_key(tensor) not in inputs, kept=is_expensive)
        if replayed:
            self._note_for_replay(func, layouts, kernel=is_expensive)
        if is_cast(func) and narrows_a_trained_leaf(args[0], result):
            self.parameter_casts.append((allocated_bytes(result), allocated_bytes(args[0])))
            if cached_by_autocast(args[0], result, self.caching):
                self.cached_casts.append((*storage_key_and_ref(result), allocated_bytes(result)))
        if is_expensive:
            self.expensive_outputs.extend((*storage_key_and_ref(t), allocated_bytes(t))
                                          for t in tree_leaves(result) if isinstance(t, torch.Tensor))
        return result
