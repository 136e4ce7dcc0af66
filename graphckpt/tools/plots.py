"""Charts of measurements (:mod:`graphckpt.tools.bench` results) with matplotlib.

* :func:`plot_bench`: measured peak and step time of every variant, as bars with their
  ratio to eager.
* :func:`plot_pareto`: peak memory against step time (or recompute) for graphckpt's
  budget sweep and the anchors, measured and simulated: which trade-offs are on offer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphckpt.tools.bench import Result

MiB = 2**20
KIND_STYLE: dict[str, dict[str, Any]] = {
    "eager": {"color": "#444444", "marker": "*", "label": "eager"},
    "graphckpt": {"color": "#c0162c", "marker": "o", "label": "graphckpt (measured)"},
    "torch.compile": {"color": "#1f77b4", "marker": "s", "label": "torch.compile aot_eager, activation_memory_budget"},
    "torch.compile inductor": {"color": "#17becf", "marker": "s",
                               "label": "torch.compile inductor, activation_memory_budget"},
    "checkpoint_sequential": {"color": "#2ca02c", "marker": "^", "label": "torch checkpoint_sequential"},
    "per-block": {"color": "#9467bd", "marker": "D", "label": "per-block checkpointing (HF style)"},
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bench(results: Sequence[Result], path: str | Path, title: str) -> None:
    """Two bar panels, one row per variant: measured peak (MiB) and median step time (ms)."""
    plt = _pyplot()
    names = [r.name for r in results][::-1]
    colours = [KIND_STYLE.get(r.kind, KIND_STYLE["eager"])["color"] for r in results][::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.42 * len(results) + 1.6), sharey=True)
    panels = ((left, [r.peak_bytes / MiB for r in results][::-1], [r.peak_ratio for r in results][::-1],
               "measured peak activation memory (MiB)"),
              (right, [r.step_seconds * 1e3 for r in results][::-1], [r.time_ratio for r in results][::-1],
               "median step time (ms)"))
    for ax, values, ratios, label in panels:
        bars = ax.barh(names, values, color=colours, alpha=0.85)
        for bar, value_ratio in zip(bars, ratios, strict=True):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value_ratio:.2f}x",
                    va="center", fontsize=8)
        ax.set_xlabel(label)
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title, fontsize=11, fontweight="bold", x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=150, facecolor="white")
    plt.close(fig)


def _x_value(result: Result, x: str) -> float | None:
    if x == "time":
        return result.step_seconds * 1e3
    if result.kind == "eager":
        return 0.0
    return None if result.recompute_fraction is None else 100 * result.recompute_fraction


def _sweep_order(point: Result) -> float:
    """Budgets from loose to tight; segment counts from few to many."""
    if point.budget is not None:
        return -point.budget
    digits = "".join(c for c in point.setting if c.isdigit())
    return float(digits or 0)


def _plot_strategies(ax: Any, points: list[Result], x: str) -> None:
    """graphckpt's strategies (no budget): unjoined markers labelled with the strategy."""
    style = KIND_STYLE["graphckpt"]
    placed = [(p, _x_value(p, x)) for p in points if _x_value(p, x) is not None]
    if not placed:
        return
    ax.plot([v for _, v in placed], [p.peak_bytes / MiB for p, _ in placed], marker="P", ls="",
            color=style["color"], ms=7, alpha=0.6, label="graphckpt strategies", zorder=3)
    for p, x_value in placed:
        ax.annotate(p.name.removeprefix("graphckpt "), (x_value, p.peak_bytes / MiB), textcoords="offset points",
                    xytext=(6, -9), fontsize=7, color=style["color"], alpha=0.8)


def _plot_kind(ax: Any, points: list[Result], kind: str, x: str) -> None:
    """One series: markers joined in sweep order (budget or segment count), labelled;
    graphckpt's strategies (no budget) apart, as single points."""
    style = KIND_STYLE[kind]
    if kind == "graphckpt":
        _plot_strategies(ax, [p for p in points if p.budget is None], x)
        points = [p for p in points if p.budget is not None]
    points = sorted((p for p in points if _x_value(p, x) is not None), key=_sweep_order)
    if not points:
        return
    xs = [_x_value(p, x) for p in points]
    if kind == "graphckpt":  # a ring around each measured dot: where the simulator agrees
        simulated = [(x_value, p.simulated_peak_bytes / MiB) for p, x_value in zip(points, xs, strict=True)
                     if p.simulated_peak_bytes is not None]
        ax.plot(*zip(*simulated, strict=True), marker="o", mfc="none", ms=11, color=style["color"], ls=":",
                lw=1, alpha=0.8, label="graphckpt (simulated)", zorder=2)
    ax.plot(xs, [p.peak_bytes / MiB for p in points], marker=style["marker"], color=style["color"],
            label=style["label"], ms=13 if kind == "eager" else 6.5, lw=1.3, alpha=0.9,
            ls="" if kind == "eager" else "-", zorder=3)
    for p, x_value in zip(points, xs, strict=True):
        tag = f"{p.budget:.2g}" if p.budget is not None else p.setting.replace(" segments", " seg")
        tag = "" if kind == "per-block" else tag  # its setting says how, the legend says what
        if tag:
            ax.annotate(tag, (x_value, p.peak_bytes / MiB), textcoords="offset points", xytext=(6, 5),
                        fontsize=7.5, color=style["color"])


def _series(result: Result) -> str:
    """The plotted series of a result: its kind, with torch.compile split by backend."""
    if result.kind == "torch.compile" and result.setting.startswith("inductor"):
        return "torch.compile inductor"
    return result.kind


def _ratio_axis(ax: Any, results: Sequence[Result]) -> None:
    """A right-hand axis in multiples of eager's measured peak."""
    eager = next((r.peak_bytes / MiB for r in results if r.kind == "eager"), None)
    if eager:
        axis = ax.secondary_yaxis("right", functions=(lambda v: v / eager, lambda r: r * eager))
        axis.set_ylabel("× eager peak")


def plot_pareto(results: Sequence[Result], path: str | Path, title: str, x: str = "time") -> None:
    """Peak memory (MiB, measured; graphckpt's simulated peak as rings) against step time
    (``x="time"``) or recompute as % of forward FLOPs (``x="flops"``, graphckpt and eager
    only: the anchors do not report what they recompute). Points are labelled with their
    budget (fraction of eager's peak) or segment count."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    for kind in KIND_STYLE:
        _plot_kind(ax, [r for r in results if _series(r) == kind], kind, x)
    ax.set_xlabel("median step time (ms)" if x == "time" else "recompute (% of forward FLOPs)")
    ax.set_ylabel("peak activation memory (MiB)")
    ax.margins(x=0.07)
    ax.set_ylim(bottom=0)
    _ratio_axis(ax, results)
    ax.grid(alpha=0.3)
    ax.spines[["top"]].set_visible(False)
    ax.legend(fontsize=8, frameon=False, loc="best")
    ax.set_title(title, fontsize=10.5, fontweight="bold", loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=150, facecolor="white")
    plt.close(fig)
