"""Per-block checkpointing at a budget, as ``graphckpt.enable`` carries it out in place: each
recomputed segment is one block's run, so the block's own ``forward`` can be checkpointed.
The blocks themselves and their mixes are :mod:`passes.blocks`; the budget search that has
per-block checkpointing among its candidates is :mod:`passes.budget_search`.
"""

from __future__ import annotations

import networkx as nx

from passes.blocks import block_mixes, block_names, block_runs
from passes.budget import unreachable
from passes.budget_search import eager_fits
from passes.flat_plans import cheapest_fitting, partially_recomputed
from passes.heuristics import blocks_candidate
from passes.plan import Plan, simulated
from passes.segments import PlanError
from passes.simulate import eager_peak


def block_plan(graph: nx.DiGraph, budget_bytes: int | None = None) -> Plan:
    """Per-block checkpointing that a module tree can carry out in place: every block
    recomputed, or for ``budget_bytes`` the plan of least recompute that fits it among
    recomputing the first r blocks whole and the next s selectively
    (:func:`passes.blocks.block_mixes`; eager when eager fits). Each recomputed segment is
    one block's run, so ``graphckpt.enable`` can checkpoint the block's own ``forward``.

    Raises :class:`passes.segments.PlanError` when the graph names no blocks, and
    :class:`BudgetError` naming the smallest peak when no such plan fits.
    """
    every = blocks_candidate(graph)
    if every is None and block_names(graph):
        raise PlanError(f"no block can be recomputed whole: {_ops_run_once(graph)} must not run twice (a module "
                        "whose hooks run once a step, an in-place write something reads), and per-block "
                        "checkpointing reruns a block whole. graphckpt.rewrite(model, example_inputs) "
                        "recomputes around such ops.")
    if every is None:
        raise PlanError("no blocks to checkpoint in place: the model has no repeated child modules "
                        "(a ModuleList or Sequential of same-class layers); name them with blocks=[...], or "
                        "checkpoint the whole graph with graphckpt.rewrite(model, example_inputs)")
    if budget_bytes is None:
        return simulated(graph, every)
    if eager_peak(graph) <= budget_bytes:
        return eager_fits(graph, "blocks", budget_bytes)
    flat = [every, *partially_recomputed(graph, every), *block_mixes(graph, every)]
    chosen, tried = cheapest_fitting(graph, flat, budget_bytes, None)
    if chosen is None:
        raise unreachable(graph, budget_bytes, tried)
    return chosen


def _ops_run_once(graph: nx.DiGraph, shown: int = 3) -> str:
    """The first ops, one per block, that may not be recomputed, as ``label (in block)``."""
    found = {}
    for block, ops in block_runs(graph):
        first = next((n for n in ops if not graph.nodes[n]["recomputable"]), None)
        if block and first is not None:
            found.setdefault(block, graph.nodes[first].get("label") or first)
    named = [f"{label} (in {block})" for block, label in list(found.items())[:shown]]
    return ", ".join(named) + (f" and ops in {len(found) - shown} more blocks" if len(found) > shown else "")
