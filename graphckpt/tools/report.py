"""A plan as data a person or a program reads: rows, a JSON document, rich tables.

Everything here reads a cost graph (:mod:`passes.costgraph`'s node attributes) and a
:class:`passes.plan.Plan`; nothing runs the model. ``graphckpt inspect`` and ``compare``
print what these functions return, and ``--json`` dumps the same dictionaries, so the
table and the JSON never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import networkx as nx
from rich.console import Group
from rich.table import Table
from rich.text import Text

from passes.graph_facts import op_nodes
from passes.hooked import remake_phrase
from passes.kept_bytes import storage_bytes
from passes.plan import Plan
from passes.recompute import recomputed_nodes
from passes.schedule import describe as describe_schedule
from passes.segments import Segment
from passes.sim_peak import PeakBreakdown
from passes.strategies import STRATEGIES
from passes.units import format_bytes

JSON_VERSION = 1


def human_flops(flops: float, unit: str = "FLOPs") -> str:
    """``4194304`` -> ``"4.19 MFLOP"``: decimal units as FLOP counters use. A graph costed in
    measured time (``unit="ns"``) counts nanoseconds: ``4194304`` -> ``"4.19 ms"``."""
    if unit == "ns":
        return f"{flops / 1e6:.3g} ms"
    value = float(flops)
    for unit in ("", "k", "M", "G", "T"):
        if abs(value) < 1000 or unit == "T":
            return f"{value:.3g} {unit}FLOP"
        value /= 1000
    raise AssertionError("unreachable")


def ratio(part: float, whole: float) -> float:
    """``part / whole``, 0 when ``whole`` is 0 (a graph with no FLOPs, say)."""
    return part / whole if whole else 0.0


def recomputed_flops(graph: nx.DiGraph, segment: Segment) -> int:
    """FLOPs backward spends running ``segment`` again (:func:`passes.plan.recomputed_nodes`:
    as far as the recompute needs, less ``saved_inside``, recomputed children once more)."""
    return sum(graph.nodes[n]["flops"] for n in recomputed_nodes(graph, [segment]))


def segment_dict(graph: nx.DiGraph, segment: Segment, index: str) -> dict[str, Any]:
    """One segment as plain data; nested ``children`` the same way."""
    return {
        "index": index,
        "nodes": len(segment.nodes),
        "first": segment.nodes[0],
        "last": segment.nodes[-1],
        "recompute": segment.recompute,
        "inputs": list(segment.inputs),
        "outputs": list(segment.outputs),
        "boundary_bytes": storage_bytes(graph, segment.outputs),
        "saved_inside": list(segment.saved_inside),
        "remake_each_use": segment.remake_each_use,
        "remake_held": list(segment.remake_held),
        "schedule_steps": describe_schedule(segment.schedule) if segment.schedule is not None else [],
        "recompute_flops": recomputed_flops(graph, segment),
        "children": [segment_dict(graph, child, f"{index}.{i}") for i, child in enumerate(segment.children)],
    }


def flatten_segments(segments: Sequence[Mapping[str, Any]], depth: int = 0) -> list[dict[str, Any]]:
    """Nested segment dicts in display order, each with its nesting ``depth``."""
    rows: list[dict[str, Any]] = []
    for segment in segments:
        rows.append({**segment, "depth": depth})
        rows.extend(flatten_segments(segment["children"], depth + 1))
    return rows


def checkpoint_dicts(graph: nx.DiGraph, plan: Plan) -> list[dict[str, Any]]:
    """The values kept from forward at the edges of recomputed segments."""
    return [{
        "node": name,
        "label": graph.nodes[name]["label"],
        "shape": graph.nodes[name].get("shape", ""),
        "dtype": graph.nodes[name].get("dtype", ""),
        "bytes": storage_bytes(graph, [name]),
    } for name in plan.checkpoints]


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The plan's headline numbers (simulated peak, recompute) as a flat dict."""
    return {
        "strategy_used": plan.strategy,
        "peak_bytes": int(plan.peak_bytes),
        "eager_peak_bytes": int(plan.eager_peak_bytes),
        "peak_ratio": round(ratio(plan.peak_bytes, plan.eager_peak_bytes), 4),
        "recompute_flops": int(plan.recompute_flops),
        "forward_flops": int(plan.forward_flops),
        "recompute_fraction": round(ratio(plan.recompute_flops, plan.forward_flops), 4),
        "recompute_bytes": int(plan.recompute_bytes),
        "checkpoint_bytes": int(plan.checkpoint_bytes),
        "segment_count": len(plan.segments),
        "recomputed_segment_count": sum(s.recompute for s in plan.segments),
        "notes": list(plan.notes),
    }


def plan_document(graph: nx.DiGraph, plan: Plan, *, target: str, capture: str, strategy: str,
                  budget: str | None = None, planning_seconds: float | None = None) -> dict[str, Any]:
    """The ``inspect --json`` document: stable top-level keys, every size in bytes."""
    return {
        "version": JSON_VERSION,
        "target": target,
        "capture": capture,
        "strategy": strategy,
        "budget": budget,
        "cost_unit": plan.cost_unit,
        **plan_summary(plan),
        "planning_seconds": planning_seconds,
        "graph": {"nodes": graph.number_of_nodes(), "op_nodes": len(op_nodes(graph)),
                  "edges": graph.number_of_edges()},
        "checkpoints": checkpoint_dicts(graph, plan),
        "segments": [segment_dict(graph, s, str(i)) for i, s in enumerate(plan.segments)],
    }


PEAK_ROWS = 15  # storages listed at the peak; the rest are summed in their kinds
VALUE_SHAPED = ("activation", "recomputed copy", "gradient", "partial gradient")  # shaped as their node's value


def peak_dict(graph: nx.DiGraph, breakdown: PeakBreakdown, rows: int = PEAK_ROWS) -> dict[str, Any]:
    """What is alive at a plan's simulated peak (:func:`passes.sim_peak.peak_breakdown`):
    bytes per kind, and the ``rows`` largest storages, each with its node's label and shape."""
    return {
        "peak_bytes": breakdown.peak_bytes,
        "reached_by": breakdown.reached_by,
        "storage_count": len(breakdown.storages),
        "bytes_by_kind": breakdown.bytes_by_kind(),
        "largest": [{
            "node": storage.name,
            "kind": storage.kind,
            "recompute_depth": storage.level,
            "label": graph.nodes[storage.name]["label"] if storage.name in graph else "",
            "shape": graph.nodes[storage.name].get("shape", "") if storage.kind in VALUE_SHAPED else "",
            "bytes": storage.bytes,
        } for storage in breakdown.storages[:rows]],
    }


def compare_strategies(graph: nx.DiGraph, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Run every strategy (default: all of :data:`STRATEGIES`) on ``graph`` and time it.

    A strategy that raises gets a row with its ``error`` instead of numbers, so one broken
    or not-applicable strategy does not hide the others.
    """
    rows = []
    for name in names if names is not None else list(STRATEGIES):
        start = time.perf_counter()
        try:
            plan = STRATEGIES[name](graph)
        except Exception as error:  # report, keep comparing the rest
            rows.append({"strategy": name, "error": f"{type(error).__name__}: {error}"})
            continue
        seconds = time.perf_counter() - start
        rows.append({"strategy": name, **plan_summary(plan), "checkpoints": len(plan.checkpoints),
                     "planning_seconds": round(seconds, 4)})
    return rows


# ---------------------------------------------------------------- rich rendering


def _segment_table(document: Mapping[str, Any]) -> Table:
    unit = document.get("cost_unit", "FLOPs")
    table = Table(title="segments (in execution order)", title_justify="left", title_style="bold")
    for header, justify in (("#", "right"), ("nodes", "right"), ("first .. last", "left"),
                            ("backward", "left"), ("kept at boundary", "right"), ("recomputed", "right")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in flatten_segments(document["segments"]):
        indent = "  " * row["depth"]
        what = Text("recomputed", style="yellow") if row["recompute"] else Text("kept", style="green")
        if row.get("schedule_steps"):
            what = Text("exact schedule", style="yellow")
            what.append(f" ({len(row['saved_inside'])} kept, {len(row['schedule_steps'])} steps making values "
                        "again)", style="dim")
        elif row["saved_inside"]:
            what.append(f" ({len(row['saved_inside'])} kept inside)", style="dim")
        remakes = remake_phrase(row.get("remake_each_use", False), len(row.get("remake_held", ())))
        if remakes:
            what.append(f" ({remakes})", style="dim")
        table.add_row(indent + row["index"], str(row["nodes"]), f"{indent}{row['first']} .. {row['last']}",
                      what, format_bytes(row["boundary_bytes"]) if row["recompute"] else "-",
                      human_flops(row["recompute_flops"], unit) if row["recompute"] else "-")
    return table


def _checkpoint_table(document: Mapping[str, Any]) -> Table:
    table = Table(title=f"checkpoints: {len(document['checkpoints'])} value(s) kept for backward, "
                        f"{format_bytes(document['checkpoint_bytes'])}", title_justify="left", title_style="bold")
    for header, justify in (("node", "left"), ("module / op", "left"), ("shape", "left"),
                            ("dtype", "left"), ("bytes", "right")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in document["checkpoints"]:
        table.add_row(row["node"], row["label"], row["shape"], row["dtype"], format_bytes(row["bytes"]))
    return table


def peak_table(peak: Mapping[str, Any], whose: str = "the") -> Table:
    """The ``at_peak`` part of a document (:func:`peak_dict`) as a table, its kinds in the
    title, which names ``whose`` peak it is."""
    kinds = ", ".join(f"{kind} {format_bytes(nbytes)}" for kind, nbytes in peak["bytes_by_kind"].items())
    table = Table(title=f"at {whose} simulated peak, {format_bytes(peak['peak_bytes'])} in {peak['storage_count']} "
                        f"storages (reached by {peak['reached_by']}): {kinds}",
                  title_justify="left", title_style="bold")
    for header, justify in (("node", "left"), ("module / op", "left"), ("what", "left"), ("shape", "left"),
                            ("bytes", "right")):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in peak["largest"]:
        depth = f" (recompute depth {row['recompute_depth']})" if row["recompute_depth"] else ""
        table.add_row(row["node"], row["label"], row["kind"] + depth, row["shape"], format_bytes(row["bytes"]))
    return table


def summary_text(document: Mapping[str, Any]) -> Text:
    """Simulated peak vs eager, recompute share, capture path and notes, a few lines."""
    text = Text()
    used = document["strategy_used"]
    chosen = document["strategy"] if used == document["strategy"] else f"{document['strategy']} -> {used}"
    text.append(f"{document['target']}", style="bold")
    text.append(f"   captured with {document['capture']}, strategy {chosen}"
                + (f", budget {document['budget']}" if document.get("budget") else "") + "\n")
    text.append("simulated peak ")
    text.append(format_bytes(document["peak_bytes"]), style="bold cyan")
    text.append(f" vs eager {format_bytes(document['eager_peak_bytes'])} ")
    text.append(f"({document['peak_ratio']:.2f}x)", style="bold")
    unit = document.get("cost_unit", "FLOPs")
    what = "forward time" if unit == "ns" else "forward FLOPs"
    text.append(f"; recompute {document['recompute_fraction']:.0%} of {what} "
                f"({human_flops(document['recompute_flops'], unit)} of {human_flops(document['forward_flops'], unit)})")
    if document.get("planning_seconds") is not None:
        text.append(f"; captured, costed and planned in {document['planning_seconds']:.2f} s")
    for note in document["notes"]:
        text.append(f"\nnote: {note}", style="dim")
    return text


def inspect_view(document: Mapping[str, Any], *, checkpoints: bool = True) -> Group:
    """What ``graphckpt inspect`` prints: the summary, segments and (unless ``checkpoints``
    is false, as in the demo, where they run to dozens of rows) checkpoints tables, and what
    is alive at the peak when the document has it (``inspect --peak``)."""
    tables = (_segment_table(document), _checkpoint_table(document)) if checkpoints else (_segment_table(document),)
    if "at_peak" in document:
        tables = (*tables, peak_table(document["at_peak"]))
    return Group(summary_text(document), *tables)


def compare_table(rows: Sequence[Mapping[str, Any]], title: str) -> Table:
    """Strategies side by side: simulated peak and its ratio to eager, recompute, timing."""
    table = Table(title=title, title_justify="left", title_style="bold")
    for header in ("strategy", "used", "simulated peak", "vs eager", "recompute", "checkpoints",
                   "segments", "planning"):
        table.add_column(header, justify="left" if header in ("strategy", "used") else "right")
    best = min((r["peak_bytes"] for r in rows if "error" not in r), default=None)
    for row in rows:
        if "error" in row:
            table.add_row(row["strategy"], Text(row["error"], style="red"), *[""] * 6)
            continue
        style = "bold green" if row["peak_bytes"] == best else ""
        table.add_row(row["strategy"], row["strategy_used"], Text(format_bytes(row["peak_bytes"]), style=style),
                      f"{row['peak_ratio']:.2f}x", f"{row['recompute_fraction']:.0%}", str(row["checkpoints"]),
                      str(row["segment_count"]), f"{row['planning_seconds'] * 1e3:.0f} ms")
    return table
