"""The ``graphckpt`` command. Only ``demo`` exists so far; ``inspect``, ``compare``,
``bench`` and ``pareto`` are planned (issue 4) and say so when run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

PLANNED = ("inspect", "compare", "bench", "pareto")


def demo(steps: int = 3) -> None:
    """Rewrite a zoo transformer, show its cut, train a few steps with and without it."""
    import torch

    import graphckpt
    from graphckpt import zoo
    from graphckpt.measure import measure_step

    torch.manual_seed(0)
    model, inputs = zoo.make("gpt", batch=8, layers=8, d=128, heads=4, seq=128, dropout=0.1)
    print(f"model: zoo GPT, 8 layers, d=128, seq 128, batch 8 ({sum(p.numel() for p in model.parameters()):,} parameters)")
    rewritten = graphckpt.rewrite(model, inputs)
    plan = rewritten.meta["graphckpt_plan"]
    print(plan)
    eager = measure_step(model, inputs, zoo.scalar_loss, repeats=steps)
    ours = measure_step(rewritten, inputs, zoo.scalar_loss, repeats=steps)
    print(f"\n{'':10s}{'measured peak':>16s}{'step time':>12s}")
    print(f"{'eager':10s}{eager.peak_bytes / 2**20:13.1f} MiB{eager.step_seconds * 1e3:9.0f} ms")
    print(f"{'graphckpt':10s}{ours.peak_bytes / 2**20:13.1f} MiB{ours.step_seconds * 1e3:9.0f} ms")
    print(f"ratio: peak {ours.peak_bytes / eager.peak_bytes:.2f}x eager, step time "
          f"{ours.step_seconds / eager.step_seconds:.2f}x eager")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphckpt", description="Automatic gradient checkpointing.")
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="rewrite a zoo transformer and measure it")
    run_demo.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    for name in PLANNED:
        commands.add_parser(name, help="not available yet (planned)")
    options = parser.parse_args(argv)
    if options.command in PLANNED:
        print(f"graphckpt {options.command}: not available yet; it is planned (see the issue "
              "tracker). Use graphckpt.plan(model, inputs) from Python meanwhile.", file=sys.stderr)
        return 2
    demo(options.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
