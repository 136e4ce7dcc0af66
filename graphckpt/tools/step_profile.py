"""Where one training step's time goes on a GPU: kernel time against the GPU left idle.

A plan can lose to another at equal memory in two ways: it gives the GPU more work (it
recomputes costlier kernels) or it leaves the GPU waiting on the host (Python of checkpoint
calls, saved-tensor hooks, selective dispatch). :func:`profile_step` tells them apart from
profiled steps: the time kernels cover and the wall time they leave uncovered.
``scripts/step_breakdown.py`` prints it for each plan beside the anchors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from graphckpt.torch_compat import RANGE_PREFIX, quiet_profile


@dataclass(frozen=True)
class StepProfile:
    """One profiled step: ``wall_seconds`` as the caller saw it (the step waits for the GPU),
    ``kernel_seconds`` the union of the device's kernel intervals, ``kernels`` how many ran,
    ``aten_calls`` the ATen ops the host dispatched, nested ones included (each a host cost,
    recomputed ones too); ``recompute_host_seconds`` the host's time inside graphckpt's
    recomputes and remakes (the ``graphckpt ... recompute`` and ``... remake`` ranges a
    rewritten module marks in a profiler's trace), 0 for a model graphckpt did not rewrite."""

    wall_seconds: float
    kernel_seconds: float
    kernels: int
    aten_calls: int
    recompute_host_seconds: float = 0.0

    @property
    def idle_seconds(self) -> float:
        """Wall time with no kernel running: the GPU waiting on the host (0 on a CPU)."""
        return max(self.wall_seconds - self.kernel_seconds, 0.0) if self.kernels else 0.0


def covered_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: kernels of several streams that
    overlap count once.

    >>> covered_seconds([(0, 2), (1, 3), (5, 6)])
    4
    """
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach[1]:
            total += reach[1] - reach[0] if reach else 0
            reach = [start, end]
        else:
            reach[1] = max(reach[1], end)
    return total + (reach[1] - reach[0] if reach else 0)


def profile_step(step: Callable[[], object], device: torch.device, repeats: int = 3) -> StepProfile:
    """Profile ``repeats`` steps (after a warm-up step) under torch's profiler, kernels recorded on
    a CUDA ``device``, and return the one of median wall time: one step can catch a collection or
    a page-in that is no part of the plan."""
    step()
    profiles = sorted((_profiled(step, device) for _ in range(repeats)), key=lambda p: p.wall_seconds)
    return profiles[len(profiles) // 2]


def _profiled(step: Callable[[], object], device: torch.device) -> StepProfile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with quiet_profile(activities=activities) as profiler:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    events = profiler.events()
    on_device = [(e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    aten = sum(1 for e in events if e.name.startswith("aten::") and e.device_type == torch.autograd.DeviceType.CPU)
    recomputing = [(e.time_range.start, e.time_range.end) for e in events if _is_recompute_range(e.name)]
    return StepProfile(wall, covered_seconds(on_device) * 1e-6, len(on_device), aten,
                       covered_seconds(recomputing) * 1e-6)


def _is_recompute_range(name: str) -> bool:
    """A range graphckpt's runtime marks around a recompute or a remake (nested ones fall
    inside their parent's, so a union counts them once)."""
    return name.startswith(RANGE_PREFIX) and (name.endswith(" recompute") or " remake" in name)
