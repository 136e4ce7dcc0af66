"""Peak activation memory of a training step: the yardstick every memory claim in graphckpt is measured with.

Definition: the peak activation memory of a training step is the peak number of
bytes held by storages *created during* the step, above what existed before it.
It is measured after a warm-up step, so parameter ``.grad`` tensors already exist
and are accumulated into in place instead of being created.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  minus ``memory_allocated`` before the step.
* CPU: the profiler's memory timeline (``MemoryProfile.timeline``, read through
  :mod:`graphckpt.torch_compat`); peak of the running sum of CREATE minus DESTROY
  rows for storages created inside the window.

The counting itself (:func:`graphckpt.scratch.peak_memory`) lives in the pipeline, which
measures backward kernels' scratch memory with it; this module measures training steps.

CPU caveats (checked in tests/test_measure.py): only allocations made through
c10's CPU allocator *on the calling thread* are seen (not other Python threads,
not numpy/from_numpy buffers), and the profiler adds a per-op time overhead, so
timings are taken in separate runs without it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphckpt.scratch import peak_memory, resolve_device
from graphckpt.timing import model_device, synchronize

__all__ = ["StepMeasurement", "infer_device", "measure_step", "on_device", "peak_memory", "synchronize", "training_step"]


def training_step(
    module: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor]
) -> Callable[[], None]:
    """Return a closure doing ``loss_fn(module(*inputs)).backward()``, waiting for the GPU.

    Gradients accumulate into existing ``.grad`` (no ``zero_grad`` inside), so
    after one warm-up call the ``.grad`` storages pre-exist and later calls
    measure activations and temporaries only. ``inputs`` may hold tensors that
    do not require grad (e.g. integer tokens). The module output stays alive
    during backward, as in an ordinary training loop. On CUDA the closure returns
    once the GPU has finished the step, so whoever times it times the kernels.
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
        synchronize(device)

    device = infer_device(module, inputs)
    return step


def on_device(value: Any, device: str | torch.device) -> Any:
    """``value`` with every tensor in it (through tuples, lists and dicts) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(on_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: on_device(item, device) for key, item in value.items()}
    return value


@dataclass
class StepMeasurement:
    """Peak activation bytes of one step and the median wall time of a step."""

    peak_bytes: int
    step_seconds: float


def infer_device(module: Callable[..., Any], inputs: tuple) -> torch.device:
    """The device a step of ``module`` on ``inputs`` runs on (``module`` may be a
    ``functools.partial`` of a module): :func:`graphckpt.timing.model_device`.

    >>> infer_device(nn.Linear(2, 2), (torch.zeros(2),))
    device(type='cpu')
    """
    owner = getattr(module, "func", module)
    return model_device(owner if isinstance(owner, nn.Module) else None, inputs)


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
    dev = resolve_device(
        device if device is not None else infer_device(module, inputs)
    )
    step = training_step(module, inputs, loss_fn)

    for _ in range(warmup):
        step()
    peak = peak_memory(step, device=dev)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return StepMeasurement(peak_bytes=peak, step_seconds=statistics.median(times))
