"""Scratch memory of backward kernels: what ``backward_extra_bytes`` is made of.

The one thing fake tensors cannot show is memory a kernel allocates *inside* itself and frees
before it returns. Backward kernels do this a lot on CPU: ``convolution_backward`` (oneDNN)
reorders grad_output and the input into blocked layouts for the weight gradient and builds
grad_input in a blocked buffer before copying it out (``X + Y`` more bytes than its gradients,
``2 X`` for strided convolutions, channel counts rounded up to the block), and
``native_batch_norm_backward`` fills an input-sized scratch buffer. So, for
``backward_extra_bytes``, the whole backward is run once on fake tensors under a dispatch
mode that records the ATen calls each node's autograd functions make, and each distinct
call of a node that ran more than views and pointwise ops (op, shapes, strides,
dtypes, arguments) is then replayed once on real tensors and measured the way
:mod:`graphckpt.tools.measure` measures a training step (the yardstick the simulator is checked
against): its peak above the bytes of the outputs it returns. Replays are cached per process;
they hold real memory for one call's arguments and results at a time (at most a few of the
model's activations) and cost about two runs of each distinct backward kernel.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map


def storage_key(tensor: torch.Tensor) -> int:
    """Identifies a tensor's storage (fake tensors included), shared by all its views."""
    return tensor.untyped_storage()._cdata


RELEASED = object()  # the token of an event: saved bytes released (negative)


class Recorder(TorchDispatchMode):
    """Records, for the node named ``owner`` (``None``: record nothing), the ATen calls made
    under it that may allocate: not views, and only calls that return a tensor.

    It also follows the tensors those calls make until autograd drops them: a node whose
    backward is several calls (attention computed by the math kernel: matmul, dropout,
    softmax backward, ...) hands intermediate gradients from one call to the next, and
    :meth:`backward_peak` is the peak of everything its backward makes, net of the saved
    tensors it releases on the way.
    """

    def __init__(self) -> None:
        super().__init__()
        self.owner: str | None = None
        self.calls: dict[str, list[tuple[Any, tuple, dict]]] = {}  # (op, args, kwargs), tensors as Layouts
        self.events: dict[str, list[tuple[object, int]]] = {}  # (token, bytes made), or (token, 0): freed
        self.ends: dict[str, int] = {}  # events before the node's backward ended
        self.extras: dict[int, tuple[int, int]] = {}  # storage saved that no value owns -> (saves, bytes)
        self.releasing: dict[str, list[int]] = {}  # extras unpacked by the function running now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.owner is not None and not func.is_view and \
                any(isinstance(t, torch.Tensor) for t in tree_leaves(result)):
            self.calls.setdefault(self.owner, []).append((func, *layouts_of(args, kwargs)))
            self._follow(self.owner, result, args, kwargs)
        return result

    def _follow(self, owner: str, result: Any, args: tuple, kwargs: dict) -> None:
        """Note the new storages ``result`` makes for ``owner``, and when each is freed."""
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        events = self.events.setdefault(owner, [])
        for tensor in tree_leaves(result):
            if not isinstance(tensor, torch.Tensor) or storage_key(tensor) in inputs:
                continue
            token = object()
            events.append((token, tensor.untyped_storage().nbytes()))
            weakref.finalize(tensor, events.append, (token, 0))

    def saves(self, tensor: torch.Tensor) -> None:
        """``tensor`` is saved for backward and belongs to no value of the graph (a dropout
        mask, softmax's output inside attention): autograd frees it once the last backward
        function that unpacks it has run."""
        count, _ = self.extras.get(storage_key(tensor), (0, 0))
        self.extras[storage_key(tensor)] = count + 1, tensor.untyped_storage().nbytes()

    def unpacked(self, tensor: torch.Tensor) -> torch.Tensor:
        """Unpack hook of the saved tensors: an extra unpacked for the last time is released
        after the function running now."""
        key = storage_key(tensor)
        if self.owner is not None and key in self.extras:
            count, nbytes = self.extras[key]
            self.extras[key] = count - 1, nbytes
            if count == 1:
                self.releasing.setdefault(self.owner, []).append(nbytes)
        return tensor

    def leave(self, owner: str | None) -> None:
        """One of ``owner``'s backward functions has returned (releasing the extras it
        unpacked); the last one ends its backward."""
        if owner is not None:
            events = self.events.setdefault(owner, [])
            events.extend((RELEASED, -nbytes) for nbytes in self.releasing.pop(owner, ()))
            self.ends[owner] = len(events)
        self.owner = None

    def backward_peak(self, owner: str) -> int:
        """Peak bytes ``owner``'s backward holds above what it started with: the results
        of its calls (the gradients it returns, and the intermediate ones passed from one
        call to the next), net of the saved extras it releases on the way."""
        sizes: dict[object, int] = {}
        current = peak = 0
        for token, nbytes in self.events.get(owner, [])[: self.ends.get(owner, 0)]:
            if nbytes == 0:
                current -= sizes.pop(token, 0)
                continue
            if token is not RELEASED:
                sizes[token] = nbytes
            current += nbytes
            peak = max(peak, current)
        return peak


@dataclass(frozen=True, eq=False)
class Layout:
    """A tensor argument of a recorded call, by layout only: holding the fake tensor itself
    would keep the backward's intermediate results alive."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def layouts_of(args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor replaced by its :class:`Layout` (a tensor
    passed twice becomes one layout, so a replay passes one real tensor twice)."""
    made: dict[int, Layout] = {}

    def layout(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in made:
            made[id(value)] = Layout(tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
        return made[id(value)]

    return tree_map(layout, (tuple(args), dict(kwargs)))


Call = tuple[Any, tuple, dict]
KERNEL_EXTRA: dict[tuple, int] = {}  # call signature -> measured scratch bytes, per process


def _signature(value: Any) -> Any:
    """A hashable description of call arguments: tensors by layout, not by value."""
    if isinstance(value, Layout):
        return ("tensor", value.shape, value.stride, value.dtype, str(value.device))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _signature(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def call_key(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """What a kernel's scratch may depend on: the op, its arguments' layouts and values
    (tensor data aside) and the number of threads (oneDNN picks its algorithm by it)."""
    return (func, _signature(args), _signature(dict(kwargs)), torch.get_num_threads())


def _realize(args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """Real tensors for the recorded :class:`Layout` s (ones for floats, zeros, valid
    indices, otherwise); a layout passed twice (one fake tensor) becomes one real tensor."""
    made: dict[int, torch.Tensor] = {}

    def real(value: Any) -> Any:
        if not isinstance(value, Layout):
            return value
        if id(value) not in made:
            tensor = torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device=value.device)
            made[id(value)] = tensor.fill_(1 if tensor.is_floating_point() or tensor.is_complex() else 0)
        return made[id(value)]

    real_args, real_kwargs = tree_map(real, (tuple(args), dict(kwargs)))
    return real_args, real_kwargs


_REPLAY_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)


def _scratch_in(event: Any) -> int:
    """Peak bytes of the storages allocated under a profiler event, less those still alive
    at its end (the outputs): the scratch of the kernel it wraps."""
    from torch._C._profiler import _EventType

    allocations, stack = [], [event]
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live: dict[int, int] = {}
    current = peak = 0
    for _, pointer, size in sorted(allocations, key=lambda a: a[0]):
        if size > 0:
            live[pointer] = size
            current += size
        elif pointer in live:  # frees of storages from before the call do not count
            current -= live.pop(pointer)
        peak = max(peak, current)
    return peak - current


def _cuda_scratch(func: Any, args: tuple, kwargs: dict, device: torch.device) -> int:
    """A call's peak above the storages it returns, from the CUDA allocator's statistics."""
    from graphckpt.tools.measure import peak_memory

    outputs: list[Any] = []
    with torch.no_grad():
        func(*args, **kwargs)
        peak = peak_memory(lambda: outputs.append(func(*args, **kwargs)), device=device)
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    returned = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)}
    return max(0, peak - sum(n for pointer, n in returned.items() if pointer not in inputs))


def measure_kernel_scratch(calls: Mapping[tuple, Call]) -> None:
    """Replay each ATen call (``call_key -> (func, args, kwargs)``) on real tensors laid out
    like its fake arguments and store in ``KERNEL_EXTRA`` the bytes it allocates for a
    moment beyond the outputs it returns.

    The yardstick is :mod:`graphckpt.tools.measure`'s: on CPU the profiler's allocation events (one
    profiler session for all the calls, each call marked by a ``record_function``), on CUDA
    the allocator's peak. Each call runs once untimed first (oneDNN builds and caches its
    primitives then). A call that cannot be replayed (a kernel that rejects the stand-in
    values, an unsupported device, a profiler already running) counts 0 and is not cached.
    """
    cpu: dict[tuple, Call] = {}
    for key, (func, args, kwargs) in calls.items():
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, Layout)}
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        if device.type == "cpu":
            cpu[key] = (func, args, kwargs)
        elif device.type == "cuda":
            try:
                KERNEL_EXTRA[key] = _cuda_scratch(func, *_realize(args, kwargs), device)
            except _REPLAY_ERRORS:
                continue
    if not cpu or torch.autograd.profiler._is_profiler_enabled:
        return
    from torch.profiler import ProfilerActivity, profile, record_function

    marks: dict[str, tuple] = {}
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for index, (key, (func, args, kwargs)) in enumerate(cpu.items()):
            try:
                real_args, real_kwargs = _realize(args, kwargs)
                func(*real_args, **real_kwargs)
                with record_function(f"graphckpt.replay.{index}"):
                    result = func(*real_args, **real_kwargs)
            except _REPLAY_ERRORS:
                continue
            marks[f"graphckpt.replay.{index}"] = key
            del result, real_args, real_kwargs
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    for event in results.experimental_event_tree() if results is not None else ():
        if event.name in marks:
            KERNEL_EXTRA[marks[event.name]] = _scratch_in(event)
