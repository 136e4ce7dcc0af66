"""Budget 0.25 on a 32-layer MLP chain: optimal against checkpoint_sequential(6), same run.

Also ``optimal`` at checkpoint_sequential's own measured peak: the two at equal memory.

    python scripts/budget_bench.py [--budget 0.25] [--batch 4096] [--steps 11]

The chain is 32 x (Linear 256 + GELU). Eager, ``graphckpt.rewrite(model, x, budget=...)``
and ``torch.utils.checkpoint.checkpoint_sequential`` with 6 segments are measured in one
process by :func:`graphckpt.tools.bench.measure_variants`: peak from the profiler's memory timeline
after a warm-up step, step time as the median of interleaved rounds (each starting at the
next variant). Ratios are to eager, round by round. Then ours and checkpoint_sequential
go head to head: one step each per round, back to back, and the median of our step over
theirs with a bootstrap interval (this VM's speed drifts by tens of percent between runs).
"""

from __future__ import annotations

import argparse

import torch

from graphckpt.tools import zoo
from graphckpt.tools.anchors import Variant, sequential_anchor
from graphckpt.tools.bench import eager_variant, measure_variants, measured_peak, model_costs, planned_variant
from graphckpt.tools.measure import training_step
from graphckpt.tools.pairs import head_to_head, rerun_with_retaining_allocator
from passes.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--segments", type=int, default=6, help="checkpoint_sequential's segment count")
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=60, help="head-to-head rounds against checkpoint_sequential")
    parser.add_argument("--cost", choices=("flops", "time"), default="flops",
                        help="what the optimal pass minimises: recomputed FLOPs or measured op time")
    parser.add_argument("--default-allocator", action="store_true",
                        help="time with glibc's default allocator (freed memory goes back to the OS)")
    options = parser.parse_args()
    if not options.default_allocator:
        rerun_with_retaining_allocator()
    torch.manual_seed(0)
    model, inputs = zoo.make("mlp", depth=32, width=256, batch=options.batch)
    modelled = model_costs(model, inputs, options.cost)  # one capture for both plans
    ours = planned_variant(modelled, budget=options.budget)
    planned = ours.plan_seconds if isinstance(ours, Variant) else 0.0
    anchor = sequential_anchor(model, inputs, options.segments)
    variants = [eager_variant(model), ours, anchor]
    if isinstance(anchor, Variant):  # and ours at the anchor's own measured peak: equal memory
        same = measured_peak(anchor.module, inputs, zoo.scalar_loss)  # after a warm-up step
        eager = measured_peak(model, inputs, zoo.scalar_loss)
        variants.append(planned_variant(modelled, budget=min(1.0, same / eager)))
    for skipped in [v for v in variants if not isinstance(v, Variant)]:
        raise SystemExit(f"{skipped.name}: {skipped.reason}")
    results = measure_variants(variants, inputs, zoo.scalar_loss, steps=options.steps)
    print(f"32 x (Linear 256 + GELU), batch {options.batch}, {torch.get_num_threads()} threads, cost {options.cost}; "
          f"graphckpt planned in {planned:.1f} s (capture, costs, plan, codegen)\n")
    print("| variant | measured peak | vs eager | simulated | step time | vs eager |")
    print("|---|---:|---:|---:|---:|---:|")
    for result in results:
        simulated = format_bytes(result.simulated_peak_bytes, "MiB") if result.simulated_peak_bytes else ""
        print(f"| {result.name} | {format_bytes(result.peak_bytes, 'MiB')} | {result.peak_ratio:.2f}x | {simulated} | "
              f"{result.step_seconds * 1e3:.0f} ms | {result.time_ratio:.2f}x |")
    pair = head_to_head(training_step(variants[1].module, inputs, zoo.scalar_loss),
                        training_step(anchor.module, inputs, zoo.scalar_loss), options.rounds)
    print(f"\nHead to head, {len(pair.ratios)} rounds of one step each, order alternating: "
          f"{pair.summary(variants[1].name, anchor.name)}")
    plan = variants[1].plan
    print(f"\n{plan}")


if __name__ == "__main__":
    main()
