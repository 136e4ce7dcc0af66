"""The model corpus report: every promise checked on real architectures, one row per entry.

    python scripts/corpus.py --out docs/corpus.md            # the whole corpus (a few minutes, 2 cores)
    python scripts/corpus.py --entries gpt2,resnet           # a subset, printed
    python scripts/corpus.py --device cuda --out docs/corpus_cuda.md   # the same promises on a GPU
    python scripts/corpus.py --autocast bfloat16 --out docs/corpus_autocast.md   # planned and stepped under autocast

For each entry of ``tests/corpus`` (tiny random configs, dropout on, train mode, the model's
own loss): eager's measured peak; the floor (the smallest simulated peak any plan reaches, as
``BudgetError`` names it); for ``strategy="auto"``, budgets 0.5 and 0.3 of eager's simulated
peak and a budget at the floor, the simulated and the measured peak; per-block checkpointing
(HF ``gradient_checkpointing_enable()`` where the model supports it) measured; and which of
the promises ``tests/test_corpus.py`` checks fail, and how. Peaks are measured with
:func:`graphckpt.tools.bench.measured_peak` (a warm-up step, then the profiler's memory timeline).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/corpus is not installed with the package

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from graphckpt.tools.bench_report import machine_line  # noqa: E402
from passes.budget import BudgetError  # noqa: E402
from passes.units import format_bytes  # noqa: E402
from tests.corpus import ENTRIES  # noqa: E402
from tests.corpus import harness as h  # noqa: E402
from tests.equivalence import assert_steps_alike, assert_trains_like  # noqa: E402


@dataclass
class Outcome:
    """One setting of one entry: simulated and measured peak, or why there is no plan."""

    setting: h.Setting
    simulated: int | None = None
    measured: int | None = None
    budget: int | None = None
    infeasible: str | None = None


@dataclass
class Row:
    """Everything the report says about one entry; ``failures`` lists broken promises."""

    name: str
    family: str
    capture: str
    eager: int = 0
    eager_simulated: int = 0
    floor: int | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    per_block: int | None = None
    per_block_note: str = ""
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    captured_step: str | None = None  # what a step of the captured program does unlike the model's


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:160] if lines else ''}"


def _differs(check: Callable[[], None]) -> str | None:
    """None when ``check`` passes, else the first line of what differs (or what raised)."""
    try:
        check()
    except Exception as error:  # a report row, not a crash: say what failed
        return _first_line(error)
    return None


def _tolerance(prepared: h.Prepared) -> dict[str, float]:
    return h.AUTOCAST_TOLERANCE if prepared.autocast else {}


def _model_step(prepared: h.Prepared, module: nn.Module) -> str | None:
    """None when one seeded training step of ``module`` (sharing the entry model's tensors)
    equals the model's own, else the first line of what differs."""
    prepared.model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(prepared.model)

    def check() -> None:
        with h.entry_autocast(prepared):  # forward and backward: the same for both
            assert_trains_like(reference, prepared.model, module, prepared.args, prepared.kwargs,
                               **_tolerance(prepared))
    return _differs(check)


def _captured_step(prepared: h.Prepared, row: Row) -> str:
    """What differs between a step of the captured program, run as it is, and the model's
    own ("" when nothing): measured once per entry. Export may trace a branch eager does not
    take (Hugging Face materializes attention masks under tracing)."""
    if row.captured_step is None:
        row.captured_step = _model_step(prepared, prepared.captured.graph_module) or ""
    return row.captured_step


def _trains_like(prepared: h.Prepared, row: Row, plan) -> str | None:
    """None when one seeded training step of the rewrite equals the model's, or equals the
    captured program's where that already differs from the model's (reported once for the
    entry, :func:`_captured_step`); else the first line of what differs (or what raised)."""
    try:
        module = h.rewritten(prepared, plan)
    except Exception as error:  # a report row, not a crash
        return _first_line(error)
    keys, expected = set(module.state_dict()), set(prepared.model.state_dict())
    if keys != expected:
        return f"state_dict keys differ: {sorted(keys ^ expected)[:3]}"
    differs = _model_step(prepared, module)
    if differs is None or not _captured_step(prepared, row):
        return differs

    def like_captured() -> None:
        with h.entry_autocast(prepared):
            assert_steps_alike(prepared.model, prepared.captured.graph_module, module, prepared.args,
                               prepared.kwargs, **_tolerance(prepared))
    return differs if _differs(like_captured) else None


def _outcome(prepared: h.Prepared, row: Row, setting: h.Setting) -> Outcome:
    """Plan, check and measure ``setting``; broken promises go to ``row.failures``."""
    outcome = Outcome(setting)
    if setting != "auto":
        outcome.budget = h.budget_bytes(prepared, setting)
    try:
        plan = h.plan_for(prepared, setting)
    except BudgetError as error:
        outcome.infeasible = error.reason
        floor = error.smallest_peak_bytes
        if floor is None or floor <= outcome.budget:
            row.failures.append(f"{setting}: BudgetError without a floor above the budget ({error})")
        return outcome
    outcome.simulated = plan.peak_bytes
    differs = _trains_like(prepared, row, plan)
    if differs:
        row.failures.append(f"{setting}: not the model's step: {differs}")
    try:
        outcome.measured = h.measure(prepared, h.rewritten(prepared, plan))
    except Exception as error:  # a report row, not a crash
        row.failures.append(f"{setting}: measuring failed: {_first_line(error)}")
        return outcome
    if outcome.measured > row.eager:
        row.failures.append(f"{setting}: measured {outcome.measured / row.eager:.3f}x eager's measured peak")
    if outcome.budget is not None and outcome.measured > h.BUDGET_SLACK * outcome.budget:
        row.failures.append(f"{setting}: measured {outcome.measured / outcome.budget:.3f}x its budget "
                            f"(simulated {outcome.simulated / outcome.budget:.3f}x)")
    return outcome


def evaluate(name: str, device: str = "cpu", autocast: torch.dtype | None = None) -> Row:
    """The report row of corpus entry ``name`` on ``device``: capture, plans, checks and
    measurements (planned, checked and stepped under ``autocast``, if given)."""
    entry = ENTRIES[name]
    start = time.perf_counter()
    row = Row(name, entry.family, entry.capture)
    try:
        prepared = h.prepare(entry, device=device, autocast=autocast)
    except Exception as error:  # a report row, not a crash
        row.failures.append(f"capture: {_first_line(error)}")
        return row
    row.capture = prepared.captured.method
    row.eager = h.measure(prepared, prepared.model)
    row.eager_simulated = prepared.eager_simulated
    row.floor = h.floor_bytes(prepared)
    row.outcomes = [_outcome(prepared, row, setting) for setting in h.SETTINGS]
    row.per_block, row.per_block_note = h.per_block(prepared)
    if row.captured_step:
        row.failures.append(f"captured program: steps unlike the model, and every plan like it: {row.captured_step}")
    row.seconds = time.perf_counter() - start
    return row


# ---------------------------------------------------------------- markdown


def _mib(value: int | None) -> str:
    return "—" if value is None else format_bytes(value, "MiB")


def _cell(outcome: Outcome, eager: int) -> str:
    """``simulated / measured (measured x eager)``, or why there is no plan."""
    if outcome.infeasible is not None:
        return "below the floor"
    ratio = f" ({outcome.measured / eager:.2f}x)" if outcome.measured and eager else ""
    return f"{_mib(outcome.simulated)} / {_mib(outcome.measured)}{ratio}"


def _row_line(row: Row) -> str:
    cells = [row.name, row.family, row.capture,
             f"{_mib(row.eager)} (sim {_mib(row.eager_simulated)})" if row.eager else "—",
             f"{_mib(row.floor)} ({row.floor / row.eager_simulated:.2f}x)" if row.floor and row.eager_simulated
             else _mib(row.floor)]
    cells += [_cell(outcome, row.eager) for outcome in row.outcomes] or ["—"] * len(h.SETTINGS)
    cells.append(f"{_mib(row.per_block)} ({row.per_block / row.eager:.2f}x)" if row.per_block and row.eager
                 else "n/a")
    cells.append("pass" if not row.failures else f"**{len(row.failures)} failed**")
    return "| " + " | ".join(cells) + " |"


_KINDS = {"not the model's step": "a step differing from the model's", "eager's measured": "a peak above eager's",
          "its budget": "a budget missed by more than 3%", "BudgetError without": "a BudgetError not naming its floor",
          "measuring failed": "a step that failed to run", "capture:": "no capture",
          "captured program": "a captured program stepping unlike the model (the plans step like it)"}


def _summary(rows: list[Row]) -> str:
    """How many entries keep every promise, and how many break each kind of promise."""
    counts = {label: sum(any(key in failure for failure in row.failures) for row in rows)
              for key, label in _KINDS.items()}
    broken = ", ".join(f"{count} with {label}" for label, count in counts.items() if count)
    passing = sum(not row.failures for row in rows)
    return f"{passing} of {len(rows)} entries keep every promise" + (f"; {broken}." if broken else ".")


def markdown(rows: list[Row], seconds: float, device: str = "cpu", autocast: str | None = None) -> str:
    """The report: how it was made, the table, then every failure in words."""
    settings = " | ".join(f"{s}: sim / measured" if s != "floor" else "at the floor: sim / measured"
                          for s in h.SETTINGS)
    yardstick = ("profiler memory timeline" if device == "cpu"
                 else "`torch.cuda.max_memory_allocated` above what was allocated before the step")
    options = ("" if device == "cpu" else f" --device {device}") + (f" --autocast {autocast}" if autocast else "")
    suffix = ("" if device == "cpu" else f"_{device}") + ("_autocast" if autocast else "")
    under = (f" Every entry is planned under `torch.autocast(dtype=torch.{autocast})` (capture and costs inside "
             "it, as a user training with it calls `rewrite`) and stepped with its forward under it, backward "
             "outside (the check that a plan's step is the model's runs both entirely under it).") if autocast else ""
    lines = [
        "# Model corpus: graphckpt's promises on real architectures" + (f", under {autocast} autocast" if autocast else ""),
        "",
        f"Generated by `python scripts/corpus.py{options} --out docs/corpus{suffix}.md` on {datetime.date.today()} "
        f"in {seconds / 60:.1f} min: {machine_line(device)}, transformers {transformers.__version__}.{under}",
        "",
        "Each entry is a tiny random config (tests/corpus/, no downloads) in training mode with dropout at its "
        "default, stepped on its own loss. Peaks are activation memory in one training step after a "
        f"warm-up step ({yardstick}); *sim* is the simulator's prediction, *measured* the measurement, "
        "and (Nx) is measured over eager's measured peak. Budgets are fractions of eager's simulated peak; "
        "*floor* is the smallest simulated peak any plan reaches (as `BudgetError` names it, and its ratio to "
        "eager's simulated peak); *at the floor* is the plan for a budget at the floor. Per-block is HF "
        "`gradient_checkpointing_enable()` (non-reentrant), else every repeated block checkpointed. "
        "`tests/test_corpus.py` checks the same promises: same step as the model (outputs, loss, gradients, "
        "buffers), same `state_dict` keys, measured peak at most eager's, and a budget met within 3% "
        "on the measured peak (or a `BudgetError` naming a floor above it).",
        "",
        f"| entry | family | capture | eager measured (sim) | floor (sim) | {settings} | per-block measured | promises |",
        "|---|---|---|---:|---:|" + "---:|" * len(h.SETTINGS) + "---:|---|",
        *(_row_line(row) for row in rows),
        "",
        "## Failures",
        "",
    ]
    failing = [row for row in rows if row.failures]
    lines += [_summary(rows), ""]
    if not failing:
        lines.append("None: every promise holds on every entry.")
    for row in failing:
        lines.append(f"* **{row.name}**")
        lines += [f"  * {failure}" for failure in row.failures]
    no_block = [row for row in rows if row.per_block is None and row.per_block_note]
    if no_block:
        lines += ["", "Per-block checkpointing n/a: " + "; ".join(f"`{row.name}`: {row.per_block_note}"
                                                           for row in no_block) + "."]
    lines += ["", "## Entries", ""]
    lines += [f"* `{name}` ({entry.family}): {entry.description}" for name, entry in ENTRIES.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", help="comma-separated entry names (default: the whole corpus)")
    parser.add_argument("--out", type=Path, help="write the markdown report here (default: print it)")
    parser.add_argument("--device", default="cpu", help="where the models run: cpu, or cuda to check a GPU")
    parser.add_argument("--autocast", choices=["bfloat16", "float16"],
                        help="plan and step every entry under torch.autocast to this dtype")
    options = parser.parse_args(argv)
    autocast = getattr(torch, options.autocast) if options.autocast else None
    names = options.entries.split(",") if options.entries else list(ENTRIES)
    unknown = [name for name in names if name not in ENTRIES]
    if unknown:
        parser.error(f"unknown entries {unknown}; known: {', '.join(ENTRIES)}")
    torch.set_num_threads(torch.get_num_threads())
    start = time.perf_counter()
    rows = []
    for name in names:
        rows.append(evaluate(name, options.device, autocast))
        print(f"{name}: {rows[-1].seconds:.1f} s, {len(rows[-1].failures)} failure(s)", file=sys.stderr, flush=True)
    text = markdown(rows, time.perf_counter() - start, options.device, options.autocast)
    if options.out:
        options.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
