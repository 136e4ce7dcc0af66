"""Measured peak and step time of every zoo model x strategy, as ratios to eager.

    python scripts/zoo_table.py [--repeats 5] > table.md

Eager and each rewrite are measured in the same process, one after the other, with
graphckpt.measure (CPU: profiler memory timeline; step time: median of --repeats steps).
"""

from __future__ import annotations

import argparse

import torch

import graphckpt
from graphckpt import zoo
from graphckpt.measure import measure_step

SIZES = {
    "mlp": {"depth": 32, "width": 256, "batch": 512},
    "resnet": {"batch": 16},
    "gpt": {"batch": 8},
    "unet": {"batch": 8},
    "densenet": {"batch": 16},
}
STRATEGIES = ("sqrt", "articulation", "mincut", "auto")


def rows(repeats: int):
    for name, size in SIZES.items():
        model, inputs = zoo.make(name, **size)
        eager = measure_step(model, inputs, zoo.scalar_loss, repeats=repeats)
        for strategy in STRATEGIES:
            rewritten = graphckpt.rewrite(model, inputs, strategy=strategy)
            plan = rewritten.meta["graphckpt_plan"]
            ours = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=repeats)
            yield (name, strategy, plan.strategy, eager.peak_bytes, ours.peak_bytes / eager.peak_bytes,
                   plan.peak_bytes / max(ours.peak_bytes, 1), ours.step_seconds / eager.step_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    torch.manual_seed(0)
    print("| model | strategy | used | eager peak | peak vs eager | simulated / measured | step time vs eager |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, strategy, used, eager, peak, simulated, time in rows(options.repeats):
        print(f"| {name} | {strategy} | {used} | {eager / 2**20:.1f} MiB | {peak:.2f}x | {simulated:.2f} | {time:.2f}x |")


if __name__ == "__main__":
    main()
