"""Measured peak and step time of every zoo model x strategy, as ratios to eager.

    python scripts/zoo_table.py [--repeats 5] > table.md

Eager and each rewrite are measured in the same process by graphckpt.bench.measure_variants:
peak memory with graphckpt.measure (CPU: profiler memory timeline, after a warm-up step);
step time as the median of --repeats rounds, each round timing one step of every variant in
turn (interleaved, so load on the machine hits all variants alike).
"""

from __future__ import annotations

import argparse

import torch

from graphckpt import zoo
from graphckpt.bench import eager_variant, measure_variants, strategy_variant

SIZES = {
    "mlp": {"depth": 32, "width": 256, "batch": 512},
    "resnet": {"batch": 16},
    "gpt": {"batch": 8},
    "unet": {"batch": 8},
    "densenet": {"batch": 16},
}
STRATEGIES = ("sqrt", "articulation", "mincut", "auto", "optimal")


def rows(repeats: int):
    for name, size in SIZES.items():
        model, inputs = zoo.make(name, **size)
        variants = [eager_variant(model), *(strategy_variant(model, inputs, s) for s in STRATEGIES)]
        eager, *results = measure_variants(variants, inputs, zoo.scalar_loss, steps=repeats)
        for strategy, variant, result in zip(STRATEGIES, variants[1:], results, strict=True):
            yield (name, strategy, variant.plan.strategy, eager.peak_bytes, result.peak_ratio,
                   variant.plan.peak_bytes / max(result.peak_bytes, 1), result.time_ratio)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    options = parser.parse_args()
    torch.manual_seed(0)
    print("| model | strategy | used | eager peak | peak vs eager | simulated / measured | step time vs eager |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, strategy, used, eager, peak, simulated, step in rows(options.repeats):
        print(f"| {name} | {strategy} | {used} | {eager / 2**20:.1f} MiB | {peak:.2f}x | {simulated:.2f} | {step:.2f}x |")


if __name__ == "__main__":
    main()
