"""Benchmark results as markdown: one table per model, the machine they ran on, target checks.

Pure formatting of :class:`graphckpt.tools.bench.Result` lists; what is measured is decided in
:mod:`graphckpt.tools.bench` and ``scripts/bench.py``.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphckpt.tools.anchors import Skipped
from graphckpt.tools.bench import Result, anchor_label
from graphckpt.tools.pairs import HeadToHead
from passes.units import format_bytes

COLUMNS = ("variant", "setting", "measured peak", "× eager", "simulated peak", "step", "× eager",
           "× eager, default allocator", "faults / step", "extra time: predicted / in recomputes / measured",
           "build")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(device: str | torch.device = "cpu") -> str:
    """Where the numbers come from: the GPU when ``device`` is one, CPU, cores, threads, OS,
    Python and torch versions."""
    on_gpu = torch.device(device).type == "cuda"
    gpu = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}); " if on_gpu else ""
    return (f"{gpu}{_cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; "
            f"{platform.system()} {platform.release()}; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def result_row(result: Result) -> str:
    """One markdown table row: measured peak and its ratio, simulated peak, step time and
    ratio, and the time to build the variant (capture + plan + codegen, or compile)."""
    build = "" if result.plan_seconds is None else f"{result.plan_seconds:.1f} s"
    simulated = "" if result.simulated_peak_bytes is None else format_bytes(result.simulated_peak_bytes)
    default = "" if result.default_time_ratio is None else f"{result.default_time_ratio:.2f}"
    extra = "" if result.predicted_extra_seconds is None else " / ".join(
        f"{seconds * 1e3:.0f}" for seconds in (result.predicted_extra_seconds, result.recompute_seconds,
                                              result.extra_seconds) if seconds is not None) + " ms"
    setting = f"{result.setting} (trains unlike eager: see below)" if result.caveat else result.setting
    cells = (result.name, setting, format_bytes(result.peak_bytes), f"{result.peak_ratio:.2f}",
             simulated, f"{result.step_seconds * 1e3:.0f} ms", f"{result.time_ratio:.2f}", default,
             f"{result.faults_per_step:.0f}", extra, build)
    return "| " + " | ".join(cells) + " |"


def results_table(results: Sequence[Result], skipped: Sequence[Skipped] = ()) -> str:
    """The markdown table of a model's variants, followed by a line per skipped variant."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
    lines += [result_row(result) for result in results]
    notes = [f"- *{r.name}* trains unlike eager: {r.caveat}" for r in results if r.caveat]
    notes += [f"- *{s.name}* not measured: {s.reason}" for s in skipped]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


@dataclass(frozen=True)
class Verdict:
    """A target from the issue, checked on one run's ratios: met or not, and the evidence."""

    target: str
    met: bool
    evidence: str
    comparable: bool = True  # False: the anchor does not train the model, so neither met nor missed

    def markdown(self) -> str:
        """One bullet: **met** / **missed** / **not comparable**, the target, what was measured."""
        status = "not comparable" if not self.comparable else "met" if self.met else "missed"
        return f"- **{status}**: {self.target}. {self.evidence}"


def best_within(results: Sequence[Result], peak_ratio: float) -> Result | None:
    """The fastest graphckpt variant whose measured peak is at most ``peak_ratio`` × eager."""
    fitting = [r for r in results if r.kind == "graphckpt" and r.peak_ratio <= peak_ratio + 1e-9]
    return min(fitting, key=lambda r: r.time_ratio, default=None)


def peak_and_time_target(results: Sequence[Result], target: str, peak_ratio: float, time_ratio: float,
                         reference: str = "") -> Verdict:
    """Whether some graphckpt variant reaches ``peak_ratio`` × eager's peak (or less) within
    ``time_ratio`` × eager's step time."""
    best = best_within(results, peak_ratio)
    ceiling = f"{peak_ratio:.2f}× eager{reference}"
    if best is None:
        return Verdict(target, False, f"No graphckpt variant measured at or below {ceiling}.")
    return Verdict(target, best.time_ratio <= time_ratio,
                   f"Fastest graphckpt variant at or below {ceiling}: *{best.name}*, peak "
                   f"{best.peak_ratio:.2f}×, step {best.time_ratio:.2f}× eager.")


def versus_anchor(results: Sequence[Result], anchor: str, target: str) -> Verdict:
    """Whether ``graphckpt at <anchor>'s peak`` steps at most as long as ``anchor`` at no more
    measured peak (:func:`step_versus`)."""
    theirs = next((r for r in results if r.name == anchor), None)
    if theirs is None:
        return Verdict(target, False, f"Not measured: {anchor} did not run.")
    if theirs.caveat:
        found = step_versus(results, f"graphckpt at {anchor_label(theirs)}'s peak", anchor, target)
        return Verdict(target, False, f"*{anchor}* trains unlike eager ({theirs.caveat}). Measured all the "
                       f"same: {found.evidence}", comparable=False)
    return step_versus(results, f"graphckpt at {anchor_label(theirs)}'s peak", anchor, target)


def step_versus(results: Sequence[Result], ours: str, theirs: str, target: str) -> Verdict:
    """Whether variant ``ours`` steps at most as long as ``theirs`` (median of the per-round
    ratios, with a 95% bootstrap interval) at no more measured peak."""
    by_name = {r.name: r for r in results}
    if ours not in by_name or theirs not in by_name:
        missing = ours if ours not in by_name else theirs
        return Verdict(target, False, f"Not measured: *{missing}* (no plan fits, or it did not run).")
    mine, other = by_name[ours], by_name[theirs]
    pair = HeadToHead(tuple(o / t for o, t in zip(mine.times, other.times, strict=True)),
                      (mine.faults_per_step, other.faults_per_step))
    low, high = pair.interval()
    return Verdict(target, pair.median <= 1.0 and mine.peak_bytes <= other.peak_bytes,
                   f"*{ours}* over *{theirs}*: step {pair.median:.3f}× (95% interval {low:.3f}–{high:.3f}, "
                   f"{len(pair.ratios)} rounds) at {mine.peak_bytes / max(other.peak_bytes, 1):.2f}× its measured peak.")


def never_above_eager(results_by_model: dict[str, Sequence[Result]]) -> Verdict:
    """Whether every graphckpt variant of every model measured at most eager's peak."""
    over = [f"{model}: {r.name} {r.peak_ratio:.2f}×" for model, results in results_by_model.items()
            for r in results if r.kind == "graphckpt" and r.peak_ratio > 1.0]
    evidence = "Over eager: " + "; ".join(over) + "." if over else "Every graphckpt row is at or below 1.00×."
    return Verdict("no graphckpt plan or budget above eager's measured peak", not over, evidence)
