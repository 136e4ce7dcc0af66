"""Why a plan is slower than an anchor at the same memory: more GPU work, or the GPU left idle.

    python scripts/step_breakdown.py --device cuda --models llama-1k [--rounds 9] [--out F.md]

For each model, in one process with a retaining allocator: eager; torch.compile (aot_eager)
with ``activation_memory_budget`` 0.5 and 0.35 and per-block checkpointing, each measured;
graphckpt planned at each anchor's measured peak with FLOPs and with measured op times.
Every variant's step is profiled (:func:`graphckpt.tools.step_profile.profile_step`, the
median of three profiled steps): kernel time, GPU idle time, kernels launched, ATen calls,
host time inside graphckpt's recomputes and remakes; each graphckpt plan is timed head to
head against its anchor (paired rounds, order alternating, median with a 95% bootstrap
interval). On a CPU the kernel columns are empty, and the time the cost model predicts a
plan adds (``cost="time"``) stands beside the host's time inside its recomputes: on a CPU the
recomputes' kernels are that host time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from graphckpt.tools.anchors import Variant, block_anchor, compile_anchor
from graphckpt.tools.bench import measured_peak, model_costs, planned_variant
from graphckpt.tools.bench_report import machine_line
from graphckpt.tools.console import quiet_profiler
from graphckpt.tools.hf_zoo import BENCHMARK_MODELS as MODELS
from graphckpt.tools.measure import infer_device, on_device, training_step
from graphckpt.tools.pairs import head_to_head, rerun_with_retaining_allocator
from graphckpt.tools.step_profile import StepProfile, profile_step

HEADER = ["| model | variant | peak / eager's | step / anchor's (median, 95% CI) | kernel time | GPU idle | kernels "
          "| ATen calls | host in recomputes | extra over eager: predicted / kernel (a CPU: predicted) |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _row(model: str, variant: str, peak_ratio: float, versus: str, profile: StepProfile, extra: str) -> str:
    kernel = (_ms(profile.kernel_seconds), _ms(profile.idle_seconds)) if profile.kernels else ("", "")
    recomputing = _ms(profile.recompute_host_seconds) if profile.recompute_host_seconds else ""
    return (f"| {model} | {variant} | {peak_ratio:.3f} | {versus} | {kernel[0]} | {kernel[1]} | {profile.kernels} "
            f"| {profile.aten_calls} | {recomputing} | {extra} |")


def breakdown(name: str, rounds: int, device: str, costs: tuple[str, ...] = ("flops", "time")) -> list[str]:
    """Table rows for one model: each anchor, then graphckpt's plans at its measured peak."""
    model, inputs, loss = MODELS[name][1]()
    model, inputs = model.to(device), on_device(inputs, device)
    where = infer_device(model, inputs)
    eager_peak = measured_peak(model, inputs, loss)
    eager = profile_step(training_step(model, inputs, loss), where)
    rows = [_row(name, "eager", 1.0, "", eager, "")]
    anchors = [compile_anchor(model, inputs, budget, loss) for budget in (0.5, 0.35)] + [block_anchor(model, inputs)]
    modelled = {cost: model_costs(model, inputs, cost) for cost in costs}
    for anchor in anchors:
        if not isinstance(anchor, Variant):
            rows.append(f"| {name} | {anchor.name} | not measured: {anchor.reason} | | | | | | | |")
            continue
        anchor_step = training_step(anchor.module, inputs, loss)
        anchor_peak = measured_peak(anchor.module, inputs, loss)
        rows.append(_row(name, anchor.name, anchor_peak / eager_peak, "1", profile_step(anchor_step, where), ""))
        for cost, costed in modelled.items():
            label = f"graphckpt at {anchor.name}'s peak, cost={cost}"
            print(f"  {time.strftime('%H:%M:%S')} {name}: {label}", flush=True)
            ours = planned_variant(costed, budget=anchor_peak, name=label)
            if not isinstance(ours, Variant):
                rows.append(f"| {name} | {label} | not measured: {ours.reason} | | | | | | | |")
                continue
            step = training_step(ours.module, inputs, loss)
            profile = profile_step(step, where)
            pair = head_to_head(step, anchor_step, rounds)
            low, high = pair.interval()
            predicted = _ms(ours.predicted_extra_seconds) if ours.predicted_extra_seconds is not None else "-"
            extra = f"{predicted} / {_ms(profile.kernel_seconds - eager.kernel_seconds)}" if profile.kernels \
                else predicted  # a CPU: what it predicts the recomputes take, beside host in recomputes
            rows.append(_row(name, f"{label} ({len(ours.plan.segments)} segments)",
                             measured_peak(ours.module, inputs, loss) / eager_peak,
                             f"{pair.median:.3f} [{low:.3f}, {high:.3f}]", profile, extra))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama", help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--rounds", type=int, default=9, help="head-to-head rounds per graphckpt plan")
    parser.add_argument("--device", default="cpu", help="where the models run: cpu, or cuda")
    parser.add_argument("--out", type=Path, help="write the markdown table here as well")
    options = parser.parse_args()
    rerun_with_retaining_allocator()
    rows = list(HEADER)
    with quiet_profiler():
        for name in options.models.split(","):
            rows += breakdown(name, options.rounds, options.device)
    text = "\n".join([f"{machine_line(options.device)}; retaining allocator; {options.rounds} paired rounds per "
                      "graphckpt row; each row's profile the median of three profiled steps", "", *rows])
    print(text)
    if options.out:
        options.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
