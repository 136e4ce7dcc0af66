"""Peak activation memory yardstick: every memory claim in graphckpt is measured here.

Definition: the peak activation memory of a training step is the peak number of
bytes held by storages *created during* the step, above what existed before it.
It is measured after a warm-up step, so parameter ``.grad`` tensors already exist
and are accumulated into in place instead of being created.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  minus ``memory_allocated`` before the step.
* CPU: the profiler's memory timeline (``torch.profiler._memory_profiler``);
  peak of the running sum of CREATE minus DESTROY rows for storages created
  inside the window.

CPU caveats (checked in tests/test_measure.py): only allocations made through
c10's CPU allocator *on the calling thread* are seen (not other Python threads,
not numpy/from_numpy buffers), and the profiler adds a per-op time overhead, so
timings are taken in separate runs without it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["StepMeasurement", "measure_step", "peak_memory", "training_step"]


def _resolve_device(device: str | torch.device) -> torch.device:
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


def _timeline_peak(
    timeline: Iterable[tuple[int, Any, tuple[Any, int], int]], device: torch.device
) -> tuple[int, int]:
    """Return ``(peak, net)`` bytes over a ``MemoryProfile.timeline`` for ``device``.

    Rows are ``(time_ns, Action, (key, version), size)`` with ``size >= 0`` and
    already sorted by time. Only CREATE adds and only DESTROY of something
    created in the window subtracts: PREEXISTING rows (time -1) existed before the
    window, and INCREMENT_VERSION is an in-place write to an existing storage, not
    an allocation. Rows whose key is a bare ``Key`` (the allocation could not be
    tied to a tensor id) cannot be matched individually, so their DESTROYs are
    capped at the bytes of bare-key CREATEs still live (on CPU the allocator never
    reports frees of blocks allocated before profiling, so the cap never binds).
    """
    from torch.profiler._memory_profiler import Action, TensorKey

    created: set[Any] = set()
    untracked_live = 0
    current = peak = 0
    for _time, action, (key, _version), size in timeline:
        if key is None or key.device != device:
            continue
        if action == Action.CREATE:
            if isinstance(key, TensorKey):
                created.add(key)
            else:
                untracked_live += size
            current += size
        elif action == Action.DESTROY:
            if isinstance(key, TensorKey):
                if key not in created:
                    continue  # pre-existing storage freed inside the window
                created.discard(key)
            else:
                size = min(size, untracked_live)
                untracked_live -= size
            current -= size
        peak = max(peak, current)
    return peak, current


def _cpu_peak_and_net(fn: Callable[[], object]) -> tuple[int, int]:
    """Run ``fn()`` under the CPU memory profiler; return ``(peak, net)`` bytes."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfile

    if torch.autograd.profiler._is_profiler_enabled:
        raise RuntimeError(
            "peak_memory: a torch profiler session is already active; nested "
            "profilers corrupt each other's results. Call peak_memory outside it."
        )
    with profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=False,
    ) as prof:
        fn()
    # prof._memory_profile() insists on with_stack=True, which only feeds the
    # category heuristics and slows profiling; the timeline does not need it.
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError(
            "peak_memory: the profiler returned no results; is another profiler "
            "(e.g. kineto/nsys) interfering?"
        )
    return _timeline_peak(MemoryProfile(results).timeline, torch.device("cpu"))


def peak_memory(fn: Callable[[], object], *, device: str | torch.device = "cpu") -> int:
    """Run ``fn()`` once; return the peak bytes of storages created during it.

    Storages alive before the call are not counted, and freeing them inside the
    call does not lower the result (it is never negative). On CUDA this is
    ``max_memory_allocated - memory_allocated`` around the call (includes
    allocator rounding, typically to 512 bytes); on CPU it is computed from the
    profiler's memory timeline, which slows ``fn`` down, so do not time it here.
    """
    dev = _resolve_device(device)
    if dev.type == "cpu":
        return _cpu_peak_and_net(fn)[0]
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.max_memory_allocated(dev) - before)


def training_step(
    module: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor]
) -> Callable[[], None]:
    """Return a closure doing ``loss_fn(module(*inputs)).backward()``.

    Gradients accumulate into existing ``.grad`` (no ``zero_grad`` inside), so
    after one warm-up call the ``.grad`` storages pre-exist and later calls
    measure activations and temporaries only. ``inputs`` may hold tensors that
    do not require grad (e.g. integer tokens). The module output stays alive
    during backward, as in an ordinary training loop.
    """
    if not isinstance(inputs, tuple):
        raise TypeError(
            f"training_step: inputs must be a tuple of positional arguments for the "
            f"module, got {type(inputs).__name__}; wrap a single tensor as (x,)."
        )

    def step() -> None:
        output = module(*inputs)
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "training_step: loss_fn must return a single-element tensor, got "
                f"{type(loss).__name__} {getattr(loss, 'shape', '')}; reduce it, "
                "e.g. with .sum() or .mean()."
            )
        if not loss.requires_grad:
            raise RuntimeError(
                "training_step: the loss does not require grad, so backward() has "
                "nothing to do; check that the module has trainable parameters and "
                "that grad mode is enabled."
            )
        loss.backward()

    return step


@dataclass
class StepMeasurement:
    """Peak activation bytes of one step and the median wall time of a step."""

    peak_bytes: int
    step_seconds: float


def _infer_device(module: nn.Module, inputs: tuple) -> torch.device:
    for tensor in (*module.parameters(), *inputs):
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return torch.device("cpu")


def measure_step(
    module: nn.Module,
    inputs: tuple,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    warmup: int = 1,
    repeats: int = 3,
    device: str | torch.device | None = None,
) -> StepMeasurement:
    """Measure a training step: peak activation memory and median step time.

    Runs ``warmup`` steps (so ``.grad`` exists and lazy initialisation is done),
    one step under :func:`peak_memory`, then ``repeats`` separately timed steps
    without the profiler (``time.perf_counter``, synchronising CUDA). ``device``
    defaults to that of the first parameter or tensor input.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(
            f"measure_step: need warmup >= 0 and repeats >= 1, got warmup={warmup}, "
            f"repeats={repeats}."
        )
    dev = _resolve_device(
        device if device is not None else _infer_device(module, inputs)
    )
    step = training_step(module, inputs, loss_fn)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        step()
    sync()
    peak = peak_memory(step, device=dev)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return StepMeasurement(peak_bytes=peak, step_seconds=statistics.median(times))
