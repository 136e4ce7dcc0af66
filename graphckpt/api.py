"""The public entry points: :func:`plan` to inspect, :func:`rewrite` to get a module.

Both run the pipeline capture -> costs -> pass (and simulate); :func:`rewrite` adds codegen.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from graphckpt.capture import Captured, CaptureError, block_paths, capture, node_blocks
from graphckpt.codegen import RewrittenModule, generate
from graphckpt.costs import COSTS, build_cost_graph, prepare
from graphckpt.module_hooks import inputs_forward_receives
from graphckpt.progress import paused_gc, planning_progress, stage_progress
from graphckpt.written import mutated_arguments
from passes.budget import Budget
from passes.exact import EXACT_TIME_LIMIT
from passes.plan import Plan
from passes.strategies import check_request, plan_graph


@dataclass(frozen=True)
class Analysis:
    """Everything the pipeline knows before codegen: the capture, its cost graph, the plan."""

    captured: Captured
    cost_graph: nx.DiGraph
    plan: Plan


def _as_tuple(example_inputs: Any) -> tuple | None:
    if example_inputs is None or isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _require_costs_for_inplace(source: fx.GraphModule) -> None:
    for node in source.graph.nodes:
        if mutated_arguments(source, node):
            raise CaptureError(
                f"node {node.name!r} ({node.format_node()}) writes in place; graphckpt needs "
                "example_inputs to see which tensors share storage before it can recompute "
                "around it safely. Call rewrite(model, example_inputs=(x,))."
            )


def check_options(strategy: str, segments: int | None = None, budget: Budget | None = None,
                  exact: bool | float = True) -> float:
    """Refuse an unknown strategy, a budget given with a strategy or segment count, an
    unreadable budget (:func:`passes.strategies.check_request`) and an ``exact=`` that is
    neither a bool nor a number of seconds, before any work is done; the solver's seconds
    (:func:`exact_seconds`) when all is well."""
    check_request(strategy, segments, budget)
    return exact_seconds(exact)


def exact_seconds(exact: bool | float) -> float:
    """The seconds a plan may spend in the exact solver for the ``exact=`` option: ``True``
    the default (:data:`passes.exact.EXACT_TIME_LIMIT`), ``False`` none, a number that many
    (and up to that many again while it still finds better schedules:
    :data:`passes.polish.POLISH_OVERTIME`; on one CPU its smaller sub-MIPs may take up to
    28% more: :data:`passes.guided_solve.FREED_AT`; with two or more it runs two solves at
    once, :func:`passes.highs.lanes`).

    >>> exact_seconds(True), exact_seconds(False), exact_seconds(60)
    (5.0, 0.0, 60.0)
    """
    if isinstance(exact, bool):
        return EXACT_TIME_LIMIT if exact else 0.0
    if not isinstance(exact, (int, float)) or not 0 <= exact < float("inf"):
        raise ValueError(f"exact={exact!r}: give True (the solver's default {EXACT_TIME_LIMIT:g} s), False "
                         "(no exact schedule) or the seconds a budget plan may spend in the solver, e.g. exact=60")
    return float(exact)


def plan_cost_graph(cost_graph: nx.DiGraph, strategy: str = "auto", segments: int | None = None,
                    budget: Budget | None = None, exact: bool | float = True) -> Plan:
    """The plan for a cost graph: ``strategy``, or the optimal pass within ``budget`` (a
    fraction of this graph's eager peak, bytes, or a size string); a progress bar when slow
    (:func:`passes.strategies.plan_graph`). ``exact``: how long a plan may spend in the exact
    solver (:func:`exact_seconds`); ``False``: no plan runs its schedule (:mod:`passes.exact`),
    which refuses a second backward through one forward."""
    seconds = check_options(strategy, segments, budget, exact)
    with planning_progress(f"graphckpt: planning {cost_graph.number_of_nodes()} nodes") as progress, paused_gc():
        return plan_graph(cost_graph, strategy, segments, budget, progress, seconds)


def cost_model(model: nn.Module, example_inputs: Any = None, *,
               example_kwargs: Mapping[str, Any] | None = None, cost: str = "flops",
               blocks: Sequence[str] | None = None,
               blocks_left_whole: Collection[str] = ()) -> tuple[Captured, nx.DiGraph]:
    """Capture ``model`` and build its cost graph: everything a plan is chosen from, so several
    plans (strategies, budgets) can share one capture. ``blocks`` names the modules
    per-block checkpointing wraps (default: the repeated layers of the model's
    ``ModuleList``/``Sequential`` containers, :func:`graphckpt.capture.find_blocks`);
    the blocks of ``blocks_left_whole`` are not among them (their ops count as outside
    every block, so per-block checkpointing never recomputes them)."""
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; choose one of {list(COSTS)}")
    if cost == "time" and example_inputs is None and not example_kwargs:
        raise ValueError("cost='time' needs example_inputs: op times come from running them")
    args = _as_tuple(example_inputs)
    if args is None and example_kwargs:
        args = ()  # keyword inputs alone are example inputs too
    with stage_progress(f"graphckpt: capturing {type(model).__name__}"):
        captured = capture(model, args, example_kwargs)
    if captured.method == "fx":  # export traced the model's own pre-hooks in; fx leaves them to the call
        args, example_kwargs = inputs_forward_receives(model, args, example_kwargs)
    paths = [path for path in block_paths(model, blocks) if path not in blocks_left_whole]  # a misspelt
    # block name is refused before costing
    if args is None:
        _require_costs_for_inplace(captured.graph_module)
    with stage_progress(f"graphckpt: costing {len(captured.graph_module.graph.nodes)} nodes"):
        profile = prepare(captured.graph_module, args, example_kwargs, cost)
        node_block = node_blocks(captured.graph_module, paths)
        return captured, build_cost_graph(captured.graph_module, profile, blocks=node_block)


def analyze(model: nn.Module, example_inputs: Any = None, *, strategy: str = "auto",
            segments: int | None = None, budget: Budget | None = None,
            example_kwargs: Mapping[str, Any] | None = None, cost: str = "flops",
            blocks: Sequence[str] | None = None, exact: bool | float = True) -> Analysis:
    """Capture ``model``, cost its graph and plan it with ``strategy`` (or to fit ``budget``)."""
    check_options(strategy, segments, budget, exact)
    if budget is not None and example_inputs is None and not example_kwargs:
        raise ValueError("a memory budget needs example_inputs: sizes come from running them")
    captured, cost_graph = cost_model(model, example_inputs, example_kwargs=example_kwargs, cost=cost,
                                      blocks=blocks)
    return Analysis(captured, cost_graph, plan_cost_graph(cost_graph, strategy, segments, budget, exact))


def generate_rewrite(model: nn.Module, analysis: Analysis) -> RewrittenModule:
    """The rewritten module for an analysis of ``model`` (codegen only)."""
    with torch.no_grad(), stage_progress("graphckpt: generating the rewritten module"):
        return generate(analysis.captured.graph_module, model, analysis.plan, analysis.captured.method)


def plan(model: nn.Module, example_inputs: Any = None, *, strategy: str = "auto",
         segments: int | None = None, budget: Budget | None = None,
         example_kwargs: Mapping[str, Any] | None = None, cost: str = "flops",
         blocks: Sequence[str] | None = None, exact: bool | float = True) -> Plan:
    """The checkpointing plan for ``model`` without rewriting it (``print(plan)`` shows it).

    Without ``example_inputs`` every op costs one unit (node counting).
    """
    return analyze(model, example_inputs, strategy=strategy, segments=segments, budget=budget,
                   example_kwargs=example_kwargs, cost=cost, blocks=blocks, exact=exact).plan


def rewrite(model: nn.Module, example_inputs: Any = None, *, strategy: str = "auto",
            segments: int | None = None, budget: Budget | None = None,
            example_kwargs: Mapping[str, Any] | None = None, cost: str = "flops",
            blocks: Sequence[str] | None = None, exact: bool | float = True) -> RewrittenModule:
    """A module computing what ``model`` computes, recomputing planned segments in backward.

    It shares ``model``'s parameters and buffers (same objects, same ``state_dict`` keys),
    so an optimizer over ``model.parameters()`` trains it. ``strategy`` is one of
    ``"auto"``, ``"sqrt"``, ``"articulation"``, ``"mincut"``, ``"blocks"`` (every repeated
    layer recomputed, as ``gradient_checkpointing_enable()`` does), ``"optimal"`` (least
    recompute at auto's peak, nested segments allowed); ``segments`` overrides the √n
    segment count of the heuristics. ``blocks`` names the modules that count as blocks
    (default: the repeated layers of the model's ``ModuleList``/``Sequential`` containers);
    a budget search always has per-block checkpointing among its candidates. ``budget`` (a
    fraction of eager's simulated peak, bytes, or a string like ``"2GiB"``) runs the optimal
    pass: the plan of least recompute whose simulated peak fits, or
    :class:`passes.budget.BudgetError` saying the smallest peak reachable. ``cost="time"``
    measures each op's forward time on the example inputs and minimises recomputed time
    instead of FLOPs (pointwise ops are not free). On graphs of up to 40 ops a budget plan
    may run the exact solver's own schedule (:mod:`passes.exact`), which supports one
    backward per forward; ``exact=False`` keeps to plans that support a second
    (``retain_graph=True``), and a number gives the solver that many seconds instead of
    5 (at tight budgets a longer solve may find a schedule recomputing less).
    ``gm.meta["graphckpt_plan"]`` holds the plan.
    """
    analysis = analyze(model, example_inputs, strategy=strategy, segments=segments, budget=budget,
                       example_kwargs=example_kwargs, cost=cost, blocks=blocks, exact=exact)
    return generate_rewrite(model, analysis)
