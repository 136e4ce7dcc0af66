"""How far each strategy's recompute is from the exact optimum (Checkmate-style MILP).

    python scripts/planner_gap.py [--graphs 12] [--ops 16] [--seed 0] [--budget-ops 16 40] [--budget-graphs 8]
                                  [--timing-ops 500] [--exact-seconds 5]
                                  [--out docs/planner_quality.md] [--quick]

For random DAG cost graphs and for small zoo models' real cost graphs, and each strategy, the
MILP (passes/checkmate.py, the same memory model as the simulator) finds the least recompute
that fits the plan's own simulated peak. Reported: total forward compute (forward + recompute)
of the plan over the optimum's, as Checkmate's paper does (it found sqrt(n) on articulation
points at 1.14-1.54x). ``optimal`` is planned at auto's peak; the last row plans optimal at
half of eager's peak or, where no plan reaches that, at the smallest peak a plan reaches.
A third table plans at 0.3, 0.5 and 0.7 of eager and compares with the MILP at that budget
(:func:`budget_rows`); a fourth times the planner alone on larger random DAGs
(``--timing-ops``, default 500 ops), where the MILP is not solved.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

from graphckpt.tools.milp_gap import Gap, cell, gap_to_milp
from graphckpt.tools.random_dags import random_cost_graph
from passes.budget import BudgetError
from passes.budget_search import fit_budget
from passes.checkmate import CheckmateResult, checkmate_schedule
from passes.exact import EXACT_TIME_LIMIT
from passes.flat_plans import candidate_plans
from passes.graph_facts import op_nodes
from passes.optimal import DynamicPrograms
from passes.plan import Plan
from passes.simulate import eager_peak
from passes.strategies import STRATEGIES

TIGHT = "optimal @ 0.5 of eager†"
ROWS = (*STRATEGIES, TIGHT)
ZOO_SIZES: dict[str, dict[str, object]] = {  # batch large enough that activations dominate
    "mlp": {"depth": 10, "width": 64, "batch": 256},
    "resnet": {"widths": (8, 16), "blocks_per_stage": 1, "batch": 16},
    "unet": {"base": 4, "levels": 1, "batch": 16},
    "densenet": {"layers": 4, "blocks": 1, "batch": 16},
    "gpt": {"layers": 1, "d": 16, "seq": 16, "heads": 2, "batch": 8},  # 42 ops: slow, off by default
}
DEFAULT_MODELS = ("mlp", "resnet", "unet", "densenet")
GPT_NOTE = (" gpt (`--models gpt`; its smallest, one layer, has 42 ops) is left out: in a trial at 45 s a "
            "solve, HiGHS found no schedule for 4 of its 6 plans.")
QUICK_SIZES: dict[str, dict[str, object]] = {"mlp": {"depth": 4, "width": 16, "batch": 64}}


def zoo_cost_graph(name: str, size: dict[str, object]) -> nx.DiGraph:
    """A zoo model's cost graph, as ``graphckpt.analyze`` gives it."""
    from graphckpt.api import analyze
    from graphckpt.tools import zoo

    model, inputs = zoo.make(name, **size)
    return analyze(model, inputs).cost_graph.copy()


def tight_plan(graph: nx.DiGraph, eager_peak_bytes: int, exact_seconds: float = EXACT_TIME_LIMIT) -> Plan:
    """Optimal at half of eager's peak or, if no plan fits that, at the smallest peak any reaches."""
    try:
        return fit_budget(graph, eager_peak_bytes // 2, exact_seconds=exact_seconds)
    except BudgetError:
        smallest = min(p.peak_bytes for p in (DynamicPrograms(graph).smallest(), *candidate_plans(graph)))
        return fit_budget(graph, smallest, exact_seconds=exact_seconds)


def plans_of(graph: nx.DiGraph, exact_seconds: float = EXACT_TIME_LIMIT) -> dict[str, Plan]:
    """Every strategy's plan, and :func:`tight_plan` under :data:`TIGHT`."""
    plans = {name: strategy(graph, exact_seconds=exact_seconds) for name, strategy in STRATEGIES.items()}
    plans[TIGHT] = tight_plan(graph, plans["auto"].eager_peak_bytes, exact_seconds)
    return plans


def gaps(graph: nx.DiGraph, plans: dict[str, Plan], time_limit: float) -> dict[str, Gap]:
    """Each plan's :class:`Gap` to the MILP's least recompute at the plan's simulated peak."""
    return {name: gap_to_milp(graph, plan.peak_bytes, plan.recompute_flops, time_limit) for name, plan in plans.items()}


def random_table(graphs: int, ops: int, seed: int, time_limit: float, exact_seconds: float = EXACT_TIME_LIMIT) -> str:
    """Median and worst :class:`Gap` of each strategy over ``graphs`` random DAGs."""
    rng = random.Random(seed)
    found: dict[str, list[Gap]] = {name: [] for name in ROWS}
    for _ in range(graphs):
        graph = random_cost_graph(rng, ops)
        for name, gap in gaps(graph, plans_of(graph, exact_seconds), time_limit).items():
            found[name].append(gap)
    lines = ["| strategy | median | worst |", "|---|---:|---:|"]
    for name, values in found.items():
        if values:
            median = Gap(statistics.median(g.low for g in values), statistics.median(g.high for g in values))
            worst = Gap(max(g.low for g in values), max(g.high for g in values))
            lines.append(f"| {name} | {cell(median)} | {cell(worst)} |")
    return "\n".join(lines)


def zoo_table(sizes: dict[str, dict[str, object]], time_limit: float,
              exact_seconds: float = EXACT_TIME_LIMIT) -> tuple[str, str]:
    """One column per zoo model; and a note on each model's configuration and tight budget."""
    columns, notes = {}, []
    for name, size in sizes.items():
        graph = zoo_cost_graph(name, size)
        plans = plans_of(graph, exact_seconds)
        columns[f"{name} ({len(op_nodes(graph))} ops)"] = gaps(graph, plans, time_limit)
        config = ", ".join(f"{k}={v}" for k, v in size.items())
        notes.append(f"{name}({config}): {plans[TIGHT].peak_bytes / plans['auto'].eager_peak_bytes:.2f}")
    lines = ["| strategy | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {row} | " + " | ".join(cell(c.get(row)) for c in columns.values()) + " |" for row in ROWS]
    return "\n".join(lines), "; ".join(notes)


# --- fixed budgets: fit_budget against the MILP at 0.3, 0.5 and 0.7 of eager ----------------

FRACTIONS = (0.3, 0.5, 0.7)


@dataclass
class BudgetRow:
    """What one family of graphs gave at one budget fraction."""

    ratios: list[tuple[float, float]] = field(default_factory=list)  # (over the MILP's schedule, over its bound)
    refused: int = 0  # the MILP meets the budget, the planner raises BudgetError
    neither: int = 0  # no schedule meets it
    unsolved: int = 0  # the planner refuses and the MILP found no schedule in its time limit
    seconds: list[float] = field(default_factory=list)  # planning time per graph


def measure(graph: nx.DiGraph, fraction: float, row: BudgetRow, time_limit: float,
            exact_seconds: float = EXACT_TIME_LIMIT, again_limit: float = 0.0) -> None:
    """Plan ``graph`` at ``fraction`` of eager's peak, solve the MILP there, add to ``row``.
    A solve that ends at ``time_limit`` without settling the cell (a range, or no answer to
    whether any schedule meets the budget) is run once more for ``again_limit`` seconds.

    Both solves' findings stand (:meth:`Gap.narrowed`).

    Why: at 20 s the zoo MLP's cell at 0.3 read 1.00-1.39x (nothing below the plan found);
    120 s found a schedule recomputing 12 matmuls where the plan recomputes 15 (1.14x). The
    zoo cells at 0.7 proved 1.00x, and the DenseNet at 0.5 proved that no schedule meets the
    budget in 36 s."""
    budget = int(fraction * eager_peak(graph))
    took, plan = planning_seconds(graph, budget, rounds=1, exact_seconds=exact_seconds)
    row.seconds.append(took)
    if plan is not None:
        gap = gap_to_milp(graph, budget, plan.recompute_flops, time_limit)
        if again_limit > time_limit and not gap.settled:
            gap = gap.narrowed(gap_to_milp(graph, budget, plan.recompute_flops, again_limit))
        row.ratios.append((gap.low, gap.high))
        return
    try:
        best = _schedule_or_timeout(graph, budget, time_limit, again_limit)
    except TimeoutError:
        row.unsolved += 1
        return
    if best is None:
        row.neither += 1
    else:
        row.refused += 1


def _schedule_or_timeout(graph: nx.DiGraph, budget: int, time_limit: float,
                         again_limit: float) -> CheckmateResult | None:
    """Any schedule meeting ``budget`` (``None``: proven none does), asked for ``time_limit``
    seconds and, where that ends without an answer, once more for ``again_limit``."""
    try:
        return checkmate_schedule(graph, budget, time_limit=time_limit)
    except TimeoutError:
        if again_limit <= time_limit:
            raise
    return checkmate_schedule(graph, budget, time_limit=again_limit)


def budget_rows(graphs: Iterable[nx.DiGraph], time_limit: float, fractions: Sequence[float] = FRACTIONS,
                exact_seconds: float = EXACT_TIME_LIMIT, again_limit: float = 0.0) -> dict[float, BudgetRow]:
    """One :class:`BudgetRow` per fraction over ``graphs``; the planner may spend
    ``exact_seconds`` in the exact solver (``graphckpt.rewrite(..., exact=...)``); an
    unsettled solve runs once more for ``again_limit`` (:func:`measure`)."""
    rows = {fraction: BudgetRow() for fraction in fractions}
    for graph in graphs:
        for fraction in fractions:
            measure(graph, fraction, rows[fraction], time_limit, exact_seconds, again_limit)
    return rows


def table_lines(family: str, rows: dict[float, BudgetRow]) -> list[str]:
    """Markdown rows of one family (header not included)."""
    lines = []
    for fraction, row in rows.items():
        if row.ratios:
            lows, highs = [r[0] for r in row.ratios], [r[1] for r in row.ratios]
            median = cell(Gap(statistics.median(lows), statistics.median(highs)))
            worst = cell(Gap(max(lows), max(highs)))
        else:
            median = worst = "—"
        seconds = f"{statistics.median(row.seconds):.2f} / {max(row.seconds):.2f}" if row.seconds else "—"
        lines.append(f"| {family} | {fraction:g} | {median} | {worst} | {len(row.ratios)} | {row.refused} | "
                     f"{row.neither} | {row.unsolved} | {seconds} |")
    return lines


HEADER = ["| graphs | budget (× eager) | median | worst | both meet | MILP meets, planner refuses | "
          "no schedule meets | MILP unsolved | planning s (median / max) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]


def budget_table(options: argparse.Namespace, sizes: dict[str, dict[str, object]]) -> str:
    """``fit_budget`` against the MILP at 0.3, 0.5 and 0.7 of eager on random DAGs of each
    ``--budget-ops`` size and on the zoo graphs (:func:`budget_rows`)."""
    lines = list(HEADER)
    for ops in options.budget_ops:
        rng = random.Random(options.seed)
        graphs = [random_cost_graph(rng, ops) for _ in range(options.budget_graphs)]
        lines += table_lines(f"{len(graphs)} random DAGs of {ops} ops",
                             budget_rows(graphs, options.budget_time_limit, exact_seconds=options.exact_seconds,
                                         again_limit=options.again_time_limit))
    zoo_graphs = [zoo_cost_graph(name, size) for name, size in sizes.items()]
    lines += table_lines(f"zoo: {', '.join(sizes)}",
                         budget_rows(zoo_graphs, options.budget_time_limit, exact_seconds=options.exact_seconds,
                                     again_limit=options.again_time_limit))
    return "\n".join(lines)


def planning_seconds(graph: nx.DiGraph, budget_bytes: int, rounds: int,
                     exact_seconds: float = EXACT_TIME_LIMIT) -> tuple[float, Plan | None]:
    """The median wall time of ``rounds`` runs of ``fit_budget`` on fresh copies of ``graph``
    (no fact cached from an earlier run), and its plan (``None`` when it refuses): one run's
    time on a shared VM varied 2x between runs of the same fit. Each run has the collector
    paused, as ``graphckpt.rewrite``'s planning has (:func:`graphckpt.progress.paused_gc`):
    otherwise a collection over the objects of every graph and model made before it lands
    in some runs (a 500-op plan took 1.07 s instead of 0.3-0.5 beside 3M live objects)."""
    from graphckpt.progress import paused_gc

    seconds, plan = [], None
    for _ in range(rounds):
        fresh = graph.copy()
        started = time.perf_counter()
        try:
            with paused_gc():
                plan = fit_budget(fresh, budget_bytes, exact_seconds=exact_seconds)
        except BudgetError:
            plan = None
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), plan


def timing_table(sizes: Sequence[int], graphs: int, seed: int, rounds: int = 1) -> str:
    """Planning time alone (no MILP: it does not solve graphs this large) of ``fit_budget`` at
    0.3, 0.5 and 0.7 of eager on ``graphs`` random DAGs of each size (each graph's time the
    median of ``rounds`` runs, :func:`planning_seconds`), with the plan's recompute over the
    forward's FLOPs; a budget no plan meets is counted."""
    lines = ["| graphs | budget (× eager) | planning s (median / max) | recompute / forward FLOPs "
             "(median / max) | refused |", "|---|---:|---:|---:|---:|"]
    for ops in sizes:
        rng = random.Random(seed)
        family = [random_cost_graph(rng, ops) for _ in range(graphs)]
        for fraction in FRACTIONS:
            seconds, ratios, refused = [], [], 0
            for graph in family:
                forward = sum(f for _, f in graph.nodes(data="flops"))
                took, plan = planning_seconds(graph, int(fraction * eager_peak(graph)), rounds)
                seconds.append(took)
                if plan is None:
                    refused += 1
                else:
                    ratios.append(plan.recompute_flops / forward)
            spread = f"{statistics.median(ratios):.2f} / {max(ratios):.2f}" if ratios else "—"
            lines.append(f"| {graphs} random DAGs of {ops} ops | {fraction:g} | {statistics.median(seconds):.2f} / "
                         f"{max(seconds):.2f} | {spread} | {refused} |")
    return "\n".join(lines)


def report(options: argparse.Namespace, command: str) -> str:
    """The markdown fragment: what is compared, the command, the tables."""
    started = time.perf_counter()
    sizes = QUICK_SIZES if options.quick else {name: ZOO_SIZES[name] for name in options.models}
    if options.budget_only:
        budget_part = budget_table(options, sizes)
        return f"Made in {time.perf_counter() - started:.0f} s by:\n\n    {command}\n\n{budget_part}\n"
    if options.timing_only:
        timing_part = timing_table(options.timing_ops, options.budget_graphs, options.seed, options.timing_rounds)
        return f"Made in {time.perf_counter() - started:.0f} s by:\n\n    {command}\n\n{timing_part}\n"
    random_part = random_table(options.graphs, options.ops, options.seed, options.time_limit,
                               options.exact_seconds)
    zoo_part, notes = zoo_table(sizes, options.zoo_time_limit, options.exact_seconds)
    budget_part = budget_table(options, sizes)
    timing_part = timing_table(options.timing_ops, options.budget_graphs, options.seed, options.timing_rounds)
    return (
        "Each strategy's total forward compute (forward + recompute) over the least any schedule "
        "needs at the same simulated peak, found by the Checkmate-style MILP (`passes/checkmate.py`, "
        "the simulator's memory model, HiGHS). `optimal` plans at auto's peak; † plans optimal at "
        "half of eager's peak or, where no plan reaches that, at the smallest peak a plan reaches. "
        "The MILP is asked only for schedules recomputing less than the plan (a cutoff): 1.00x where "
        "it proves none does. \\* marks a solve stopped at its time limit: the true ratio lies in the "
        "range shown (over the schedule found, or 1.00 where none recomputing less was found, and over "
        "HiGHS's proven lower bound). "
        f"Made in {time.perf_counter() - started:.0f} s by:\n\n    {command}\n\n"
        f"{options.graphs} random DAGs of {options.ops} ops (time limit {options.time_limit:g} s a solve):\n\n"
        f"{random_part}\n\n"
        f"Zoo models' cost graphs (time limit {options.zoo_time_limit:g} s a solve), as `analyze` gives "
        "them (the MILP models the gradient views of cat/stack, `grad_views`, as the simulator does). "
        "Configurations, and the peak of the † row over eager's: "
        f"{notes}.{GPT_NOTE if 'gpt' not in sizes else ''}\n\n{zoo_part}\n\n"
        "At fixed budgets (0.3, 0.5, 0.7 of eager's simulated peak): `fit_budget` (what `budget=` and "
        "`optimal` run) against the MILP under the same budget. Median and worst are over the budgets "
        "both meet; a budget the MILP meets and the planner refuses is counted, not priced; planning "
        "time is `fit_budget`'s wall time per graph on this machine (a refusal includes the true floor's "
        f"MILP, `passes/floor.py`); time limit {options.budget_time_limit:g} s a solve, and where that settles "
        f"nothing (a range, or no answer) once more for {options.again_time_limit:g} s; the planner's own "
        f"exact solver may take {options.exact_seconds:g} s (`exact=`):\n\n"
        f"{budget_part}\n\n"
        "Planning time on larger random DAGs (the same family), where the MILP is not solved: "
        f"`fit_budget`'s wall time per graph on this machine (the median of {options.timing_rounds} runs on "
        "fresh copies of the graph), and the plan's recompute over the "
        f"forward's FLOPs:\n\n{timing_part}\n"
    )


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv``, build the report and print it or write it to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=12)
    parser.add_argument("--ops", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds a random-graph solve")
    parser.add_argument("--zoo-time-limit", type=float, default=20.0, help="seconds a zoo-graph solve")
    parser.add_argument("--models", nargs="+", choices=list(ZOO_SIZES), default=list(DEFAULT_MODELS))
    parser.add_argument("--budget-ops", type=int, nargs="+", default=[16, 40], help="random DAG sizes of the budget table")
    parser.add_argument("--budget-graphs", type=int, default=8, help="random DAGs of each size in the budget table")
    parser.add_argument("--budget-time-limit", type=float, default=20.0, help="seconds a budget-table solve")
    parser.add_argument("--again-time-limit", type=float, default=120.0,
                        help="seconds a budget-table solve that ended unsettled is given once more (0: never)")
    parser.add_argument("--timing-ops", type=int, nargs="+", default=[500],
                        help="random DAG sizes planned for time alone (no MILP)")
    parser.add_argument("--timing-rounds", type=int, default=3, help="runs of each timed fit (the median is shown)")
    parser.add_argument("--exact-seconds", type=float, default=EXACT_TIME_LIMIT,
                        help="seconds the planner may spend in the exact solver (rewrite's exact=)")
    parser.add_argument("--budget-only", action="store_true", help="only the budget table (e.g. to run an older planner)")
    parser.add_argument("--timing-only", action="store_true",
                        help="only the planning-time table of the larger DAGs (no MILP: minutes, not most of an hour)")
    parser.add_argument("--quick", action="store_true", help="a tiny run: few small graphs, short limits")
    parser.add_argument("--out", type=Path, help="write the markdown here instead of printing it")
    argv = sys.argv[1:] if argv is None else argv
    options = parser.parse_args(argv)
    if options.quick:
        options.graphs, options.ops = min(options.graphs, 2), min(options.ops, 8)
        options.budget_graphs, options.budget_ops = min(options.budget_graphs, 2), [min(options.ops, 8)]
        options.time_limit, options.zoo_time_limit = min(options.time_limit, 5), min(options.zoo_time_limit, 5)
        options.budget_time_limit, options.again_time_limit = min(options.budget_time_limit, 5), 0.0
        options.timing_ops, options.timing_rounds = [min(options.timing_ops[0], 80)], 1
    text = report(options, " ".join(["python scripts/planner_gap.py", *argv]))
    if options.out is None:
        print(text, end="")
    else:
        options.out.write_text(text)


if __name__ == "__main__":
    main()
