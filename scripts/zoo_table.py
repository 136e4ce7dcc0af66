"""Measured peak and step time of every zoo model x strategy, as ratios to eager.

    python scripts/zoo_table.py [--repeats 5] > table.md

Eager and each rewrite are measured in the same process: peak memory with
graphckpt.measure (CPU: profiler memory timeline, after a warm-up step); step time as the
median of --repeats rounds, each round timing one step of every variant in turn
(interleaved, so load on the machine hits all variants alike).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import graphckpt
from graphckpt import zoo
from graphckpt.measure import measure_step, training_step

SIZES = {
    "mlp": {"depth": 32, "width": 256, "batch": 512},
    "resnet": {"batch": 16},
    "gpt": {"batch": 8},
    "unet": {"batch": 8},
    "densenet": {"batch": 16},
}
STRATEGIES = ("sqrt", "articulation", "mincut", "auto", "optimal")


def interleaved_step_times(modules: list, inputs: tuple, repeats: int) -> list[float]:
    """Median seconds per training step of each module, timed round-robin."""
    steps = [training_step(m, inputs, zoo.scalar_loss) for m in modules]
    for step in steps:
        step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for index, step in enumerate(steps):
            start = time.perf_counter()
            step()
            times[index].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def rows(repeats: int):
    for name, size in SIZES.items():
        model, inputs = zoo.make(name, **size)
        rewritten = [graphckpt.rewrite(model, inputs, strategy=s) for s in STRATEGIES]
        peaks = [measure_step(m, inputs, zoo.scalar_loss, repeats=1).peak_bytes for m in [model, *rewritten]]
        seconds = interleaved_step_times([model, *rewritten], inputs, repeats)
        for index, strategy in enumerate(STRATEGIES, start=1):
            plan = rewritten[index - 1].meta["graphckpt_plan"]
            yield (name, strategy, plan.strategy, peaks[0], peaks[index] / peaks[0],
                   plan.peak_bytes / max(peaks[index], 1), seconds[index] / seconds[0])


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
