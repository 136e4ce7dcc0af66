"""Benchmarks against the anchors: measured peak memory and step time, side by side.

    python scripts/bench.py --out docs/benchmarks.md --default-allocator-steps 3   # the published run
    python scripts/bench.py --models mlp,gpt2 --steps 5       # a subset, printed
    python scripts/bench.py --tiny --out /tmp/b.md            # seconds: the smoke test's run
    python scripts/bench.py --device cuda --gpu-sizes --models gpt2 --steps 7   # a GPU, at sizes it waits on

For each model, in one process: eager; ``checkpoint_sequential`` with √n segments (chains);
per-block checkpointing as Hugging Face's ``gradient_checkpointing_enable()`` does it;
torch.compile with ``activation_memory_budget`` 0.5 and 0.35 (aot_eager; ``--inductor`` adds
inductor); graphckpt with every strategy, at budgets 0.75 to 0.15 (its frontier), and at each
anchor's measured peak. Each variant is warmed up, its peak measured once (profiler memory
timeline on CPU), and its step time is the median of ``--steps`` interleaved rounds, its
ratio to eager the median of per-round ratios (:func:`graphckpt.tools.bench.measure_variants`),
with minor page faults per step. Steps are timed with a retaining allocator (the script
re-runs itself with ``GLIBC_TUNABLES`` set, as a GPU's caching allocator keeps freed
memory); ``--default-allocator-steps N`` measures every time ratio again in a second process
with glibc's default allocator, for its own column.
``graphckpt bench TARGET`` runs the same set on one model. The markdown goes to ``--out``
with a Pareto PNG per model beside it.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphckpt.tools import zoo
from graphckpt.tools.bench import COMPILE_BUDGETS, Result, bench_variants, measure_variants
from graphckpt.tools.bench_report import (
    Verdict,
    machine_line,
    never_above_eager,
    results_table,
    step_versus,
    versus_anchor,
)
from graphckpt.tools.console import quiet_profiler
from graphckpt.tools.hf_zoo import hf_gpt2, hf_llama
from graphckpt.tools.measure import on_device
from graphckpt.tools.pairs import RETAINING, rerun_with_retaining_allocator
from graphckpt.tools.plots import plot_pareto
from passes.strategies import STRATEGIES

Loss = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class Case:
    """A benchmark model: how to build it (model, inputs, loss) and a line describing it."""

    name: str
    description: str
    build: Callable[[], tuple[nn.Module, tuple, Loss]]


def _zoo(name: str, **kwargs: Any) -> Callable[[], tuple[nn.Module, tuple, Loss]]:
    def build() -> tuple[nn.Module, tuple, Loss]:
        model, inputs = zoo.make(name, **kwargs)
        return model, inputs, zoo.scalar_loss

    return build


def _hf(build: Callable[..., tuple[nn.Module, tuple, Loss]], **kwargs: Any) -> Callable[[], tuple[nn.Module, tuple, Loss]]:
    return lambda: build(**kwargs)


FULL = [
    Case("mlp", "zoo MLP chain: 32 × (Linear 256 + GELU), batch 2048",
         _zoo("mlp", depth=32, width=256, batch=2048)),
    Case("resnet", "zoo ResNet: widths 32/64/128, 2 blocks per stage, batch 32, 32×32 images",
         _zoo("resnet", widths=(32, 64, 128), blocks_per_stage=2, batch=32)),
    Case("unet", "zoo U-Net: base 16, 3 levels, batch 16, 32×32 images", _zoo("unet", base=16, levels=3, batch=16)),
    Case("transformer", "zoo GPT: 6 layers, d=256, 4 heads, seq 128, batch 8, dropout 0.1",
         _zoo("gpt", layers=6, d=256, heads=4, seq=128, batch=8, dropout=0.1)),
    Case("gpt2", "Hugging Face GPT-2 (transformers, via torch.export): 12 layers, d=256, seq 256, batch 8, "
         "dropout 0, vocab 8192 (GPT-2's 50257 would make the LM head and its loss most of a CPU step)",
         _hf(hf_gpt2, layers=12, d=256, seq=256, batch=8, vocab=8192)),
    Case("llama", "Hugging Face LLaMA (via torch.export): 8 layers, d=256, GQA 8/4 heads, rotary, RMSNorm, "
         "SwiGLU, seq 256, batch 8, vocab 8192", _hf(hf_llama, layers=8, d=256, seq=256, batch=8)),
]
GPU_SIZES = [  # at d=256 a GPU step waits on Python, not on kernels
    Case("gpt2", "Hugging Face GPT-2 small (via torch.export): 12 layers, d=768, seq 1024, batch 8, vocab 50257, "
         "dropout 0", _hf(hf_gpt2, layers=12, d=768, seq=1024, batch=8)),
    Case("llama", "Hugging Face LLaMA (via torch.export): 8 layers, d=1024, GQA 16/4 heads, seq 1024, batch 4, "
         "vocab 32000", _hf(hf_llama, layers=8, d=1024, seq=1024, batch=4, heads=16, kv_heads=4, vocab=32000)),
    Case("transformer", "zoo GPT: 12 layers, d=768, 12 heads, seq 512, batch 8, dropout 0.1",
         _zoo("gpt", layers=12, d=768, heads=12, seq=512, batch=8, dropout=0.1)),
    Case("resnet", "zoo ResNet: widths 64/128/256, 2 blocks per stage, batch 256, 32×32 images",
         _zoo("resnet", widths=(64, 128, 256), blocks_per_stage=2, batch=256)),
]
TINY = [
    Case("mlp", "zoo MLP chain: 6 × (Linear 32 + GELU), batch 16", _zoo("mlp", depth=6, width=32, batch=16)),
    Case("transformer", "zoo GPT: 2 layers, d=32, seq 16, batch 2", _zoo("gpt", layers=2, d=32, seq=16, batch=2)),
]


def run_case(case: Case, options: argparse.Namespace) -> tuple[list[Result], list[Any]]:
    """Build every variant of one model and measure them in one process."""
    model, inputs, loss = case.build()
    model, inputs = model.to(options.device), on_device(inputs, options.device)
    backends = ("aot_eager", "inductor") if options.inductor else ("aot_eager",)
    with quiet_profiler():
        variants, skipped = bench_variants(model, inputs, loss, strategies=STRATEGIES, compile_backends=backends,
                                           cost=options.cost)
        _say(f"{case.name}: built {len(variants)} variants ({len(skipped)} skipped); measuring")
        return measure_variants(variants, inputs, loss, steps=options.steps, progress=_say), skipped


def _say(message: str) -> None:
    print(f"  {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def targets(results: dict[str, list[Result]]) -> list[Verdict]:
    """The issue's targets, checked on this run's paired rounds (only for the models that ran)."""
    verdicts = []
    for model in ("gpt2", "llama"):
        if model in results:
            verdicts.append(versus_anchor(results[model], "per-block",
                                          f"{model}: at per-block checkpointing's measured peak, step ≤ 1.00× its"))
    for model, found in results.items():
        for budget in COMPILE_BUDGETS:
            verdicts.append(versus_anchor(found, f"torch.compile aot_eager {budget:g}",
                                          f"{model}: at torch.compile's (aot_eager, budget {budget:g}) measured "
                                          "peak, step ≤ 1.00× its"))
    if "mlp" in results:
        sequential = next((r.name for r in results["mlp"] if r.kind == "checkpoint_sequential"), "checkpoint_sequential")
        verdicts.append(step_versus(results["mlp"], "graphckpt 0.25", sequential,
                                    "mlp: at 0.25 of eager, step ≤ checkpoint_sequential's at its own peak"))
    verdicts.append(never_above_eager(results))
    return verdicts


ELSEWHERE = (
    "- Planner quality, each strategy's recompute over the exact MILP optimum on random and zoo cost graphs: "
    "[planner_quality.md](planner_quality.md) (`python scripts/planner_gap.py --out docs/planner_quality.md`).",
    "- Rewrite cost, capture + costs + plan + codegen for 1k, 10k and 50k fx nodes: "
    "[rewrite_cost.md](rewrite_cost.md) (`python scripts/rewrite_cost.py --out-md docs/rewrite_cost.md "
    "--png docs/rewrite_cost.png`).",
)


def _load_line(options: argparse.Namespace) -> str:
    """How busy the machine was: step-time ratios on a machine whose other jobs compete for its
    cores spread widely (the targets' intervals show it); peaks do not depend on it."""
    start, end = options.load_average
    cores = os.cpu_count() or 1
    busy = ": other jobs competed for the cores, so step times spread widely" if max(start, end) > cores + 1 else ""
    return f"Load average (1 min) at the start of the run {start:.1f}, at the end {end:.1f}, on {cores} cores{busy}."


def _allocator(options: argparse.Namespace) -> str:
    if options.default_allocator:
        return "glibc's default allocator"
    return f"a retaining allocator (`GLIBC_TUNABLES={RETAINING}`: freed memory kept, as by a GPU's caching allocator)"


def document(cases: list[Case], results: dict[str, list[Result]], skipped: dict[str, list[Any]],
             options: argparse.Namespace, out: Path | None) -> str:
    """The whole markdown page: how it was made, the targets, then a section per model."""
    command = "python scripts/bench.py " + " ".join(sys.argv[1:])
    lines = ["# Benchmarks: graphckpt against what people use today", "",
             f"Measured {datetime.date.today()} on {machine_line(options.device)}, by `{command.strip()}`. "
             f"graphckpt's plans minimise recomputed {'measured op time' if options.cost == 'time' else 'FLOPs'} "
             f"(`cost={options.cost!r}`). Peak is the profiler's memory timeline of one training step after a "
             f"warm-up (activations and temporaries, not parameters); step time is the median of {options.steps} "
             "interleaved rounds, each starting at the next variant, with "
             f"{_allocator(options)}. "
             "Time ratios are the median of each round's step over eager's step in that round; the targets "
             "compare two variants' steps round by round (median, 95% bootstrap interval). "
             "*× eager, default allocator* is the same ratio from a second process with glibc's default "
             f"allocator ({options.default_allocator_steps} rounds; models "
             f"{options.default_allocator_models.replace(',', ', ')}), where freed memory goes back to the OS "
             "and minor page faults decide step times; "
             "*faults / step* are the minor page faults of a timed step in this run. "
             "*simulated* is graphckpt's own prediction of the peak; *extra time* is what graphckpt's cost model "
             "predicts its plan adds to eager's step (measured op times of what it reruns, and the checkpoint "
             "calls' own cost) against, on a CPU, the time spent inside its recomputes in a profiled step, and the "
             "measured median difference of steps; *build* is capture + costs + plan + "
             "codegen (or compile time).", "", _load_line(options), "", "## Targets", ""]
    lines += [verdict.markdown() for verdict in targets(results)]
    for case in cases:
        if case.name not in results:
            continue
        lines += ["", f"## {case.name}", "", case.description, "", results_table(results[case.name], skipped[case.name])]
        if out is not None:
            png = out.with_name(f"{out.stem}_{case.name}.png")
            plot_pareto(results[case.name], png, f"{case.name}: measured peak vs step time")
            lines += ["", f"![{case.name}: peak memory against step time]({png.name})"]
    lines += ["", "## Also measured", "", *ELSEWHERE]
    return "\n".join(lines) + "\n"


def default_allocator_ratios(options: argparse.Namespace, models: list[str]) -> dict[str, dict[str, float]]:
    """Every variant's time ratio to eager, measured by this script in a child process that
    keeps glibc's default allocator (its own capture, plans and rounds)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "ratios.json"
        models = [m for m in models if m in options.default_allocator_models.split(",")]
        command = [sys.executable, __file__, "--default-allocator", "--json", str(out), "--models", ",".join(models),
                   "--steps", str(options.default_allocator_steps), "--cost", options.cost, "--device", options.device,
                   *(["--tiny"] if options.tiny else []), *(["--gpu-sizes"] if options.gpu_sizes else []),
                   *(["--inductor"] if options.inductor else [])]
        environment = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        subprocess.run(command, check=True, env=environment, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def merge_default_allocator(results: dict[str, list[Result]], ratios: dict[str, dict[str, float]]) -> None:
    """Put the default allocator's ratio of each variant beside this run's."""
    for model, found in results.items():
        for result in found:
            result.default_time_ratio = ratios.get(model, {}).get(result.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated subset of the models (default: all)")
    parser.add_argument("--steps", type=int, default=5, help="interleaved timing rounds (median reported)")
    parser.add_argument("--tiny", action="store_true", help="tiny models, for a smoke test")
    parser.add_argument("--gpu-sizes", action="store_true",
                        help="models big enough that a GPU step waits on kernels, not on Python (with --device cuda)")
    parser.add_argument("--inductor", action="store_true", help="also measure torch.compile with inductor")
    parser.add_argument("--cost", choices=("flops", "time"), default="time", help="what graphckpt minimises")
    parser.add_argument("--out", type=Path, help="write the markdown here and a Pareto PNG per model beside it")
    parser.add_argument("--default-allocator", action="store_true",
                        help="time with glibc's default allocator (freed memory goes back to the OS)")
    parser.add_argument("--device", default="cpu", help="where the models run: cpu, or cuda")
    parser.add_argument("--default-allocator-steps", type=int, default=0,
                        help="also time every variant this many rounds in a second process with glibc's "
                             "default allocator, for its own column (0: not)")
    parser.add_argument("--default-allocator-models", default="mlp,gpt2",
                        help="the models the default-allocator column is measured for (it repeats their builds)")
    parser.add_argument("--json", type=Path, help="write each variant's time ratio here (the second process's output)")
    options = parser.parse_args(argv)
    if argv is None and not options.default_allocator:  # run as a script, not called from a test
        rerun_with_retaining_allocator()
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold cache: the build column is a first compile
        cache = tempfile.mkdtemp(prefix="graphckpt-bench-inductor-")  # as a user sees it; gone at exit
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    cases = TINY if options.tiny else GPU_SIZES if options.gpu_sizes else FULL
    wanted = [m for m in options.models.split(",") if m]
    unknown = set(wanted) - {c.name for c in cases}
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {[c.name for c in cases]}")
    cases = [c for c in cases if not wanted or c.name in wanted]
    if options.default_allocator and options.json is not None:  # the second process: only the column's models
        cases = [c for c in cases if c.name in options.default_allocator_models.split(",")]
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[Result]] = {}
    skipped: dict[str, list[Any]] = {}
    started_load = os.getloadavg()[0]
    # The default allocator's process runs first: this one keeps its high-water mark for good
    # (the retaining allocator), and the two at once outgrew 24 GiB (OOM-killed, 2026-11-23).
    default_ratios = (default_allocator_ratios(options, [c.name for c in cases])
                      if options.default_allocator_steps and not options.default_allocator else None)
    for case in cases:
        start = time.perf_counter()
        results[case.name], skipped[case.name] = run_case(case, options)
        print(f"{case.name}: measured {len(results[case.name])} variants in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
    if options.json is not None:
        options.json.write_text(json.dumps({m: {r.name: r.time_ratio for r in found} for m, found in results.items()}))
    if default_ratios is not None:
        merge_default_allocator(results, default_ratios)
    options.load_average = (started_load, os.getloadavg()[0])
    text = document(cases, results, skipped, options, options.out)
    if options.out is None:
        print(text)
    else:
        options.out.write_text(text)
        print(f"wrote {options.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
