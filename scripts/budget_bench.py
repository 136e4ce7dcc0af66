"""Budget 0.25 on a 32-layer MLP chain: optimal against checkpoint_sequential(6), same run.

Also ``optimal`` at checkpoint_sequential's own measured peak: the two at equal memory.

    python scripts/budget_bench.py [--budget 0.25] [--batch 4096] [--steps 11]

The chain is 32 x (Linear 256 + GELU). Eager, ``graphckpt.rewrite(model, x, budget=...)``
and ``torch.utils.checkpoint.checkpoint_sequential`` with 6 segments are measured in one
process by :func:`graphckpt.bench.measure_variants`: peak from the profiler's memory timeline
after a warm-up step, step time as the median of interleaved rounds (each starting at the
next variant). Ratios are to eager, round by round; the last line compares ours with
checkpoint_sequential round by round.
"""

from __future__ import annotations

import argparse

import torch

from graphckpt import zoo
from graphckpt.anchors import Variant, sequential_anchor
from graphckpt.bench import eager_variant, measure_variants, measured_peak, model_costs, paired_ratio, planned_variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--segments", type=int, default=6, help="checkpoint_sequential's segment count")
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--cost", choices=("flops", "time"), default="flops",
                        help="what the optimal pass minimises: recomputed FLOPs or measured op time")
    options = parser.parse_args()
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
        simulated = f"{result.simulated_peak_bytes / 2**20:.1f} MiB" if result.simulated_peak_bytes else ""
        print(f"| {result.name} | {result.peak_bytes / 2**20:.1f} MiB | {result.peak_ratio:.2f}x | {simulated} | "
              f"{result.step_seconds * 1e3:.0f} ms | {result.time_ratio:.2f}x |")
    ours_times, anchor_times = results[1].times, results[2].times
    faster = sum(o <= a for o, a in zip(ours_times, anchor_times, strict=True))
    print(f"\n{results[1].name} over {results[2].name}, round by round: median "
          f"{paired_ratio(ours_times, anchor_times):.3f}x; no slower in {faster} of {len(ours_times)} rounds")
    plan = variants[1].plan
    print(f"\n{plan}")


if __name__ == "__main__":
    main()
