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
:mod:`graphckpt.measure` measures a training step (the yardstick the simulator is checked
against): its peak above the bytes of the outputs it returns. Replays are cached per process;
they hold real memory for one call's arguments and results at a time (at most a few of the
model's activations) and cost about two runs of each distinct backward kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map


class Recorder(TorchDispatchMode):
    """Records, for the node named ``owner`` (``None``: record nothing), the ATen calls made
    under it that may allocate: not views, and only calls that return a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.owner: str | None = None
        self.calls: dict[str, list[tuple[Any, tuple, dict]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.owner is not None and not func.is_view and \
                any(isinstance(t, torch.Tensor) for t in tree_leaves(result)):
            self.calls.setdefault(self.owner, []).append((func, args, kwargs))
        return result


Call = tuple[Any, tuple, dict]
KERNEL_EXTRA: dict[tuple, int] = {}  # call signature -> measured scratch bytes, per process


def _signature(value: Any) -> Any:
    """A hashable description of call arguments: tensors by layout, not by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device))
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
    """Real tensors laid out like the fake ones (ones for floats, zeros, valid indices,
    otherwise); a fake tensor passed twice becomes one real tensor."""
    made: dict[int, torch.Tensor] = {}

    def real(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in made:
            tensor = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype,
                                         device=value.device)
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
    from graphckpt.measure import peak_memory

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

    The yardstick is :mod:`graphckpt.measure`'s: on CPU the profiler's allocation events (one
    profiler session for all the calls, each call marked by a ``record_function``), on CUDA
    the allocator's peak. Each call runs once untimed first (oneDNN builds and caches its
    primitives then). A call that cannot be replayed (a kernel that rejects the stand-in
    values, an unsupported device, a profiler already running) counts 0 and is not cached.
    """
    cpu: dict[tuple, Call] = {}
    for key, (func, args, kwargs) in calls.items():
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
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
