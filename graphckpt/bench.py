"""Measured peak memory and step time of eager, graphckpt's plans and two anchors.

The anchors are what a user would otherwise reach for:

* ``torch.utils.checkpoint.checkpoint_sequential`` with √n segments, where the model is an
  ``nn.Sequential`` chain or a thin wrapper around one (the zoo MLP);
* ``torch.compile`` (backend ``aot_eager``) with ``torch._functorch.config.activation_memory_budget``:
  AOT autograd's min-cut partitioner recomputing to fit a fraction of its own estimate.

Every variant shares the model's parameters. Each is warmed up (compiled, ``.grad``
allocated), its peak is measured once under the profiler (:func:`graphckpt.measure.peak_memory`),
and step times come from rounds that time one step of every variant in turn, so load on a
shared machine hits all of them alike; the median of the rounds is reported.

``graphckpt bench`` and ``graphckpt pareto`` print and plot what this module returns;
``scripts/bench.py`` is meant to grow on top of it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import graphckpt
from graphckpt.console import quiet_profiler
from graphckpt.measure import peak_memory, training_step
from passes.budget import BudgetError
from passes.plan import Plan

DEFAULT_BUDGETS = (1.0, 0.75, 0.5, 0.35, 0.25, 0.15)
Progress = Callable[[str], None]


@dataclass
class Variant:
    """One way of running a training step: a callable module and what produced it."""

    name: str
    module: Callable[..., Any]
    kind: str  # "eager" | "graphckpt" | "checkpoint_sequential" | "torch.compile"
    setting: str = ""
    plan: Plan | None = None
    budget: float | None = None


@dataclass
class Skipped:
    """A variant that could not be built, and why (shown as a note, never an error)."""

    name: str
    reason: str


@dataclass
class Result:
    """What was measured for one variant; ratios are against eager in the same run."""

    name: str
    kind: str
    setting: str
    peak_bytes: int
    step_seconds: float
    peak_ratio: float = 1.0
    time_ratio: float = 1.0
    simulated_peak_bytes: int | None = None
    recompute_fraction: float | None = None
    budget: float | None = None
    times: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON (without the individual step times)."""
        return {k: v for k, v in vars(self).items() if k != "times"}


# ---------------------------------------------------------------- variants


def eager_variant(model: nn.Module) -> Variant:
    """The model as it is: the baseline every ratio divides by."""
    return Variant("eager", model, "eager")


def strategy_variant(model: nn.Module, inputs: tuple, strategy: str) -> Variant:
    """``graphckpt.rewrite`` with one strategy."""
    rewritten = graphckpt.rewrite(model, inputs, strategy=strategy)
    plan = rewritten.meta["graphckpt_plan"]
    setting = plan.strategy if plan.strategy == strategy else f"-> {plan.strategy}"
    return Variant(f"graphckpt {strategy}", rewritten, "graphckpt", setting, plan)


def budget_variant(model: nn.Module, inputs: tuple, budget: float, cost: str = "flops") -> Variant | Skipped:
    """``graphckpt.rewrite`` fitting ``budget`` (fraction of eager's simulated peak), recompute
    counted in ``cost`` ("flops" or measured "time")."""
    try:
        rewritten = graphckpt.rewrite(model, inputs, budget=budget, cost=cost)
    except BudgetError as error:
        return Skipped(f"graphckpt budget {budget:g}", "infeasible: " + str(error).split(", kept values")[0])
    plan = rewritten.meta["graphckpt_plan"]
    return Variant(f"graphckpt {budget:g}", rewritten, "graphckpt", plan.strategy, plan, budget)


def find_sequential(model: nn.Module) -> nn.Sequential | None:
    """The ``nn.Sequential`` the model is, or its only child when that is one; else None."""
    if isinstance(model, nn.Sequential):
        return model
    kids = list(model.children())
    if len(kids) == 1 and isinstance(kids[0], nn.Sequential):
        return kids[0]
    return None


def _same_forward(model: nn.Module, chain: nn.Sequential, inputs: tuple) -> bool:
    """Whether ``model(*inputs)`` is ``chain(*inputs)`` (same RNG seed, no grad)."""
    if chain is model:
        return True
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        expected = model(*inputs)
        torch.manual_seed(0)
        actual = chain(*inputs)
    return (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)
            and expected.shape == actual.shape and torch.allclose(expected, actual))


class SequentialCheckpoint(nn.Module):
    """``checkpoint_sequential(chain, segments, x)`` as a module (non-reentrant)."""

    def __init__(self, chain: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.chain = chain
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


def sequential_anchor(model: nn.Module, inputs: tuple, segments: int | None = None) -> Variant | Skipped:
    """torch's ``checkpoint_sequential`` with ``segments`` (default √n) segments, where the
    model is a plain chain; :class:`Skipped` saying why not otherwise."""
    name = "checkpoint_sequential"
    chain = find_sequential(model)
    if chain is None:
        return Skipped(name, "the model is not an nn.Sequential chain (nor a wrapper of one)")
    if len(inputs) != 1:
        return Skipped(name, "checkpoint_sequential takes a single input")
    if not _same_forward(model, chain, inputs):
        return Skipped(name, "the model's forward does more than run its Sequential")
    count = segments or max(1, round(math.sqrt(len(chain))))
    return Variant(f"{name} {count}", SequentialCheckpoint(chain, count), name, f"{count} segments")


_fresh_ids = itertools.count()


def _fresh_forward(model: nn.Module) -> Callable[..., Any]:
    """``model(*args)`` in a function with a code object of its own, so dynamo caches each
    compiled anchor separately (its compile-time budget is not part of dynamo's guards)."""
    def forward(*args: Any) -> Any:
        return model(*args)

    forward.__code__ = forward.__code__.replace(co_name=f"graphckpt_anchor_{next(_fresh_ids)}")
    return forward


def compile_anchor(model: nn.Module, inputs: tuple, budget: float,
                   loss_fn: Callable[[Any], torch.Tensor]) -> Variant | Skipped:
    """``torch.compile(backend="aot_eager")`` under ``activation_memory_budget=budget``,
    compiled (forward and backward) right here, while the budget is in force."""
    name = f"torch.compile {budget:g}"
    try:
        from torch._functorch import config as functorch_config

        compiled = torch.compile(_fresh_forward(model), backend="aot_eager")
        with functorch_config.patch(activation_memory_budget=budget):
            training_step(compiled, inputs, loss_fn)()
    except Exception as error:  # any compile failure: note it and measure the rest
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Skipped(name, f"torch.compile failed: {type(error).__name__}: {first[:160]}")
    return Variant(name, compiled, "torch.compile", f"budget {budget:g}", budget=budget)


# ---------------------------------------------------------------- measuring


def work_units(variants: Sequence[Variant], steps: int) -> int:
    """How many progress ticks :func:`measure_variants` makes: warm-up, peak, each step."""
    return len(variants) * (2 + steps)


def _tick(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def measure_variants(variants: Sequence[Variant], inputs: tuple, loss_fn: Callable[[Any], torch.Tensor],
                     *, steps: int = 5, progress: Progress | None = None) -> list[Result]:
    """Warm up every variant, measure its peak once, then time ``steps`` interleaved rounds.

    The first variant is the baseline of the ratios (put eager first).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    runs = [training_step(v.module, inputs, loss_fn) for v in variants]
    for variant, run in zip(variants, runs, strict=True):
        run()
        _tick(progress, f"warm-up {variant.name}")
    peaks = []
    for variant, run in zip(variants, runs, strict=True):
        with quiet_profiler():
            peaks.append(peak_memory(run))
        _tick(progress, f"peak {variant.name}")
    times: list[list[float]] = [[] for _ in variants]
    for round_index in range(steps):
        for index, run in enumerate(runs):
            start = time.perf_counter()
            run()
            times[index].append(time.perf_counter() - start)
            _tick(progress, f"round {round_index + 1}/{steps}")
    return _results(variants, peaks, times)


def _results(variants: Sequence[Variant], peaks: Sequence[int], times: Sequence[list[float]]) -> list[Result]:
    base_peak, base_time = peaks[0], statistics.median(times[0])
    results = []
    for variant, peak, seconds in zip(variants, peaks, times, strict=True):
        median = statistics.median(seconds)
        plan = variant.plan
        results.append(Result(
            variant.name, variant.kind, variant.setting, peak, median,
            peak_ratio=peak / base_peak if base_peak else 0.0,
            time_ratio=median / base_time if base_time else 0.0,
            simulated_peak_bytes=plan.peak_bytes if plan else None,
            recompute_fraction=plan.recompute_flops / max(plan.forward_flops, 1) if plan else None,
            budget=variant.budget, times=seconds))
    return results


# ---------------------------------------------------------------- what bench and pareto run


def bench_variants(model: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor], *,
                   strategies: Iterable[str], compile_budget: float | None = 0.5,
                   ) -> tuple[list[Variant], list[Skipped]]:
    """Eager, one rewrite per strategy, checkpoint_sequential (√n) and torch.compile at
    ``compile_budget`` (None leaves it out)."""
    variants = [eager_variant(model)]
    skipped: list[Skipped] = []
    for strategy in strategies:
        try:
            variants.append(strategy_variant(model, inputs, strategy))
        except Exception as error:  # e.g. a strategy that needs something this model lacks
            skipped.append(Skipped(f"graphckpt {strategy}", f"{type(error).__name__}: {error}"))
    anchors = [sequential_anchor(model, inputs)]
    if compile_budget is not None:
        anchors.append(compile_anchor(model, inputs, compile_budget, loss_fn))
    for anchor in anchors:
        (variants if isinstance(anchor, Variant) else skipped).append(anchor)  # type: ignore[arg-type]
    return variants, skipped


def _compile_sweep(model: nn.Module, inputs: tuple, budgets: Sequence[float],
                   loss_fn: Callable[[Any], torch.Tensor]) -> list[Variant | Skipped]:
    """torch.compile anchors at each budget; after one fails to compile the rest are not tried."""
    found: list[Variant | Skipped] = []
    for budget in budgets:
        if found and isinstance(found[-1], Skipped):
            found.append(Skipped(f"torch.compile {budget:g}", "not tried: torch.compile failed above"))
        else:
            found.append(compile_anchor(model, inputs, budget, loss_fn))
    return found


def pareto_variants(model: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor], *,
                    budgets: Sequence[float] = DEFAULT_BUDGETS, with_compile: bool = True,
                    ) -> tuple[list[Variant], list[Skipped]]:
    """Eager, graphckpt at each budget, torch.compile at each budget and checkpoint_sequential
    at a few segment counts: the points of a memory / time trade-off plot."""
    variants = [eager_variant(model)]
    skipped: list[Skipped] = []
    found: list[Variant | Skipped] = [budget_variant(model, inputs, b) for b in budgets]
    if with_compile:
        found += _compile_sweep(model, inputs, budgets, loss_fn)
    chain = find_sequential(model)
    counts = sorted({2, round(math.sqrt(len(chain))), len(chain) // 4} - {0, 1}) if chain is not None else [None]
    found += [sequential_anchor(model, inputs, count) for count in counts]
    for item in found:
        (variants if isinstance(item, Variant) else skipped).append(item)  # type: ignore[arg-type]
    return variants, skipped
