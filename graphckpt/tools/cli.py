"""The ``graphckpt`` command: inspect, compare, bench and pareto plans of a model, or run the demo.

TARGET names the model: ``zoo:NAME`` (``zoo:gpt?layers=2&d=32&batch=2``) or
``package.module:callable`` returning ``(model, example_inputs)``; see :mod:`graphckpt.tools.targets`.
The commands are thin: planning data comes from :mod:`graphckpt.tools.report`, pictures from
:mod:`graphckpt.tools.draw` and :mod:`graphckpt.tools.plots`, measurements from :mod:`graphckpt.tools.bench`
(measured behind a progress bar and tabled by :mod:`graphckpt.tools.cli_measure`).
Bad input ends in one red ``error:`` line and exit status 1 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from graphckpt.tools.cli_measure import built_quietly, measure_with_progress, print_json, report_measured, threads_note
from graphckpt.tools.console import err, error_line, note_line, out, quiet_profiler
from passes.budget import BudgetError, read_budget
from passes.strategies import STRATEGIES, check_strategy
from passes.units import format_bytes

app = typer.Typer(name="graphckpt", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Automatic gradient checkpointing: see what is kept, what is recomputed, and what it costs.")
_state = {"debug": False}
F = TypeVar("F", bound=Callable[..., Any])

DEMO_TARGET = "zoo:gpt?layers=8&d=128&heads=4&seq=128&dropout=0.1&batch=8"
TargetArg = Annotated[str, typer.Argument(help="zoo:NAME[?key=value&...] or package.module:callable",
                                          show_default=False)]
BatchOpt = Annotated[int | None, typer.Option("--batch", help="batch size of the example inputs")]
StepsOpt = Annotated[int, typer.Option("--steps", min=1, help="timed rounds per variant (median reported)")]


@app.callback()
def _options(debug: Annotated[bool, typer.Option("--debug", help="show tracebacks of errors")] = False) -> None:
    """Automatic gradient checkpointing for PyTorch, as a graph rewrite."""
    _state["debug"] = debug


def friendly(command: F) -> F:
    """Run ``command``; turn any exception into one red line and exit status 1, unless --debug."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as error:
            if _state["debug"]:
                raise
            error_line(_describe(error))
            raise typer.Exit(1) from None
    return run  # type: ignore[return-value]


def _describe(error: Exception) -> str:
    from graphckpt.capture import CaptureError
    from graphckpt.tools.targets import TargetError

    if isinstance(error, (TargetError, BudgetError, CaptureError, ValueError, KeyError)):
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        return str(message)
    return f"{type(error).__name__}: {error} (run `graphckpt --debug ...` for the traceback)"


# ---------------------------------------------------------------- shared steps


def parse_budget_option(text: str | None) -> float | int | str | None:
    """``--budget``: ``0.5`` (fraction of eager's peak), ``50%``, ``2MiB`` or bytes ``1000000``
    (:func:`passes.budget.read_budget`)."""
    return None if text is None else read_budget(text)


def _load(target: str, batch: int | None) -> Any:
    from graphckpt.tools.targets import load_target

    return load_target(target, batch)


@contextmanager
def _timer() -> Iterator[list[float]]:
    box: list[float] = []
    start = time.perf_counter()
    yield box
    box.append(time.perf_counter() - start)


def _analyze(loaded: Any, strategy: str, budget: Any = None, segments: int | None = None,
             cost: str = "flops", exact: bool | float = True) -> tuple[Any, float]:
    import graphckpt

    with _timer() as seconds, quiet_profiler():
        analysis = graphckpt.analyze(loaded.model, loaded.inputs, strategy=strategy, budget=budget, segments=segments,
                                     cost=cost, exact=exact)
    return analysis, seconds[0]


def _draw(analysis: Any, target: str, strategy: str, files: dict[str, Path | None], collapse: bool | None) -> None:
    from graphckpt.tools import draw

    if not any(files.values()):
        return
    view = draw.cut_view(analysis.cost_graph, analysis.plan, collapse)
    title, subtitle = draw.cut_titles(analysis.plan, target, strategy, analysis.captured.method)
    for kind, path in files.items():
        if path is None:
            continue
        if kind == "dot":
            draw.write_dot(view, path, title)
        else:
            draw.draw_cut(view, path, title, subtitle)
        err().print(f"[dim]wrote {path}[/]", soft_wrap=True)


# ---------------------------------------------------------------- inspect and compare


@app.command()
@friendly
def inspect(
    target: TargetArg,
    strategy: Annotated[str, typer.Option(help="a strategy name (see `graphckpt compare`)")] = "auto",
    budget: Annotated[str | None, typer.Option(help="peak bound: 0.5 (of eager), 50%, 2MiB or bytes")] = None,
    segments: Annotated[int | None, typer.Option(help="segment count instead of √n")] = None,
    batch: BatchOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON document instead of tables")] = False,
    dot: Annotated[Path | None, typer.Option(help="write the cut as Graphviz DOT")] = None,
    svg: Annotated[Path | None, typer.Option(help="draw the cut to an SVG file")] = None,
    png: Annotated[Path | None, typer.Option(help="draw the cut to a PNG file")] = None,
    collapse: Annotated[bool | None, typer.Option("--collapse/--no-collapse",
                                                  help="one box per segment (default: above 60 ops)")] = None,
    peak: Annotated[bool, typer.Option("--peak", help="also list what is alive at the simulated peak")] = False,
    exact: Annotated[bool, typer.Option("--exact/--no-exact",
                                        help="let a budget plan run the exact solver's schedule (graphs up to "
                                             "40 ops; one backward per forward)")] = True,
    exact_seconds: Annotated[float | None, typer.Option(
        min=0, help="seconds the exact solver may take (default 5; up to as long again while it still finds "
                    "better schedules; longer may find a plan recomputing less at tight budgets)")] = None,
) -> None:
    """Show the plan for TARGET: segments, checkpoint values, simulated peak vs eager."""
    from graphckpt.tools.report import inspect_view, peak_dict, plan_document
    from passes.sim_peak import peak_breakdown

    check_strategy(strategy)
    parsed_budget = parse_budget_option(budget)
    loaded = _load(target, batch)
    try:
        analysis, seconds = _analyze(loaded, strategy, parsed_budget, segments,
                                     exact=exact_seconds if exact and exact_seconds is not None else exact)
    except BudgetError as error:
        if peak and error.at_peak is not None:  # what the smallest plan holds at its peak: what to shrink
            _print_smallest_peak(error, json_)
        raise
    document = plan_document(analysis.cost_graph, analysis.plan, target=target, capture=analysis.captured.method,
                             strategy=strategy, budget=budget, planning_seconds=round(seconds, 4))
    if peak:
        document["at_peak"] = peak_dict(analysis.cost_graph, peak_breakdown(analysis.cost_graph, analysis.plan.segments))
    if json_:
        print_json(document)
    else:
        out().print(inspect_view(document))
    _draw(analysis, target, strategy, {"dot": dot, "svg": svg, "png": png}, collapse)


def _print_smallest_peak(error: BudgetError, json_: bool) -> None:
    """What is alive at the peak of the smallest plan a missed budget reports
    (:attr:`passes.budget.BudgetError.at_peak`), before the error line itself."""
    from graphckpt.tools.report import peak_dict, peak_table

    peak = peak_dict(error.cost_graph, error.at_peak)
    if json_:
        print_json({"error": str(error), "at_peak": peak})
    else:
        out().print(peak_table(peak, "the smallest plan's"))


@app.command()
@friendly
def compare(
    target: TargetArg,
    batch: BatchOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="print the rows as JSON")] = False,
) -> None:
    """Every strategy side by side: simulated peak, recompute, checkpoints, planning time."""
    from graphckpt.tools.report import compare_strategies, compare_table
    loaded = _load(target, batch)
    analysis, _ = _analyze(loaded, "sqrt" if "sqrt" in STRATEGIES else next(iter(STRATEGIES)))
    rows = compare_strategies(analysis.cost_graph)
    if json_:
        print_json({"target": target, "capture": analysis.captured.method,
                    "eager_peak_bytes": analysis.plan.eager_peak_bytes, "strategies": rows})
        return
    title = (f"{loaded.description}: captured with {analysis.captured.method}, "
             f"eager simulated peak {format_bytes(analysis.plan.eager_peak_bytes)}")
    out().print(compare_table(rows, title))


@app.command()
@friendly
def bench(
    target: TargetArg,
    steps: StepsOpt = 5,
    png: Annotated[Path | None, typer.Option(help="bar chart of peak and step time")] = None,
    batch: BatchOpt = None,
    strategy: Annotated[list[str] | None, typer.Option(help="strategies to measure (repeat; default all)")] = None,
    budgets: Annotated[str, typer.Option(help="graphckpt budgets, fractions of eager's peak")] = "0.5,0.25,0.1",
    compile_budgets: Annotated[str, typer.Option(help="activation_memory_budget values of the torch.compile "
                                                      "anchor")] = "0.5,0.1",
    with_compile: Annotated[bool, typer.Option("--compile/--no-compile", help="measure the torch.compile anchor")] = True,
    inductor: Annotated[bool, typer.Option("--inductor", help="also compile with inductor (slow to build)")] = False,
    cost: Annotated[str, typer.Option(help="what graphckpt's plans minimise: flops or (measured op) time")] = "time",
    json_: Annotated[bool, typer.Option("--json", help="print results as JSON")] = False,
) -> None:
    """Measured peak and median step time: eager, the anchors (checkpoint_sequential, per-block,
    torch.compile) and graphckpt with each strategy and budget; the same set scripts/bench.py runs."""
    from graphckpt.tools import zoo
    from graphckpt.tools.bench import bench_variants

    names = [check_strategy(s) for s in strategy] if strategy else list(STRATEGIES)
    loaded = _load(target, batch)
    backends = ("aot_eager", "inductor") if inductor else ("aot_eager",)
    variants, skipped = built_quietly("rewriting and compiling", lambda: bench_variants(
        loaded.model, loaded.inputs, zoo.scalar_loss, strategies=names, budgets=_budgets(budgets),
        compile_budgets=_budgets(compile_budgets) if with_compile else (), compile_backends=backends, cost=cost))
    results = measure_with_progress(variants, loaded.inputs, steps)
    title = f"{loaded.description}: median of {steps} interleaved rounds, {threads_note()}"
    report_measured(results, skipped, title, json_)
    if png is not None:
        from graphckpt.tools.plots import plot_bench

        plot_bench(results, png, title)
        err().print(f"[dim]wrote {png}[/]", soft_wrap=True)


def _budgets(text: str) -> list[float]:
    """``--budgets``: fractions of eager's peak, comma-separated (``1,0.5,25%``), each read
    as ``--budget`` is (:func:`passes.budget.read_budget`)."""
    try:
        values = [read_budget(v) for v in text.split(",") if v.strip()]
    except BudgetError:
        values = []
    if not values or not all(isinstance(v, float) for v in values):
        raise ValueError(f"--budgets {text!r}: each budget is a fraction of eager's peak, 0 < b <= 1, "
                         "separated by commas, e.g. 1,0.5,25%")
    return values


@app.command()
@friendly
def pareto(
    target: TargetArg,
    png: Annotated[Path | None, typer.Option(help="plot peak memory against step time or recompute")] = None,
    budgets: Annotated[str, typer.Option(help="fractions of eager's peak, comma-separated")] =
        "1,0.75,0.5,0.35,0.25,0.15",
    x: Annotated[str, typer.Option(help="x axis: time (measured step time) or flops (recompute %)")] = "time",
    steps: StepsOpt = 5,
    batch: BatchOpt = None,
    with_compile: Annotated[bool, typer.Option("--compile/--no-compile", help="sweep the torch.compile anchor")] = True,
    json_: Annotated[bool, typer.Option("--json", help="print results as JSON")] = False,
) -> None:
    """Sweep memory budgets: measured (and simulated) peak against step time, ours and the anchors."""
    from graphckpt.tools import zoo
    from graphckpt.tools.bench import pareto_variants

    if x not in ("time", "flops"):
        raise ValueError(f"--x {x!r}: choose time or flops")
    fractions = _budgets(budgets)
    loaded = _load(target, batch)
    variants, skipped = built_quietly("planning, rewriting and compiling", lambda: pareto_variants(
        loaded.model, loaded.inputs, zoo.scalar_loss, budgets=fractions, with_compile=with_compile))
    results = measure_with_progress(variants, loaded.inputs, steps)
    title = f"{loaded.description}: budget sweep, {threads_note()}"
    report_measured(results, skipped, title, json_)
    if png is not None:
        from graphckpt.tools.plots import plot_pareto

        plot_pareto(results, png, title, x)
        err().print(f"[dim]wrote {png}[/]", soft_wrap=True)


# ---------------------------------------------------------------- demo


@app.command()
@friendly
def demo(
    steps: StepsOpt = 5,
    target: Annotated[str, typer.Option(help="the model to demonstrate on")] = DEMO_TARGET,
) -> None:
    """Plan a zoo transformer at per-block checkpointing's memory (what
    'gradient_checkpointing_enable()' gives) and at 0.5 and 0.3 of eager's, measure each
    beside eager and per-block in interleaved rounds, and show the cut of the best trade-off."""
    from graphckpt.tools import zoo
    from graphckpt.tools.demo import best_trade_off, demo_variants, trade_off_line, versus_per_block
    from graphckpt.tools.report import inspect_view, plan_document

    loaded = _load(target, None)
    console = out()
    console.print(f"model: {loaded.description}")
    built = built_quietly("capturing, costing (measured op times) and planning",
                   lambda: demo_variants(loaded.model, loaded.inputs, zoo.scalar_loss))
    results = measure_with_progress(built.variants, loaded.inputs, steps)
    report_measured(results, built.skipped, f"training step: median of {steps} interleaved rounds, {threads_note()}",
                     False)
    best = best_trade_off(results)
    if best is None:
        note_line("no graphckpt plan saved memory on this model")
        return
    plan = next(v.plan for v in built.variants if v.name == best.name)
    console.print(inspect_view(plan_document(built.modelled.cost_graph, plan, target=target,
                                             capture=built.modelled.captured.method, strategy="optimal"),
                               checkpoints=False))
    for line in (versus_per_block(results), trade_off_line(best, results)):
        if line is not None:
            console.print(line, soft_wrap=True)
    console.print(f"ratio: peak {best.peak_ratio:.2f}x eager, step time {best.time_ratio:.2f}x eager")


TIMED_COMMANDS = ("demo", "bench", "pareto")  # they time training steps


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point (``graphckpt = graphckpt.tools.cli:main``); returns the exit
    status. A command that times steps first re-runs the process with an allocator that keeps
    freed memory, as a GPU's caching allocator does (:mod:`graphckpt.tools.pairs`): with
    glibc's default, page faults decide CPU step times."""
    arguments = list(argv) if argv is not None else sys.argv[1:]
    if arguments and arguments[0] in TIMED_COMMANDS:
        from graphckpt.tools.pairs import rerun_with_retaining_allocator

        rerun_with_retaining_allocator(["-m", "graphckpt.tools.cli", *arguments])
    try:
        app(args=list(argv) if argv is not None else None, prog_name="graphckpt", standalone_mode=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
