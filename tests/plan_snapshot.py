"""Stored plans of the zoo, so a refactor of the passes can show it changed no plan.

``tests/data/zoo_plans.json`` holds, for every zoo model, its measured cost graph (as
networkx node-link data, so the snapshot does not depend on the CPU that reads it) and the
plan each strategy and budget chose from it when the snapshot was written. The test plans
the stored graphs again and compares. Rewrite the file only when a plan change is meant:
``python -m tests.plan_snapshot``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import networkx as nx

SNAPSHOT = Path(__file__).parent / "data" / "zoo_plans.json"
STRATEGY_NAMES = ("sqrt", "articulation", "mincut", "auto", "optimal")
BUDGETS = (0.7, 0.5, 0.3)


def graph_to_data(graph: nx.DiGraph) -> dict[str, Any]:
    """A cost graph as JSON-ready node-link data."""
    return nx.node_link_data(graph, edges="edges")


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def graph_from_data(data: dict[str, Any]) -> nx.DiGraph:
    """The cost graph of :func:`graph_to_data`, with its tuple attributes restored and
    attributes the contract gained since the snapshot at their defaults."""
    from passes.costgraph import DEFAULTS

    graph = nx.node_link_graph(data, directed=True, edges="edges")
    for _, attrs in graph.nodes(data=True):
        for key, value in attrs.items():
            attrs[key] = _tuples(value)
        for key, value in DEFAULTS.items():
            attrs.setdefault(key, value)
    graph.graph.update({k: _tuples(v) for k, v in graph.graph.items()})
    return graph


def segment_summary(segment: Any) -> dict[str, Any]:
    """What a segment decides: its nodes, whether it is recomputed, what it keeps inside,
    its children and the inputs it rematerializes (value and sources; only when it does)."""
    summary = {"nodes": list(segment.nodes), "recompute": segment.recompute,
               "saved_inside": list(segment.saved_inside),
               "children": [segment_summary(c) for c in segment.children]}
    if segment.remat:
        summary["remat"] = [[r.value, list(r.sources)] for r in segment.remat]
    return summary


def plan_summary(plan: Any) -> dict[str, Any]:
    """What a plan decides and what the simulator says of it."""
    return _summary(plan.segments, plan.peak_bytes, plan.recompute_flops)


def _summary(segments: tuple, peak_bytes: int, recompute_flops: int) -> dict[str, Any]:
    return {"segments": [segment_summary(s) for s in segments], "peak_bytes": peak_bytes,
            "recompute_flops": recompute_flops}


def plans_of(graph: nx.DiGraph) -> dict[str, Any]:
    """Every strategy's plan and every budget's plan (or its error) for one cost graph. A
    budget's plan that runs a schedule the exact solver found in its time without proving
    it least stands for the plan in hand it was asked to beat: the schedule depends on how
    far the search got in its seconds (a slower CPU finds less, or none), the plan in hand
    does not."""
    from graphckpt.api import plan_cost_graph
    from passes.budget import BudgetError

    found: dict[str, Any] = {name: plan_summary(plan_cost_graph(graph, name)) for name in STRATEGY_NAMES}
    for budget in BUDGETS:
        try:
            with _plans_in_hand() as in_hand:
                plan = plan_cost_graph(graph, budget=budget)
            found[f"budget={budget}"] = (plan_summary(plan) if not _unproven_schedule(plan)
                                         else segments_summary(graph, in_hand[-1]) if in_hand and in_hand[-1]
                                         else "an exact schedule, not proven least")
        except BudgetError:
            found[f"budget={budget}"] = "BudgetError"
    return found


def _unproven_schedule(plan: Any) -> bool:
    """Whether ``plan`` runs an exact schedule not proven least."""
    from passes.schedule import plan_schedule

    schedule = plan_schedule(plan.segments)
    return schedule is not None and not schedule.optimal


@contextmanager
def _plans_in_hand() -> Iterator[list[tuple]]:
    """The segments of each plan in hand the budget search asks the exact solver to beat."""
    import passes.budget_search

    asked: list[tuple] = []
    real = passes.budget_search.exact_plan

    def watched(graph: nx.DiGraph, budget_bytes: float, *args: Any, **kwargs: Any) -> Any:
        asked.append(tuple(kwargs.get("start", ())))
        return real(graph, budget_bytes, *args, **kwargs)

    passes.budget_search.exact_plan = watched
    try:
        yield asked
    finally:
        passes.budget_search.exact_plan = real


def segments_summary(graph: nx.DiGraph, segments: tuple) -> dict[str, Any]:
    """:func:`plan_summary` of the plan running ``segments``."""
    from passes.simulate import simulate

    simulation = simulate(graph, segments)
    return _summary(segments, simulation.peak_bytes, simulation.recompute_flops)


def zoo_cost_graphs() -> dict[str, nx.DiGraph]:
    """Every zoo model's measured cost graph at its default size."""
    from graphckpt.api import cost_model
    from graphckpt.tools import zoo

    graphs = {}
    for name in zoo.names():
        model, inputs = zoo.make(name)
        graphs[name] = cost_model(model, inputs)[1]
    return graphs


def write_snapshot(path: Path = SNAPSHOT) -> None:
    """Cost graphs and plans of the zoo, as they are now."""
    entries = {name: {"graph": graph_to_data(graph), "plans": plans_of(graph)}
               for name, graph in zoo_cost_graphs().items()}
    path.write_text(json.dumps(entries, indent=None, sort_keys=True))


if __name__ == "__main__":
    write_snapshot()
    print(f"wrote {SNAPSHOT}")
