"""Rewrite cost: capture, costs, plan and codegen time for real models of 1k, 10k and 50k fx nodes.

    python scripts/rewrite_cost.py [--sizes 1000 10000 50000] [--stacks residual transformer]
                                   [--out-md PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
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
from graphckpt.tools.zoo import scalar_loss
from passes.budget import BudgetError

WIDTH, BATCH, SEQ, CHECK_MAX_NODES = 16, 4, 8, 1000
STAGES = ("capture", "costs", "plan auto", "plan budget 0.25", "codegen", "total")
Row = dict[str, Any]  # "stack", "nodes" and seconds per stage; "plan budget 0.25" is None past the timeout
ABOUT = ("Wall-clock seconds of each stage of `graphckpt.rewrite` on stacks of tiny blocks (width {w}, batch {b}), "
         "so tensor work is negligible, by fx node count: a *residual* stack (LayerNorm → Linear → GELU → Linear "
         "+ residual, five fx nodes a block), a *transformer*-like one (sequence {s}: pre-norm single-head "
         "attention with q/k/v/out projections, softmax and dropout 0.1, then a GELU MLP, a residual around each; "
         "eighteen fx nodes a block), and an *inplace* one (a ResNet basic block's pattern on Linears: ReLU(inplace=True), "
         "`out += x`, ReLU(inplace=True); five fx nodes a block, three of them in-place writes). "
         "total = capture + costs (prepare + build_cost_graph) + plan auto + codegen; "
         "plan budget 0.25 (the optimal pass at a quarter of eager's simulated peak) is a second plan, timed on its "
         "own and given up after {t} s. A warm-up rewrite of a tiny stack runs first; rewrites of up to "
         "{c} nodes are checked against eager's gradients. Growth: the exponent k of seconds ∝ nodes^k between "
         "consecutive sizes (1 is linear; n log n reads about 1.12 from 1k to 10k and 1.10 from 10k to 50k). "
         "A *llama* stack is a Hugging Face LLaMA (width 64, 4 heads, 2 key/value heads, sequence 32, batch 2, "
         "given labels), about 72 exported nodes a layer: fx cannot trace it, so its capture is torch.export's, "
         "of three layers, the rest stamped from the third (`graphckpt.stamping`).")


class Block(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear with a residual: five fx nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.act = nn.LayerNorm(WIDTH), nn.GELU()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class TransformerBlock(nn.Module):
    """Pre-norm single-head attention (dropout on the probabilities and the output) and a
    GELU MLP, a residual around each: eighteen fx nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.up, self.act, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        self.drop_attention, self.drop_out = nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        scores = self.q(h) @ self.k(h).transpose(-1, -2) * WIDTH ** -0.5
        x = x + self.drop_out(self.out(self.drop_attention(scores.softmax(-1)) @ self.v(h)))
        return x + self.down(self.act(self.up(self.norm2(x))))


class InPlaceBlock(nn.Module):
    """A ResNet basic block's pattern written in place: Linear -> ReLU(inplace=True) ->
    Linear, ``out += x``, ReLU(inplace=True): five fx nodes, three of them in-place writes."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.act, self.out_act = nn.ReLU(inplace=True), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(self.act(self.up(x)))
        out += x
        return self.out_act(out)


STACKS: dict[str, tuple[type[nn.Module], int, tuple[int, ...]]] = {  # block, fx nodes a block, input shape
    "residual": (Block, 5, (BATCH, WIDTH)),
    "transformer": (TransformerBlock, 18, (BATCH, SEQ, WIDTH)),
    "inplace": (InPlaceBlock, 5, (BATCH, WIDTH)),
}


class Stack(nn.Module):
    """``blocks`` blocks of one kind (residual by default) in a row."""

    def __init__(self, blocks: int, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(blocks))

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


def check_gradients(model: nn.Module, rewritten: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """One forward+backward of ``rewritten`` gives eager's loss and parameter gradients
    (the same dropout masks: each run from one seed)."""
    results = []
    for module in (model, rewritten):
        model.zero_grad()
        torch.manual_seed(0)
        loss = scalar_loss(module(*args, **kwargs))
        loss.backward()
        results.append([loss, *(p.grad.clone() for p in model.parameters() if p.grad is not None)])
    torch.testing.assert_close(results[1], results[0])


LLAMA_NODES_PER_LAYER, LLAMA_OTHER_NODES = 72, 50  # exported op by op (5843 nodes at 80 layers)


def hf_llama(size: int) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """A Hugging Face LLaMA of about ``size`` exported nodes (width 64, 4 heads, 2 key/value
    heads, sequence 32, batch 2), and its inputs with labels: a model nobody here wrote,
    captured by ``torch.export`` since fx cannot trace it."""
    import transformers

    layers = max(1, round((size - LLAMA_OTHER_NODES) / LLAMA_NODES_PER_LAYER))
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    ids = torch.randint(0, 256, (2, 32))
    return transformers.LlamaForCausalLM(config), (), {"input_ids": ids, "labels": ids}


def build(size: int, stack: str) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """A model of about ``size`` fx nodes: a :data:`STACKS` stack, or ``"llama"`` (:func:`hf_llama`)."""
    if stack == "llama":
        return hf_llama(size)
    block, per_block, shape = STACKS[stack]
    return Stack(max(1, round((size - 2) / per_block)), block), (torch.randn(*shape),), {}


def measure(size: int, budget_timeout: int, stack: str = "residual") -> Row:
    """Time every stage of rewriting a ``stack`` (a :data:`STACKS` name, or ``"llama"``) of
    about ``size`` fx nodes."""
    torch.manual_seed(0)
    model, args, kwargs = build(size, stack)
    captured, capture_s = timed(lambda: capture(model, args, kwargs))
    gm = captured.graph_module
    cost_graph, costs_s = timed(lambda: build_cost_graph(gm, prepare(gm, args, kwargs, "flops")))
    plan, plan_s = timed(lambda: plan_cost_graph(cost_graph, "auto"))
    budget_s = timed_or_none(lambda: plan_budget(cost_graph), budget_timeout)
    with torch.no_grad():
        rewritten, codegen_s = timed(lambda: generate(gm, model, plan, captured.method))
    if len(gm.graph.nodes) <= CHECK_MAX_NODES:
        check_gradients(model, rewritten, args, kwargs)
    seconds = (capture_s, costs_s, plan_s, budget_s, codegen_s, capture_s + costs_s + plan_s + codegen_s)
    return {"stack": stack, "nodes": len(gm.graph.nodes), **dict(zip(STAGES, seconds, strict=True))}


def table(rows: list[Row], budget_timeout: int) -> str:
    """The markdown table, one row per model."""
    lines = ["| nodes | " + " | ".join(STAGES) + " |", "|---:|" + "---:|" * len(STAGES)]
    for row in rows:
        cells = [f"> {budget_timeout} s" if row[s] is None else f"{row[s]:.2f} s" for s in STAGES]
        lines.append(f"| {row['nodes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def growth(rows: list[Row]) -> str:
    """Per stage, the exponent k of seconds ∝ nodes^k between each pair of consecutive sizes,
    as markdown bullets (not table rows: one table per stack stays one table)."""
    lines = []
    for before, after in itertools.pairwise(rows):
        ratio = math.log(after["nodes"] / before["nodes"])
        exponents = [f"{stage} {math.log(after[stage] / before[stage]) / ratio:.2f}"
                     for stage in STAGES if before[stage] and after[stage]]
        lines.append(f"- growth {before['nodes']} → {after['nodes']} nodes: " + ", ".join(exponents))
    return "\n".join(lines)


def report(rows: list[Row], budget_timeout: int) -> str:
    """One table and its growth exponents per stack, in the order measured."""
    stacks = list(dict.fromkeys(row["stack"] for row in rows))
    parts = []
    for stack in stacks:
        mine = [row for row in rows if row["stack"] == stack]
        title = f"**{stack} stack**\n\n" if len(stacks) > 1 else ""
        parts.append(f"{title}{table(mine, budget_timeout)}\n\n{growth(mine)}".rstrip())
    return "\n\n".join(parts)


def fragment(rows: list[Row], argv: list[str], budget_timeout: int) -> str:
    """The tables as a markdown fragment: what was measured, on what, with which command."""
    machine = machine_line()
    about = ABOUT.format(w=WIDTH, b=BATCH, s=SEQ, t=budget_timeout, c=CHECK_MAX_NODES)
    return (f"{about}\n\nMachine: {machine}.\n\n"
            f"Command: `python scripts/rewrite_cost.py {' '.join(argv)}`\n\n{report(rows, budget_timeout)}\n")


def plot(rows: list[Row], path: str) -> None:
    """Log-log seconds against node count, one line per stage and the total, a line style per stack."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = dict(zip(STAGES, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False)) | {"total": "black"}
    for stack, line in zip(dict.fromkeys(row["stack"] for row in rows), ("-", "--", ":"), strict=False):
        for stage in STAGES:
            points = [(row["nodes"], row[stage]) for row in rows if row["stack"] == stack and row[stage] is not None]
            width = 2.5 if stage == "total" else 1.5
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", linestyle=line, color=colors[stage],
                        linewidth=width, label=f"{stage} ({stack})")
    ax.set(xscale="log", yscale="log", xlabel="fx graph nodes", ylabel="seconds",
           title=f"graphckpt rewrite cost by stage ({', '.join(dict.fromkeys(r['stack'] for r in rows))} stacks, CPU)")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left", framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=150, facecolor="white")
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Row]:
    """Measure every size, print the table, and write the fragment and plot if asked."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--stacks", nargs="+", choices=[*sorted(STACKS), "llama"], default=["residual"])
    parser.add_argument("--budget-timeout", type=int, default=180, help="seconds before the budget plan is given up")
    parser.add_argument("--out-md", help="write the table as a markdown fragment here")
    parser.add_argument("--png", help="write the log-log plot here")
    options = parser.parse_args(argv)
    measure(20, options.budget_timeout)  # warm-up: imports, first fake-tensor dispatch
    rows = []
    for stack in options.stacks:
        for size in options.sizes:
            rows.append(measure(size, options.budget_timeout, stack))
            print(f"measured {stack} {rows[-1]['nodes']} nodes: total {rows[-1]['total']:.1f} s", file=sys.stderr,
                  flush=True)
    print(report(rows, options.budget_timeout))
    if options.out_md:
        with open(options.out_md, "w") as out:
            out.write(fragment(rows, argv, options.budget_timeout))
    if options.png:
        plot(rows, options.png)
    return rows


if __name__ == "__main__":
    main()
