"""What the measuring commands of ``graphckpt`` (bench, pareto, demo) share: building the
variants behind a status line, measuring them behind a progress bar, and the table (or JSON)
of what was measured. The commands themselves are :mod:`graphckpt.tools.cli`."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from graphckpt.tools.console import err, note_line, out, quiet_profiler
from passes.units import format_bytes


def print_json(document: Any) -> None:
    """``document`` as indented JSON on stdout (what ``--json`` prints)."""
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


def measuring_progress() -> Progress:
    """A progress bar on stderr that leaves nothing behind and redraws only when told."""
    return Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err(), transient=True, auto_refresh=False)


def measure_with_progress(variants: Sequence[Any], inputs: tuple, steps: int) -> list[Any]:
    """Measure with a progress bar on stderr (redrawn between steps, never during one)."""
    from graphckpt.tools import zoo
    from graphckpt.tools.bench import measure_variants, work_units

    with measuring_progress() as progress:
        task = progress.add_task("measuring", total=work_units(variants, steps))

        def tick(message: str) -> None:
            progress.update(task, advance=1, description=message)
            progress.refresh()

        return measure_variants(variants, inputs, zoo.scalar_loss, steps=steps, progress=tick)


def threads_note() -> str:
    """How many CPU threads torch runs on, for the title of a measured table."""
    import torch

    count = torch.get_num_threads()
    return f"{count} CPU thread{'s' if count != 1 else ''}"


def built_quietly(what: str, make: Callable[[], Any]) -> Any:
    """``make()`` behind a status line naming ``what``, with the profiler's console noise off."""
    with err().status(f"[dim]{what}[/]"), quiet_profiler():
        return make()


def _results_table(results: Sequence[Any], title: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for header in ("variant", "setting", "measured peak", "vs eager", "simulated", "step time", "vs eager",
                   "build"):
        table.add_column(header, justify="left" if header in ("variant", "setting") else "right")
    for r in results:
        simulated = format_bytes(r.simulated_peak_bytes) if r.simulated_peak_bytes is not None else ""
        built = f"{r.plan_seconds:.1f} s" if r.plan_seconds is not None else ""
        table.add_row(r.name, r.setting, format_bytes(r.peak_bytes), f"{r.peak_ratio:.2f}x", simulated,
                      f"{r.step_seconds * 1e3:.1f} ms", f"{r.time_ratio:.2f}x", built)
    return table


def report_measured(results: Sequence[Any], skipped: Sequence[Any], title: str, json_: bool) -> None:
    """The measured variants as a table (or JSON), and a note for each variant skipped."""
    if json_:
        print_json({"title": title, "results": [r.as_dict() for r in results],
                    "skipped": [{"name": s.name, "reason": s.reason} for s in skipped]})
    else:
        out().print(_results_table(results, title))
    for s in skipped:
        note_line(f"{s.name} skipped: {s.reason}")
