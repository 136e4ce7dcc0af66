"""Scratch memory of backward kernels: what ``backward_extra_bytes`` is made of.

The one thing fake tensors cannot show is memory a kernel allocates *inside* itself and frees
before it returns. Backward kernels do this a lot on CPU: ``convolution_backward`` (oneDNN)
reorders grad_output and the input into blocked layouts for the weight gradient and builds
grad_input in a blocked buffer before copying it out (``X + Y`` more bytes than its gradients,
``2 X`` for strided convolutions, channel counts rounded up to the block), and
``native_batch_norm_backward`` fills an input-sized scratch buffer. So, for
``backward_extra_bytes``, the whole backward is run once on fake tensors under a dispatch
mode that records the ATen calls each node's autograd functions make
(:class:`graphckpt.backward_record.Recorder`), and each distinct
call of a node that ran more than views and pointwise ops (op, shapes, strides,
dtypes, arguments) is then replayed once on real tensors and measured with the yardstick
the simulator is checked against (:func:`peak_memory`, defined here so the pipeline and
:mod:`graphckpt.tools.measure` count allocations one way): its peak above the bytes of the
outputs it returns. Replays are cached per process; they hold real memory for one call's
arguments and results at a time (at most a few of the model's activations) and cost about
two runs of each distinct backward kernel. Forward calls are replayed the same way where
they allocate inside themselves (:func:`graphckpt.op_kinds.replayed_for_scratch`), and a
whole attention where a dispatch mode would change what it runs
(:func:`plain_forward_temporaries`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from graphckpt.torch_compat import (
    allocated_bytes,
    allocations_under,
    argument_names,
    memory_timeline_allocations,
    profiled_event_tree,
    profiler_enabled,
    quiet_profile,
    tree_leaves,
    tree_map,
)


@dataclass(frozen=True, eq=False)
class Layout:
    """A tensor argument of a recorded call, by layout only: holding the fake tensor itself
    would keep the backward's intermediate results alive."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    def real(self) -> torch.Tensor:
        """A real tensor of this layout, for measuring or costing (never for results): ones
        for floating and complex dtypes, zeros otherwise (valid indices, masks). One that
        requires a gradient is a view of a leaf, as a model's activations are no leaves:
        autocast caches its casts of leaves (a float32 attention mask's bf16 copy, 135 KB on
        BEiT, made once and never counted again)."""
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        tensor.fill_(1 if tensor.is_floating_point() or tensor.is_complex() else 0)
        return tensor.requires_grad_().view_as(tensor) if self.requires_grad else tensor


def layouts_of(args: tuple, kwargs: Mapping[str, Any], grad: bool = False) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor replaced by its :class:`Layout` (a tensor
    passed twice becomes one layout, so a replay passes one real tensor twice); with
    ``grad``, whether each tensor requires a gradient."""
    made: dict[int, Layout] = {}

    def layout(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in made:
            made[id(value)] = Layout(tuple(value.shape), tuple(value.stride()), value.dtype, value.device,
                                     grad and value.requires_grad)
        return made[id(value)]

    return tree_map(layout, (tuple(args), dict(kwargs)))


Call = tuple[Any, tuple, dict]
KERNEL_EXTRA: dict[tuple, int] = {}  # call signature -> measured scratch bytes, per process


def _signature(value: Any) -> Any:
    """A hashable description of call arguments: tensors by layout, not by value."""
    if isinstance(value, Layout):
        return ("tensor", value.shape, value.stride, value.dtype, str(value.device), value.requires_grad)
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
            made[id(value)] = value.real()
        return made[id(value)]

    real_args, real_kwargs = tree_map(real, (tuple(args), dict(kwargs)))
    return real_args, real_kwargs


# ---------------------------------------------------------------- the yardstick


def allocation_peak(events: Iterable[tuple[Hashable | None, int]]) -> tuple[int, int]:
    """``(peak, net)`` bytes of the storages allocated during a window, from its allocation
    events in time order: ``(key, +bytes)`` allocates, ``(key, -bytes)`` frees.

    Only what is allocated inside the window counts: freeing a storage that existed before
    it lowers nothing. A ``None`` key is an allocation that cannot be matched to its free;
    those are pooled, and their frees capped at the pooled bytes still live.
    """
    live: dict[Hashable, int] = {}
    untracked = current = peak = 0
    for key, size in events:
        if size > 0:
            if key is None:
                untracked += size
            else:
                live[key] = size
            current += size
        elif key is None:
            freed = min(-size, untracked)
            untracked -= freed
            current -= freed
        elif key in live:
            current -= live.pop(key)
        peak = max(peak, current)
    return peak, current


def resolve_device(device: str | torch.device) -> torch.device:
    """The device :func:`peak_memory` measures on (a CUDA device with its index); an error
    saying what to do for one it cannot measure."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"peak_memory: device {dev} requested but CUDA is not available; "
                "measure on device='cpu' or run on a machine with a CUDA build of torch."
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(
            f"peak_memory: unsupported device {dev}; only 'cpu' (profiler timeline) "
            "and 'cuda' (allocator statistics) can be measured."
        )
    return dev


def cpu_peak_and_net(fn: Callable[[], object]) -> tuple[int, int]:
    """Run ``fn()`` under the CPU memory profiler; return ``(peak, net)`` bytes of the
    storages it creates (:func:`allocation_peak` over the profiler's memory timeline)."""
    from torch.profiler import ProfilerActivity

    if profiler_enabled():
        raise RuntimeError(
            "peak_memory: a torch profiler session is already active; nested "
            "profilers corrupt each other's results. Call peak_memory outside it."
        )
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                       with_stack=False) as prof:
        fn()
    try:
        events = memory_timeline_allocations(prof, torch.device("cpu"))
    except RuntimeError as error:
        raise RuntimeError(f"peak_memory: {error}") from None
    return allocation_peak(events)


def peak_memory(fn: Callable[[], object], *, device: str | torch.device = "cpu") -> int:
    """Run ``fn()`` once; return the peak bytes of storages created during it: the yardstick
    of every memory claim (:mod:`graphckpt.tools.measure` says how it is defined and checked).

    Storages alive before the call are not counted, and freeing them inside the
    call does not lower the result (it is never negative). On CUDA this is
    ``max_memory_allocated - memory_allocated`` around the call (includes
    allocator rounding, typically to 512 bytes); on CPU it is computed from the
    profiler's memory timeline, which slows ``fn`` down, so do not time it here.
    """
    return peak_and_net(fn, device=device)[0]


def peak_and_net(fn: Callable[[], object], *, device: str | torch.device = "cpu") -> tuple[int, int]:
    """``(peak, net)`` bytes of ``fn()``, run once: :func:`peak_memory`'s peak, and the bytes
    of the storages it made and left alive."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        return cpu_peak_and_net(fn)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.max_memory_allocated(dev) - before), torch.cuda.memory_allocated(dev) - before


# ---------------------------------------------------------------- replaying kernels


_REPLAY_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)


def _replay_device(args: tuple, kwargs: Mapping[str, Any]) -> torch.device:
    """Where a replay of a call on these layouts runs and is measured: a CUDA device among
    them, else the CPU."""
    devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, Layout)}
    return next((d for d in devices if d.type == "cuda"), torch.device("cpu"))


def _scratch_in(event: Any) -> int:
    """Peak bytes of the storages allocated under a profiler event, less those still alive
    at its end (the outputs): the scratch of the kernel it wraps."""
    peak, net = allocation_peak((pointer, size) for _, pointer, size in allocations_under(event))
    return peak - net


RNG_STATE_ARGUMENTS = ("philox_seed", "philox_offset")


def rng_state_on_host(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with the random-number state a fused attention backward reads
    (philox seed and offset) laid out on the host, where the kernel reads it outside CUDA
    graph capture: a stand-in on the GPU is read through a device pointer and crashes the
    process (T5's attention backward did)."""
    names = argument_names(func)

    def on_host(name: str, value: Any) -> Any:
        if name in RNG_STATE_ARGUMENTS and isinstance(value, Layout):
            return replace(value, device=torch.device("cpu"))
        return value

    named = tuple(on_host(name, value) for name, value in zip(names, args, strict=False))
    return (named + tuple(args[len(named):]),
            {name: on_host(name, value) for name, value in kwargs.items()})


def _cuda_scratch(func: Any, args: tuple, kwargs: dict, device: torch.device) -> int:
    """A call's peak above the storages it returns, from the CUDA allocator's statistics
    (which count 512-byte blocks: so are the returned storages, or a call returning 64 bytes
    would show 448 bytes of scratch)."""
    outputs: list[Any] = []
    with torch.no_grad():
        func(*args, **kwargs)
        peak = peak_memory(lambda: outputs.append(func(*args, **kwargs)), device=device)
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    returned = {t.untyped_storage().data_ptr(): allocated_bytes(t)
                for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)}
    return max(0, peak - sum(n for pointer, n in returned.items() if pointer not in inputs))


def scratch_by_call(calls_by_node: Mapping[str, Sequence[Call]]) -> dict[str, list[int]]:
    """The scratch each node's ATen calls allocate inside their kernels, call by call, in
    the order given: calls measured before in this process are looked up in
    ``KERNEL_EXTRA``, the others replayed once (:func:`measure_kernel_scratch`); a call that
    cannot be replayed counts 0.

    >>> scratch_by_call({})
    {}
    """
    keys = {name: [call_key(*call) for call in calls] for name, calls in calls_by_node.items()}
    measure_kernel_scratch({key: call for name, calls in calls_by_node.items()
                            for key, call in zip(keys[name], calls, strict=True) if key not in KERNEL_EXTRA})
    return {name: [KERNEL_EXTRA.get(key, 0) for key in node_keys] for name, node_keys in keys.items()}


OPAQUE_STATE_KERNELS = frozenset({"mkldnn_rnn_layer_backward", "_cudnn_rnn_backward", "miopen_rnn_backward"})
"""Backward kernels of recurrent layers that read a workspace their forward kernel wrote
(oneDNN's, cuDNN's, MIOpen's): on stand-in values they read it as pointers and sizes, and an
``nn.LSTM``'s replay crashed the process (a segmentation fault). Never replayed: 0 bytes."""


def measure_kernel_scratch(calls: Mapping[tuple, Call]) -> None:
    """Replay each ATen call (``call_key -> (func, args, kwargs)``) on real tensors laid out
    like its fake arguments and store in ``KERNEL_EXTRA`` the bytes it allocates for a
    moment beyond the outputs it returns.

    The yardstick is :func:`peak_memory`'s: on CPU the profiler's allocation events (one
    profiler session for all the calls, each call marked by a ``record_function``), on CUDA
    the allocator's peak. Each call runs once untimed first (oneDNN builds and caches its
    primitives then). A call that cannot be replayed (a kernel that rejects the stand-in
    values, an unsupported device, a profiler already running, one of :data:`OPAQUE_STATE_KERNELS`)
    counts 0 and is not cached.
    """
    cpu: dict[tuple, Call] = {}
    for key, (func, args, kwargs) in calls.items():
        if func.overloadpacket.__name__ in OPAQUE_STATE_KERNELS:
            continue
        device = _replay_device(args, kwargs)
        if device.type == "cpu":
            cpu[key] = (func, args, kwargs)
        elif device.type == "cuda":
            try:
                KERNEL_EXTRA[key] = _cuda_scratch(func, *_realize(*rng_state_on_host(func, args, kwargs)), device)
            except _REPLAY_ERRORS:
                continue
    if not cpu or profiler_enabled():
        return
    from torch.profiler import ProfilerActivity, record_function

    marks: dict[str, tuple] = {}
    with torch.no_grad(), quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
    for event in profiled_event_tree(prof):
        if event.name in marks:
            KERNEL_EXTRA[marks[event.name]] = _scratch_in(event)


PLAIN_TEMPORARIES: dict[tuple, int] = {}  # call signature and autocast state -> measured bytes, per process


def plain_forward_temporaries(target: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The temporaries of one call of ``target`` (a node's whole op) run for real, outside any
    dispatch mode, on tensors laid out like ``args`` and ``kwargs`` (layouts, with their
    ``requires_grad``), under the autocast state in force: its peak above what it leaves alive
    (its result, and what autograd saved for its backward). A composite op may branch on a
    dispatch mode being active, and the profile runs every node under one: CPU's math
    attention adds its mask out of place there and in place in plain code, a score matrix
    apart (BEiT under bf16: eager simulated 20% over its measured peak). ``None`` where the
    call cannot be replayed. Cached per process."""
    key = (target, _signature(tuple(args)), _signature(dict(kwargs)), torch.get_num_threads(),
           *((torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")))
    if key not in PLAIN_TEMPORARIES:
        device = _replay_device(args, kwargs)
        outputs: list[Any] = []
        try:
            real_args, real_kwargs = _realize(args, kwargs)
            with torch.enable_grad():
                target(*real_args, **real_kwargs)  # once untimed, as measure_kernel_scratch does
                peak, net = peak_and_net(lambda: outputs.append(target(*real_args, **real_kwargs)), device=device)
        except _REPLAY_ERRORS:
            return None
        PLAIN_TEMPORARIES[key] = max(peak - net, 0)
    return PLAIN_TEMPORARIES[key]
