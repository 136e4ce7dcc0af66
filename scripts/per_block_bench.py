"""graphckpt against ``gradient_checkpointing_enable()`` at per-block's own memory.

    python scripts/per_block_bench.py [--models gpt2,llama] [--rounds 40] [--out docs/per_block.md]

For each Hugging Face model, in one process with an allocator that keeps freed memory (the
script re-runs itself with it; ``--default-allocator`` opts out): per-block checkpointing as
Hugging Face does it, measured; then graphckpt with ``budget=`` per-block's measured peak,
planned with FLOPs and with measured op times, and graphckpt's own ``blocks`` strategy. Each
is measured (peak after a warm-up step) and timed head to head against per-block: one step
each per round, order alternating, the median ratio with a 95% bootstrap interval, and minor
page faults per step. Issue 14's target: at per-block's peak, step ≤ 1.00x per-block's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from graphckpt.tools.anchors import Variant, block_anchor
from graphckpt.tools.bench import measured_peak, model_costs, planned_variant
from graphckpt.tools.bench_report import machine_line
from graphckpt.tools.console import quiet_profiler
from graphckpt.tools.hf_zoo import BENCHMARK_MODELS as MODELS
from graphckpt.tools.measure import on_device, training_step
from graphckpt.tools.pairs import allocator_retains, head_to_head, rerun_with_retaining_allocator


def _say(message: str) -> None:
    """Progress on stdout: stderr is held back while the profiler's noise is filtered."""
    print(f"  {time.strftime('%H:%M:%S')} {message}", flush=True)


def compare(name: str, rounds: int, device: str = "cpu") -> list[str]:
    """Table rows for one model on ``device``: each graphckpt variant against per-block, same process."""
    description, build = MODELS[name]
    model, inputs, loss = build()
    model, inputs = model.to(device), on_device(inputs, device)
    anchor = block_anchor(model, inputs)
    if not isinstance(anchor, Variant):
        raise SystemExit(f"{name}: per-block checkpointing unavailable: {anchor.reason}")
    eager_peak = measured_peak(model, inputs, loss)
    block_peak = measured_peak(anchor.module, inputs, loss)
    rows = [f"| {description} | per-block ({anchor.setting}) | {block_peak / 2**20:.1f} MiB | "
            f"{block_peak / eager_peak:.2f} | 1.00 | 1.00 | |"]
    variants = []
    for cost in ("flops", "time"):
        modelled = model_costs(model, inputs, cost)
        variants.append((f"budget = per-block's peak, cost={cost}",
                         planned_variant(modelled, budget=block_peak)))
        if cost == "flops":
            variants.append(("strategy=blocks", planned_variant(modelled, "blocks")))
    for label, variant in variants:
        _say(f"{name}: {label}")
        if not isinstance(variant, Variant):
            rows.append(f"| {description} | {label} | {variant.reason} | | | | |")
            continue
        peak = measured_peak(variant.module, inputs, loss)
        pair = head_to_head(training_step(variant.module, inputs, loss), training_step(anchor.module, inputs, loss),
                            rounds)
        low, high = pair.interval()
        rows.append(f"| {description} | {label} ({variant.plan.strategy}, {len(variant.plan.segments)} segments) | "
                    f"{peak / 2**20:.1f} MiB | {peak / eager_peak:.2f} | {peak / block_peak:.2f} | "
                    f"{pair.median:.3f} [{low:.3f}, {high:.3f}] | "
                    f"{pair.faults_per_step[0]:.0f} / {pair.faults_per_step[1]:.0f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama", help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--rounds", type=int, default=40, help="head-to-head rounds per variant")
    parser.add_argument("--out", type=Path, help="write the markdown table here as well")
    parser.add_argument("--device", default="cpu", help="where the models run: cpu, or cuda")
    parser.add_argument("--default-allocator", action="store_true",
                        help="time with glibc's default allocator (freed memory goes back to the OS)")
    options = parser.parse_args()
    if not options.default_allocator:
        rerun_with_retaining_allocator()
    rows = ["| model | variant | measured peak | vs eager | vs per-block | step / per-block's (median, 95% CI) "
            "| minor faults per step (ours / per-block) |", "|---|---|---:|---:|---:|---:|---:|"]
    with quiet_profiler():
        for name in options.models.split(","):
            rows += compare(name, options.rounds, options.device)
    allocator = "retaining allocator" if allocator_retains() else "default allocator"
    text = "\n".join([f"{machine_line(options.device)}; {allocator}; "
                      f"{options.rounds} paired rounds per row", "", *rows])
    print(text)
    if options.out:
        options.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
