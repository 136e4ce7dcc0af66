"""Measured peak memory and step time of eager, graphckpt's plans and the anchors.

The anchors (:mod:`graphckpt.tools.anchors`) are what a user would otherwise reach for:
``checkpoint_sequential``, per-block checkpointing as Hugging Face does it, and
``torch.compile`` with ``activation_memory_budget``.

Every variant but the per-block anchor (a copy) shares the model's parameters. Each is warmed up (compiled, ``.grad``
allocated), its peak is measured once under the profiler (:func:`graphckpt.tools.measure.peak_memory`),
and step times come from rounds that time one step of every variant in turn, so load on a
shared machine hits all of them alike; the median of the rounds is reported.

``graphckpt bench``, ``graphckpt pareto`` and ``scripts/bench.py`` print and plot what this
module returns.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import nn

from graphckpt.api import Analysis, cost_model, generate_rewrite, plan_cost_graph
from graphckpt.capture import Captured
from graphckpt.tools.anchors import Skipped, Variant, block_anchor, compile_anchor, find_sequential, sequential_anchor
from graphckpt.tools.console import quiet_profiler
from graphckpt.tools.measure import infer_device, peak_memory, training_step
from graphckpt.tools.pairs import minor_faults
from graphckpt.tools.step_profile import profile_step
from passes.budget import BudgetError
from passes.plan import Plan

DEFAULT_BUDGETS = (1.0, 0.75, 0.5, 0.35, 0.25, 0.15)
ReportProgress = Callable[[str], None]  # told a message as each measurement step ends


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
    plan_seconds: float | None = None
    faults_per_step: float = 0.0  # minor page faults per timed step
    extra_seconds: float = 0.0  # median over rounds of this step minus eager's
    predicted_extra_seconds: float | None = None  # the plan's recompute and overhead, in measured op time
    recompute_seconds: float | None = None  # host time inside its recomputes in a profiled step (a CPU's)
    default_time_ratio: float | None = None  # time_ratio measured again with glibc's default allocator
    caveat: str = ""  # why its step is not the model's step, if it is not (Variant.caveat)
    times: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON (without the individual step times)."""
        return {k: v for k, v in vars(self).items() if k != "times"}


# ---------------------------------------------------------------- graphckpt's variants


@dataclass(frozen=True)
class Modelled:
    """A model's capture and cost graph, made once and planned many times; ``seconds`` is
    what capture and costing took."""

    model: nn.Module
    captured: Captured
    cost_graph: nx.DiGraph
    seconds: float


def model_costs(model: nn.Module, inputs: tuple, cost: str = "flops") -> Modelled:
    """Capture and cost ``model`` once (timed), for :func:`planned_variant` to plan from."""
    start = time.perf_counter()
    captured, cost_graph = cost_model(model, inputs, cost=cost)
    return Modelled(model, captured, cost_graph, time.perf_counter() - start)


def planned_variant(modelled: Modelled, strategy: str = "auto", budget: float | int | None = None,
                    name: str | None = None) -> Variant | Skipped:
    """graphckpt's rewrite with ``strategy``, or fitting ``budget`` (a fraction of eager's
    simulated peak, or bytes); :class:`Skipped` when the budget cannot be met. Its
    ``plan_seconds`` are capture, costs, plan and codegen, as ``graphckpt.rewrite`` would take."""
    name = name or (f"graphckpt {budget:g}" if budget is not None else f"graphckpt {strategy}")
    start = time.perf_counter()
    try:
        plan = plan_cost_graph(modelled.cost_graph, strategy, budget=budget)
    except BudgetError as error:
        return Skipped(name.replace("graphckpt ", "graphckpt budget ", 1) if budget is not None else name,
                       f"infeasible: {error.reason}")
    module = generate_rewrite(modelled.model, Analysis(modelled.captured, modelled.cost_graph, plan))
    seconds = modelled.seconds + time.perf_counter() - start
    setting = plan.strategy if budget is not None or plan.strategy == strategy else f"-> {plan.strategy}"
    fraction = budget / plan.eager_peak_bytes if isinstance(budget, int) else budget
    return Variant(name, module, "graphckpt", setting, plan, fraction, seconds,
                   predicted_extra_seconds=predicted_extra_seconds(modelled.cost_graph, plan))


def predicted_extra_seconds(cost_graph: nx.DiGraph, plan: Plan) -> float | None:
    """What the cost model says ``plan`` adds to a step (the ops it reruns and the checkpoint
    calls' own cost), when the graph was costed in measured time; ``None`` for FLOPs."""
    if cost_graph.graph.get("cost_unit") != "ns":
        return None
    return (plan.recompute_flops + plan.overhead) * 1e-9


def eager_variant(model: nn.Module) -> Variant:
    """The model as it is: the baseline every ratio divides by."""
    return Variant("eager", model, "eager")


def budget_variant(model: nn.Module, inputs: tuple, budget: float, cost: str = "flops") -> Variant | Skipped:
    """``graphckpt.rewrite`` fitting ``budget`` (fraction of eager's simulated peak), recompute
    counted in ``cost`` ("flops" or measured "time")."""
    return planned_variant(model_costs(model, inputs, cost), budget=budget)


# ---------------------------------------------------------------- measuring


def work_units(variants: Sequence[Variant], steps: int) -> int:
    """How many progress ticks :func:`measure_variants` makes: warm-up, peak, each step."""
    return len(variants) * (2 + steps)


def _tick(progress: ReportProgress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def measure_variants(variants: Sequence[Variant], inputs: tuple, loss_fn: Callable[[Any], torch.Tensor],
                     *, steps: int = 5, progress: ReportProgress | None = None) -> list[Result]:
    """Warm up every variant, measure its peak once (and on a CPU the time inside a graphckpt
    plan's recomputes: :func:`recompute_seconds`), then time ``steps`` interleaved rounds.

    The first variant is the baseline of the ratios (put eager first). Each round starts at
    the next variant, so none always runs after the same one (a step after a large one
    finds a different heap); a time ratio is the median over rounds of the variant's step
    over the baseline's step *in the same round*, which cancels the slow drift of a shared
    machine's speed.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    runs = [training_step(v.module, inputs, loss_fn) for v in variants]
    for variant, run in zip(variants, runs, strict=True):
        run()
        _tick(progress, f"warm-up {variant.name}")
    peaks, recomputes = [], []
    for variant, run in zip(variants, runs, strict=True):
        device = infer_device(variant.module, inputs)
        with quiet_profiler():
            peaks.append(peak_memory(run, device=device))
            recomputes.append(recompute_seconds(variant, run, device))
        _tick(progress, f"peak {variant.name}")
    times: list[list[float]] = [[] for _ in variants]
    faults = [0] * len(variants)
    for round_index in range(steps):
        for offset in range(len(runs)):
            index = (round_index + offset) % len(runs)
            before, start = minor_faults(), time.perf_counter()
            runs[index]()
            times[index].append(time.perf_counter() - start)
            faults[index] += minor_faults() - before
            _tick(progress, f"round {round_index + 1}/{steps}")
    return _results(variants, peaks, times, [f / steps for f in faults], recomputes)


def recompute_seconds(variant: Variant, run: Callable[[], None], device: torch.device) -> float | None:
    """The host's time inside ``variant``'s recomputes in one profiled step: on a CPU, what
    rerunning them took, for the cost model's prediction to be checked against without the
    noise of whole steps; ``None`` on a GPU (there the host only launches their kernels) or for
    a variant graphckpt did not rewrite."""
    if variant.kind != "graphckpt" or device.type != "cpu":
        return None
    return profile_step(run, device, repeats=1).recompute_host_seconds


def paired_ratio(times: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over rounds of ``times[r] / baseline[r]``: steps compared within a round.

    >>> paired_ratio([2.0, 3.0, 2.2], [1.0, 2.0, 1.0])
    2.0
    """
    return statistics.median(t / b for t, b in zip(times, baseline, strict=True)) if all(baseline) else 0.0


def _results(variants: Sequence[Variant], peaks: Sequence[int], times: Sequence[list[float]],
             faults: Sequence[float], recomputes: Sequence[float | None]) -> list[Result]:
    base_peak = peaks[0]
    results = []
    for variant, peak, seconds, fault_count, recompute in zip(variants, peaks, times, faults, recomputes, strict=True):
        median = statistics.median(seconds)
        plan = variant.plan
        results.append(Result(
            variant.name, variant.kind, variant.setting, peak, median,
            peak_ratio=peak / base_peak if base_peak else 0.0,
            time_ratio=paired_ratio(seconds, times[0]),
            simulated_peak_bytes=plan.peak_bytes if plan else None,
            recompute_fraction=plan.recompute_flops / max(plan.forward_flops, 1) if plan else None,
            budget=variant.budget, plan_seconds=variant.plan_seconds, faults_per_step=fault_count,
            extra_seconds=statistics.median(t - b for t, b in zip(seconds, times[0], strict=True)),
            predicted_extra_seconds=variant.predicted_extra_seconds, recompute_seconds=recompute,
            caveat=variant.caveat, times=seconds))
    return results


# ---------------------------------------------------------------- what bench and pareto run

BENCH_BUDGETS = (0.75, 0.5, 0.35, 0.25, 0.15)  # graphckpt's frontier
COMPILE_BUDGETS = (0.5, 0.35)


def measured_peak(module: Callable[..., Any], inputs: tuple, loss_fn: Callable[[Any], torch.Tensor]) -> int:
    """The measured peak of one training step of ``module``, after a warm-up step, on the
    device its inputs live on."""
    step = training_step(module, inputs, loss_fn)
    step()
    with quiet_profiler():
        return peak_memory(step, device=infer_device(module, inputs))


def _sort(found: Iterable[Variant | Skipped], variants: list[Variant], skipped: list[Skipped]) -> None:
    for item in found:
        (variants if isinstance(item, Variant) else skipped).append(item)  # type: ignore[arg-type]


def anchor_variants(model: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor], *,
                    compile_budgets: Sequence[float] = COMPILE_BUDGETS,
                    compile_backends: Sequence[str] = ("aot_eager",)) -> list[Variant | Skipped]:
    """What people use today: checkpoint_sequential (√n), per-block checkpointing, and
    torch.compile at each budget with each backend (a backend that fails once is not retried)."""
    found = [sequential_anchor(model, inputs), block_anchor(model, inputs)]
    for backend in compile_backends:
        found += _compile_sweep(model, inputs, compile_budgets, loss_fn, backend)
    return found


def bench_variants(model: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor], *,
                   strategies: Iterable[str], budgets: Sequence[float] = BENCH_BUDGETS,
                   compile_budgets: Sequence[float] = COMPILE_BUDGETS,
                   compile_backends: Sequence[str] = ("aot_eager",), cost: str = "flops",
                   at_anchor_peaks: bool = True) -> tuple[list[Variant], list[Skipped]]:
    """Eager, the anchors (:func:`anchor_variants`), graphckpt with each strategy and at each
    budget, and graphckpt at each anchor's measured peak (less 1%; :func:`at_anchor_peak`):
    equal memory, compare time.

    One capture serves every graphckpt plan; each plan's time includes it.
    """
    variants = [eager_variant(model)]
    skipped: list[Skipped] = []
    anchors = anchor_variants(model, inputs, loss_fn, compile_budgets=compile_budgets,
                              compile_backends=compile_backends)
    modelled = model_costs(model, inputs, cost)
    ours = [planned_variant(modelled, strategy) for strategy in strategies]
    ours += [planned_variant(modelled, budget=budget) for budget in budgets]
    if at_anchor_peaks:
        ours += [at_anchor_peak(modelled, anchor, inputs, loss_fn) for anchor in anchors if isinstance(anchor, Variant)]
    _sort([*anchors, *ours], variants, skipped)
    return variants, skipped


def at_anchor_peak(modelled: Modelled, anchor: Variant, inputs: tuple,
                   loss_fn: Callable[[Any], torch.Tensor]) -> Variant | Skipped:
    """graphckpt's plan within ``anchor``'s measured peak, named ``graphckpt at <anchor>'s
    peak``: the two then compare on step time alone. The budget is the anchor's peak itself,
    not a margin under it: graphckpt's own plans measure what they simulate (every row of
    docs/benchmarks.md), and a comparison counts only at no more measured peak
    (:func:`graphckpt.tools.bench_report.step_versus`), so a plan that measured over it
    would lose, not pass. A margin made per-block's own layout miss a budget 1% under its
    peak, and the planner take a plan rated 5% slower."""
    bytes_ = measured_peak(anchor.module, inputs, loss_fn)
    return planned_variant(modelled, budget=bytes_, name=f"graphckpt at {anchor_label(anchor)}'s peak")


def anchor_label(anchor: Variant | Result) -> str:
    """How an anchor is named in a graphckpt variant's name (``per-block``, ``torch.compile aot_eager 0.5``)."""
    return "per-block" if anchor.kind == "per-block" else anchor.name


def _compile_sweep(model: nn.Module, inputs: tuple, budgets: Sequence[float],
                   loss_fn: Callable[[Any], torch.Tensor], backend: str = "aot_eager") -> list[Variant | Skipped]:
    """torch.compile anchors at each budget; after one fails to compile the rest are not tried."""
    found: list[Variant | Skipped] = []
    for budget in budgets:
        if found and isinstance(found[-1], Skipped):
            found.append(Skipped(f"torch.compile {backend} {budget:g}", "not tried: torch.compile failed above"))
        else:
            found.append(compile_anchor(model, inputs, budget, loss_fn, backend))
    return found


def pareto_variants(model: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor], *,
                    budgets: Sequence[float] = DEFAULT_BUDGETS, with_compile: bool = True,
                    ) -> tuple[list[Variant], list[Skipped]]:
    """Eager, graphckpt at each budget, torch.compile at each budget and checkpoint_sequential
    at a few segment counts: the points of a memory / time trade-off plot."""
    variants = [eager_variant(model)]
    skipped: list[Skipped] = []
    modelled = model_costs(model, inputs)
    found: list[Variant | Skipped] = [planned_variant(modelled, budget=b) for b in budgets]
    if with_compile:
        found += _compile_sweep(model, inputs, budgets, loss_fn)
    chain = find_sequential(model)
    counts = sorted({2, round(math.sqrt(len(chain))), len(chain) // 4} - {0, 1}) if chain is not None else [None]
    found += [sequential_anchor(model, inputs, count) for count in counts]
    _sort(found, variants, skipped)
    return variants, skipped
