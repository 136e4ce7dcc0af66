"""Pictures of a cut: the cost graph with each segment a colour and the checkpoints marked.

:func:`cut_view` turns a cost graph and a plan into the graph to draw. Small graphs are
drawn op by op (parameters hidden: they are never activation memory); above
``COLLAPSE_ABOVE`` op nodes each segment becomes one box labelled with its size, and only
the values crossing segments are drawn, so the picture stays legible. :func:`write_dot`
emits Graphviz text (no Graphviz needed to write it), :func:`draw_cut` draws the same view
with matplotlib (PNG, SVG, PDF, by the file's suffix), laid out by execution order in rows
that snake left-right-left.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import networkx as nx

from graphckpt.tools.report import human_flops, recomputed_flops
from passes.graph_facts import in_order, is_activation
from passes.kept_bytes import storage_bytes
from passes.plan import Plan
from passes.units import format_bytes

COLLAPSE_ABOVE = 60
PALETTE = ("#8dd3c7", "#fdb462", "#bebada", "#80b1d3", "#b3de69", "#fccde5",
           "#ffed6f", "#fb8072", "#bc80bd", "#ccebc5", "#d9d9a0", "#9ecae1")
KEPT_FILL = "#ececec"
IO_FILL = "#ffffff"
CHECKPOINT = "#c0162c"
EDGE_GREY = "#7f7f7f"
ASPECT = 1.8  # width / height the layout aims for
ROW_GAP = 0.6  # blank space between rows of the snake, in node heights


def segment_colours(plan: Plan) -> list[str]:
    """One fill colour per segment: recomputed ones cycle through ``PALETTE``, kept grey."""
    colours, next_colour = [], 0
    for segment in plan.segments:
        if segment.recompute:
            colours.append(PALETTE[next_colour % len(PALETTE)])
            next_colour += 1
        else:
            colours.append(KEPT_FILL)
    return colours


def _short(text: str, limit: int = 22) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _value_caption(graph: nx.DiGraph, name: str) -> str:
    attributes = graph.nodes[name]
    shape = attributes.get("shape", "")
    return f"{shape} · {format_bytes(storage_bytes(graph, [name]))}" if shape else format_bytes(storage_bytes(graph, [name]))


def _add(view: nx.DiGraph, name: str, label: str, role: str, fill: str, order: float, **extra: Any) -> None:
    view.add_node(name, label=label, role=role, fill=fill, order=order, checkpoint=extra.pop("checkpoint", False),
                  **extra)


def _full_view(graph: nx.DiGraph, plan: Plan) -> nx.DiGraph:
    """Every input, op and the output; op fills by segment, checkpoints flagged."""
    colours = segment_colours(plan)
    segment_of = {n: i for i, s in enumerate(plan.segments) for n in s.nodes}
    checkpoints = set(plan.checkpoints)
    view = nx.DiGraph(collapsed=False)
    for name in in_order(graph):
        kind = graph.nodes[name]["kind"]
        if kind == "param":
            continue
        label = _short(graph.nodes[name]["label"])
        if kind == "op":
            if name in checkpoints:
                label += "\n" + _value_caption(graph, name)
            _add(view, name, label, "op", colours[segment_of[name]], graph.nodes[name]["order"],
                 segment=segment_of[name], checkpoint=name in checkpoints)
        else:
            _add(view, name, label, kind, IO_FILL, graph.nodes[name]["order"])
    view.add_edges_from((u, v) for u, v in graph.edges if u in view and v in view)
    return view


def _segment_label(graph: nx.DiGraph, plan: Plan, index: int) -> str:
    segment = plan.segments[index]
    count = len(segment.nodes)
    span = (_short(segment.nodes[0], 16) if count == 1
            else f"{_short(segment.nodes[0], 16)} … {_short(segment.nodes[-1], 16)}")
    flops = recomputed_flops(graph, segment)
    what = "recomputed" if segment.recompute else "kept"
    nested = len(segment.children)
    if nested:
        what += f" ({nested} nested)"
    if segment.recompute and flops:
        what += f" · {human_flops(flops)}"
    return "\n".join([f"segment {index} · {count} op{'s' if count != 1 else ''}", span, what])


def _collapsed_view(graph: nx.DiGraph, plan: Plan) -> nx.DiGraph:
    """One box per segment, the activations crossing segments, inputs and the output."""
    colours = segment_colours(plan)
    segment_of = {n: i for i, s in enumerate(plan.segments) for n in s.nodes}
    checkpoints = set(plan.checkpoints)
    view = nx.DiGraph(collapsed=True)
    for index, segment in enumerate(plan.segments):
        first = graph.nodes[segment.nodes[0]]["order"]
        _add(view, f"segment {index}", _segment_label(graph, plan, index), "segment", colours[index], first,
             segment=index)

    def box(name: str) -> str:
        kind = graph.nodes[name]["kind"]
        return f"segment {segment_of[name]}" if kind == "op" else name

    for name in in_order(graph):
        kind = graph.nodes[name]["kind"]
        readers = {box(r) for r in graph.successors(name)} - {box(name) if kind == "op" else ""}
        if kind == "input" or kind == "output":
            _add(view, name, f"{name}\n{graph.nodes[name].get('shape', '')}".strip(), kind, IO_FILL,
                 graph.nodes[name]["order"])
        elif kind == "op" and readers and is_activation(graph, name) and storage_bytes(graph, [name]) > 0:
            _add(view, name, f"{_short(name)}\n{_value_caption(graph, name)}", "value", IO_FILL,
                 graph.nodes[name]["order"] + 0.5, checkpoint=name in checkpoints)
            view.add_edge(box(name), name)
        else:
            continue
        view.add_edges_from((name, reader) for reader in readers if reader != name)
    view.add_edges_from((box(u), box(v)) for u, v in graph.edges if graph.nodes[u]["kind"] == "op"
                        and box(u) != box(v) and u not in view and box(v) in view)
    return view


def cut_view(graph: nx.DiGraph, plan: Plan, collapse: bool | None = None) -> nx.DiGraph:
    """The graph to draw: op by op, or one box per segment when ``collapse`` (default: more
    than ``COLLAPSE_ABOVE`` op nodes). Node attributes: ``label``, ``role``, ``fill``,
    ``order``, ``checkpoint`` and (ops, segments) ``segment``."""
    ops = sum(1 for _, kind in graph.nodes(data="kind") if kind == "op")
    if collapse is None:
        collapse = ops > COLLAPSE_ABOVE
    return _collapsed_view(graph, plan) if collapse else _full_view(graph, plan)


# ---------------------------------------------------------------- DOT


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_node(name: str, attributes: Mapping[str, Any]) -> str:
    shape = "box" if attributes["role"] in ("op", "segment") else "ellipse"
    style = ["filled", "rounded"] if shape == "box" else ["filled"]
    border = f'color={_quote(CHECKPOINT)}, penwidth=3' if attributes["checkpoint"] else "color=\"#555555\""
    return (f"  {_quote(name)} [label={_quote(attributes['label'])}, shape={shape}, "
            f"style={_quote(','.join(style))}, fillcolor={_quote(attributes['fill'])}, {border}];")


def to_dot(view: nx.DiGraph, title: str = "") -> str:
    """Graphviz text for a :func:`cut_view`; op-level views group each segment in a cluster."""
    lines = ["digraph cut {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];',
             f"  label={_quote(title)}; labelloc=t;"]
    clusters: dict[int, list[str]] = {}
    for name, attributes in view.nodes(data=True):
        if attributes["role"] == "op":
            clusters.setdefault(attributes["segment"], []).append(_dot_node(name, attributes))
        else:
            lines.append(_dot_node(name, attributes))
    for index, members in sorted(clusters.items()):
        lines += [f"  subgraph cluster_{index} {{", f"    label={_quote(f'segment {index}')}; style=dashed;",
                  *("  " + m for m in members), "  }"]
    lines += [f"  {_quote(u)} -> {_quote(v)};" for u, v in view.edges]
    return "\n".join([*lines, "}"]) + "\n"


def write_dot(view: nx.DiGraph, path: str | Path, title: str = "") -> None:
    """Write :func:`to_dot` to ``path``."""
    Path(path).write_text(to_dot(view, title))


# ---------------------------------------------------------------- layout


def layers(view: nx.DiGraph) -> dict[str, int]:
    """Longest-path layer of each node; sources sit just before their first reader."""
    layer: dict[str, int] = {}
    for node in nx.lexicographical_topological_sort(view, key=lambda n: view.nodes[n]["order"]):
        layer[node] = max((layer[p] + 1 for p in view.predecessors(node)), default=0)
    for node in view:
        if view.in_degree(node) == 0 and view.out_degree(node):
            layer[node] = max(0, min(layer[s] for s in view.successors(node)) - 1)
    return layer


def _rows(count: int, stack: Sequence[int], aspect: float) -> int:
    """Layers per row so that the picture's width/height is closest to ``aspect``."""
    def badness(per_row: int) -> float:
        rows = [max(stack[i:i + per_row]) for i in range(0, count, per_row)]
        height = sum(rows) + ROW_GAP * (len(rows) - 1)
        return abs(math.log(per_row / max(height, 1) / aspect))
    return min(range(1, count + 1), key=badness)


def snake_layout(view: nx.DiGraph, aspect: float = 2.0) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
    """Positions in layer-columns wrapped into rows that alternate direction, and each
    node's row; the nodes of one layer are stacked vertically. Units: one column, one node
    height."""
    layer = layers(view)
    by_layer: dict[int, list[str]] = {}
    for node in sorted(view, key=lambda n: view.nodes[n]["order"]):
        by_layer.setdefault(layer[node], []).append(node)
    count = max(by_layer) + 1
    stack = [len(by_layer.get(i, ())) for i in range(count)]
    per_row = _rows(count, stack, aspect)
    positions: dict[str, tuple[float, float]] = {}
    row_of: dict[str, int] = {}
    top = 0.0
    for row, start in enumerate(range(0, count, per_row)):
        height = max(stack[start:start + per_row])
        for column in range(start, min(start + per_row, count)):
            x = column - start if row % 2 == 0 else per_row - 1 - (column - start)
            nodes = by_layer.get(column, [])
            for k, node in enumerate(nodes):
                positions[node] = (float(x), -(top + (height - 1) / 2 + k - (len(nodes) - 1) / 2))
                row_of[node] = row
        top += height + ROW_GAP
    return positions, row_of


# ---------------------------------------------------------------- matplotlib


def _box_style(attributes: Mapping[str, Any]) -> dict[str, Any]:
    role = attributes["role"]
    style: dict[str, Any] = {"boxstyle": "round,pad=0.35,rounding_size=0.25" if role != "value"
                             else "round,pad=0.3,rounding_size=0.6",
                             "fc": attributes["fill"], "ec": "#555555", "lw": 0.8}
    if role in ("input", "output"):
        style.update(boxstyle="round,pad=0.35,rounding_size=0.8", ec="#222222", lw=1.1)
    if role == "value" and not attributes["checkpoint"]:
        style.update(ec=EDGE_GREY, ls="--")
    if attributes["checkpoint"]:
        style.update(ec=CHECKPOINT, lw=2.4)
    return style


def _legend_handles(view: nx.DiGraph) -> list[Any]:
    from matplotlib.patches import Patch

    roles = {a["role"] for _, a in view.nodes(data=True)}
    fills = {a["fill"] for _, a in view.nodes(data=True)}
    handles = [Patch(fc=PALETTE[0], ec="#555555", label="recomputed in backward (a colour per segment)")]
    if KEPT_FILL in fills:
        handles.append(Patch(fc=KEPT_FILL, ec="#555555", label="kept segment: runs like eager"))
    handles.append(Patch(fc="white", ec=CHECKPOINT, lw=2.4, label="checkpoint: kept from forward"))
    if "value" in roles:
        handles.append(Patch(fc="white", ec=EDGE_GREY, ls="--", label="other value crossing segments"))
    handles.append(Patch(fc=IO_FILL, ec="#222222", label="input / output"))
    return handles


def _connection(start: tuple[float, float], end: tuple[float, float], rows: tuple[int, int],
                col_in: float, row_in: float) -> tuple[str, bool]:
    """Matplotlib connection style of an edge, and whether it is a long (skip) edge.

    Straight between neighbours: next column of the same row, or the turn of the snake
    straight down into the next row. A long edge in one row bows upwards over the nodes it
    skips; one across rows bends a little, off the grid points it would run through.
    """
    span = abs(end[0] - start[0])
    if (rows[0] == rows[1] and span <= 1) or (rows[1] - rows[0] == 1 and span == 0):
        return "arc3,rad=0", False
    if rows[0] != rows[1]:
        return "arc3,rad=0.18", True
    rad = min(0.45, 0.55 * row_in / (span * col_in))
    return f"arc3,rad={-rad if end[0] > start[0] else rad:.3f}", True


def draw_cut(view: nx.DiGraph, path: str | Path, title: str, subtitle: str = "", dpi: int = 150) -> None:
    """Draw a :func:`cut_view` to ``path`` (format from its suffix: .png, .svg, .pdf)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fontsize = 8.0 if view.graph["collapsed"] else 7.0
    labels = [view.nodes[n]["label"].split("\n") for n in view]
    col_in = max(len(line) for lines in labels for line in lines) * fontsize * 0.62 / 72 + 0.55
    row_in = max(len(lines) for lines in labels) * fontsize * 1.3 / 72 + 0.45
    positions, row_of = snake_layout(view, aspect=ASPECT * row_in / col_in)
    xs = [x for x, _ in positions.values()]
    ys = [y for _, y in positions.values()]
    width, height = (max(xs) - min(xs) + 1) * col_in, (max(ys) - min(ys) + 1) * row_in
    handles = _legend_handles(view)
    columns = len(handles) if width >= 14 else (len(handles) + 1) // 2
    top_in, bottom_in = 0.85, 0.75 if columns == len(handles) else 0.95
    fig = plt.figure(figsize=(max(width, 7.5) + 0.4, height + top_in + bottom_in), dpi=dpi)
    total_h = height + top_in + bottom_in
    ax = fig.add_axes((0.2 / fig.get_figwidth(), bottom_in / total_h, width / fig.get_figwidth(), height / total_h))
    ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    ax.set_ylim(min(ys) - 0.5, max(ys) + 0.5)
    ax.axis("off")
    ghosts = {}  # invisible copies drawn first: arrows are clipped to their boxes, then hidden under the real ones
    for node, (x, y) in positions.items():
        attributes = view.nodes[node]
        for zorder in (1, 3):
            style = _box_style(attributes)
            if zorder == 1:
                style.update(fc="none", ec="none")
            text = ax.text(x, y, attributes["label"], ha="center", va="center", fontsize=fontsize, zorder=zorder,
                           fontweight="bold" if attributes["checkpoint"] else "normal", linespacing=1.25, bbox=style,
                           color="none" if zorder == 1 else CHECKPOINT if attributes["checkpoint"]
                           and attributes["role"] == "value" else "black")
            ghosts.setdefault(node, text)
    texts = ghosts
    for u, v in view.edges:
        style, skip = _connection(positions[u], positions[v], (row_of[u], row_of[v]), col_in, row_in)
        ax.annotate("", xy=positions[v], xytext=positions[u], zorder=2, arrowprops={
            "arrowstyle": "-|>,head_length=0.45,head_width=0.22", "color": "#4a6fa5" if skip else "#5a5a5a",
            "lw": 0.8, "alpha": 0.8, "linestyle": (0, (4, 2)) if skip else "-",
            "shrinkA": 1, "shrinkB": 1, "patchA": texts[u].get_bbox_patch(), "patchB": texts[v].get_bbox_patch(),
            "connectionstyle": style})  # long edges dashed and blue: they read as one line behind boxes
    fig.text(0.2 / fig.get_figwidth(), 1 - 0.3 / total_h, title, fontsize=11.5, fontweight="bold", va="center")
    if subtitle:
        fig.text(0.2 / fig.get_figwidth(), 1 - 0.62 / total_h, subtitle, fontsize=9, color="#333333", va="center")
    fig.legend(handles=handles, loc="lower center", ncol=columns, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.12 / total_h))
    fig.savefig(path, dpi=dpi, facecolor="white")
    plt.close(fig)


def cut_titles(plan: Plan, target: str, strategy: str, capture: str) -> tuple[str, str]:
    """Title (model, strategy, simulated peak vs eager) and subtitle (what the cut keeps)."""
    used = plan.strategy if plan.strategy == strategy else f"{strategy} → {plan.strategy}"
    title = (f"{target} · strategy {used} · simulated peak {format_bytes(plan.peak_bytes)} vs eager "
             f"{format_bytes(plan.eager_peak_bytes)} ({plan.peak_bytes / max(plan.eager_peak_bytes, 1):.2f}×)")
    recomputed = sum(s.recompute for s in plan.segments)
    subtitle = (f"{recomputed} of {len(plan.segments)} segments recomputed in backward, "
                f"{len(plan.checkpoints)} checkpoints ({format_bytes(plan.checkpoint_bytes)}) kept; recompute "
                f"{plan.recompute_flops / max(plan.forward_flops, 1):.0%} of forward FLOPs; captured with {capture}")
    return title, subtitle
