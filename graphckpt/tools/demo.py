"""What ``graphckpt demo`` builds and how it reads the measurements.

The demo answers the question a user has before adopting graphckpt: against
``model.gradient_checkpointing_enable()`` (per-block checkpointing), what does it buy? It
plans one model at per-block's measured peak (same memory: compare step time) and at a few
fractions of eager's peak that the one-liner cannot offer, measures them all in
interleaved rounds beside eager and per-block, and names the best trade-off: the plan that
saves the most memory per unit of step time it adds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphckpt.tools.anchors import Skipped, Variant, block_anchor
from graphckpt.tools.bench import Modelled, Result, at_anchor_peak, eager_variant, model_costs, paired_ratio, planned_variant

DEMO_BUDGETS = (0.5, 0.3)  # fractions of eager's simulated peak, between eager and per-block's memory


@dataclass(frozen=True)
class DemoSet:
    """The demo's variants (eager first, then per-block when the model has blocks, then
    graphckpt's plans), the ones that could not be built, and the cost graph they were planned on."""

    modelled: Modelled
    variants: list[Variant]
    skipped: list[Skipped]


def demo_variants(model: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor],
                  budgets: Sequence[float] = DEMO_BUDGETS) -> DemoSet:
    """Eager, per-block checkpointing, graphckpt at per-block's measured peak and graphckpt
    at each of ``budgets``; one capture, recompute priced in measured op time."""
    modelled = model_costs(model, inputs, cost="time")
    found: list[Variant | Skipped] = [block_anchor(model, inputs)]
    if isinstance(found[0], Variant):
        found.append(at_anchor_peak(modelled, found[0], inputs, loss_fn))
    found += [planned_variant(modelled, budget=budget) for budget in budgets]
    variants = [eager_variant(model), *(v for v in found if isinstance(v, Variant))]
    return DemoSet(modelled, variants, [s for s in found if isinstance(s, Skipped)])


def memory_per_time(result: Result) -> float:
    """Share of eager's peak saved per share of eager's step added: how much memory a unit
    of slowdown buys. A plan no slower than eager that saves memory buys it for free (inf).

    >>> memory_per_time(Result("a", "graphckpt", "", 50, 1.25, peak_ratio=0.5, time_ratio=1.25))
    2.0
    """
    saved, added = 1.0 - result.peak_ratio, result.time_ratio - 1.0
    if saved <= 0:
        return 0.0
    return math.inf if added <= 0 else saved / added


def best_trade_off(results: Sequence[Result]) -> Result | None:
    """graphckpt's measured plan that buys the most memory per unit of step time
    (:func:`memory_per_time`); ``None`` when none saved memory."""
    ours = [r for r in results if r.kind == "graphckpt" and memory_per_time(r) > 0]
    return max(ours, key=lambda r: (memory_per_time(r), -r.peak_ratio), default=None)


def versus_per_block(results: Sequence[Result]) -> str | None:
    """One line: graphckpt at per-block's peak against per-block itself, both measured in the
    same rounds (median of the per-round step ratios); ``None`` without per-block."""
    theirs = next((r for r in results if r.kind == "per-block"), None)
    ours = next((r for r in results if r.kind == "graphckpt" and "per-block" in r.name), None)
    if theirs is None or ours is None:
        return None
    step = paired_ratio(ours.times, theirs.times)
    return (f"at per-block checkpointing's memory: graphckpt {ours.peak_bytes / max(theirs.peak_bytes, 1):.2f}x its "
            f"measured peak, {step:.2f}x its step time (median of {len(ours.times)} paired rounds)")


def trade_off_line(best: Result, results: Sequence[Result]) -> str:
    """One line naming the best trade-off, beside what per-block checkpointing gives."""
    line = (f"best trade-off: {best.name}: {best.peak_ratio:.2f}x eager's measured peak for "
            f"{best.time_ratio:.2f}x its step time")
    theirs = next((r for r in results if r.kind == "per-block"), None)
    if theirs is not None:
        line += f" (per-block checkpointing: {theirs.peak_ratio:.2f}x for {theirs.time_ratio:.2f}x)"
    return line
