"""Rewrite cost: capture, costs, plan and codegen time for real models of 1k, 10k and 50k fx nodes.

    python scripts/rewrite_cost.py [--sizes 1000 10000 50000] [--out-md PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphckpt.api import plan_cost_graph
from graphckpt.capture import capture
from graphckpt.codegen import generate
from graphckpt.costs import build_cost_graph, prepare
from graphckpt.tools.bench_report import machine_line
from graphckpt.tools.plots import _pyplot
from passes.budget import BudgetError

WIDTH, BATCH, NODES_PER_BLOCK, CHECK_MAX_NODES = 16, 4, 5, 1000
STAGES = ("capture", "costs", "plan auto", "plan budget 0.25", "codegen", "total")
Row = dict[str, Any]  # "nodes" and seconds per stage; "plan budget 0.25" is None past the timeout
ABOUT = ("Wall-clock seconds of each stage of `graphckpt.rewrite` on a residual stack of tiny blocks (width {w}, "
         "batch {b}; LayerNorm → Linear → GELU → Linear + residual, five fx nodes a block), so tensor work is "
         "negligible, by fx node count. total = capture + costs (prepare + build_cost_graph) + plan auto + codegen; "
         "plan budget 0.25 (the optimal pass at a quarter of eager's simulated peak) is a second plan, timed on its "
         "own and given up after {t} s. A warm-up rewrite of a tiny stack runs first; rewrites of up to "
         "{c} nodes are checked against eager's gradients.")


class Block(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear with a residual: five fx nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.act = nn.LayerNorm(WIDTH), nn.GELU()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Stack(nn.Module):
    """``blocks`` residual blocks in a row."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    """``function()`` and the wall-clock seconds it took."""
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def timed_or_none(function: Callable[[], object], timeout: int) -> float | None:
    """Seconds ``function()`` took, or None when it ran past ``timeout`` seconds (SIGALRM).

    The alarm's ``TimeoutError`` may surface wrapped in another error (networkx re-raises
    what interrupts its graph conversions), so the alarm, not the error's type, says which.
    """
    expired = False

    def give_up(signum: int, frame: object) -> None:
        nonlocal expired
        expired = True
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(timeout)
    try:
        return timed(function)[1]
    except Exception:
        if expired:
            return None
        raise
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def plan_budget(cost_graph: Any) -> None:
    """The optimal pass at a quarter of eager's peak; "no plan fits" is an answer too."""
    with contextlib.suppress(BudgetError):
        plan_cost_graph(cost_graph, budget=0.25)


def check_gradients(model: nn.Module, rewritten: nn.Module, x: torch.Tensor) -> None:
    """One forward+backward of ``rewritten`` gives eager's output and parameter gradients."""
    results = []
    for module in (model, rewritten):
        model.zero_grad()
        output = module(x)
        output.sum().backward()
        results.append([output, *(p.grad.clone() for p in model.parameters())])
    torch.testing.assert_close(results[1], results[0])


def measure(size: int, budget_timeout: int) -> Row:
    """Time every stage of rewriting a stack of about ``size`` fx nodes."""
    torch.manual_seed(0)
    model, x = Stack(max(1, round((size - 2) / NODES_PER_BLOCK))), torch.randn(BATCH, WIDTH)
    captured, capture_s = timed(lambda: capture(model, (x,), None))
    gm = captured.graph_module
    cost_graph, costs_s = timed(lambda: build_cost_graph(gm, prepare(gm, (x,), None, "flops")))
    plan, plan_s = timed(lambda: plan_cost_graph(cost_graph, "auto"))
    budget_s = timed_or_none(lambda: plan_budget(cost_graph), budget_timeout)
    with torch.no_grad():
        rewritten, codegen_s = timed(lambda: generate(gm, model, plan, captured.method))
    if len(gm.graph.nodes) <= CHECK_MAX_NODES:
        check_gradients(model, rewritten, x)
    seconds = (capture_s, costs_s, plan_s, budget_s, codegen_s, capture_s + costs_s + plan_s + codegen_s)
    return {"nodes": len(gm.graph.nodes), **dict(zip(STAGES, seconds, strict=True))}


def table(rows: list[Row], budget_timeout: int) -> str:
    """The markdown table, one row per model."""
    lines = ["| nodes | " + " | ".join(STAGES) + " |", "|---:|" + "---:|" * len(STAGES)]
    for row in rows:
        cells = [f"> {budget_timeout} s" if row[s] is None else f"{row[s]:.2f} s" for s in STAGES]
        lines.append(f"| {row['nodes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fragment(rows: list[Row], argv: list[str], budget_timeout: int) -> str:
    """The table as a markdown fragment: what was measured, on what, with which command."""
    machine = machine_line()
    return (f"{ABOUT.format(w=WIDTH, b=BATCH, t=budget_timeout, c=CHECK_MAX_NODES)}\n\nMachine: {machine}.\n\n"
            f"Command: `python scripts/rewrite_cost.py {' '.join(argv)}`\n\n{table(rows, budget_timeout)}\n")


def plot(rows: list[Row], path: str) -> None:
    """Log-log seconds against node count, one line per stage and the total."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for stage in STAGES:
        points = [(row["nodes"], row[stage]) for row in rows if row[stage] is not None]
        style: dict[str, Any] = {"color": "black", "linewidth": 2.5} if stage == "total" else {}
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=stage, **style)
    ax.set(xscale="log", yscale="log", xlabel="fx graph nodes", ylabel="seconds",
           title="graphckpt rewrite cost by stage (residual stack of tiny blocks, CPU)")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150, facecolor="white")
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Row]:
    """Measure every size, print the table, and write the fragment and plot if asked."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--budget-timeout", type=int, default=180, help="seconds before the budget plan is given up")
    parser.add_argument("--out-md", help="write the table as a markdown fragment here")
    parser.add_argument("--png", help="write the log-log plot here")
    options = parser.parse_args(argv)
    measure(20, options.budget_timeout)  # warm-up: imports, first fake-tensor dispatch
    rows = []
    for size in options.sizes:
        rows.append(measure(size, options.budget_timeout))
        print(f"measured {rows[-1]['nodes']} nodes: total {rows[-1]['total']:.1f} s", file=sys.stderr, flush=True)
    print(table(rows, options.budget_timeout))
    if options.out_md:
        with open(options.out_md, "w") as out:
            out.write(fragment(rows, argv, options.budget_timeout))
    if options.png:
        plot(rows, options.png)
    return rows


if __name__ == "__main__":
    main()
