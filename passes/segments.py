"""Segments: the op nodes of a cost graph run together, and what backward recomputes of them.

A plan (:class:`passes.plan.Plan`) partitions the op nodes of a cost graph into
:class:`Segment` s run one after another. A segment with ``recompute=True`` keeps only its
inputs and outputs after forward; everything inside it is recomputed during backward. A
segment with ``recompute=False`` runs like eager code.

A recomputed segment may itself be split into ``children`` (nesting, Chen et al.'s
recursive variant): when backward recomputes it, its children run like a plan of their
own, so a recomputed child again keeps only its edges and is recomputed once more when
backward reaches it. Less memory, more recompute.

This module makes, checks and nests segments; :mod:`passes.recompute` says what backward
recomputes of them and what that costs; :mod:`passes.plan` turns segments into a simulated plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import networkx as nx

from passes.graph_facts import in_order, is_activation, keeps_order, leaves_nothing, op_nodes
from passes.hooked import holdable
from passes.kept_bytes import boundary_bytes
from passes.remat import Remat, kept_inputs, validate_remat
from passes.schedule import Schedule, ScheduleError, check_schedule, plan_schedule


class PlanError(ValueError):
    """A plan does not fit its cost graph (a value used before it exists, ...)."""


@dataclass(frozen=True)
class RecomputeFacts:
    """What running a recomputed segment needs from the cost graph, so that codegen builds
    it from the plan alone (:func:`passes.recompute.with_facts`).

    ``kept_bytes``: bytes its inputs keep alive from forward (each storage once).
    ``draws_random``: whether it may draw random numbers, so its recompute replays the
    generator's state. ``reruns``: the nodes one recompute runs (:func:`passes.recompute.rerun_nodes`).
    ``state_inputs``: positions in ``inputs`` of ``state`` values (buffers it updates in
    place), which a recompute gets scratch copies of. ``kept_whole``: the ``saved_inside``
    values kept whole (every op of the node), not only their matmul/convolution kernels as
    for an ``expensive`` node. ``by_hooks``: it runs its one op as eager code with saved-tensor
    hooks dropping its rematerialized inputs, not through a checkpoint call
    (:func:`passes.remat.runs_by_hooks`). ``keeps_by_hooks``: a selective segment run as eager
    code under saved-tensor hooks that drop the saved copies of the values in ``remakes``
    (:mod:`passes.hooked`), not through torch's selective checkpointing; ``remakes`` holds
    them by group, each made again on its own (:func:`passes.hooked.remake_groups`) by the
    ops of ``remake_ops`` (in order, one tuple a group: :func:`passes.hooked.remake_units`), and
    ``redrawn`` the dropouts among them drawn again from forward's generator state
    (:func:`passes.hooked.redrawn`). With ``remake_each_use`` each marked value is a group
    of its own, made again at every unpack (:attr:`Segment.remake_each_use`), and so is
    each value of ``remake_held``, held once made (:attr:`Segment.remake_held`);
    ``remake_closures`` then gives, remake by remake, its value and the held values making
    it may make first (:func:`passes.hooked.remake_closures`).
    """

    kept_bytes: float
    draws_random: bool
    reruns: tuple[str, ...]
    state_inputs: tuple[int, ...]
    kept_whole: tuple[str, ...] = ()
    by_hooks: bool = False
    keeps_by_hooks: bool = False
    remakes: tuple[tuple[str, ...], ...] = ()
    remake_ops: tuple[tuple[str, ...], ...] = ()
    redrawn: tuple[str, ...] = ()
    remake_each_use: bool = False
    remake_held: tuple[str, ...] = ()
    remake_closures: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Segment:
    """Op nodes run together, in execution order, with the values crossing their edges.

    ``saved_inside`` (recomputed segments only) are values kept from forward instead of
    recomputed: selective checkpointing of matmul and convolution outputs.
    ``children`` (recomputed segments only) split ``nodes`` into segments run when the
    segment is recomputed; empty means the recompute keeps everything it computes.
    ``facts`` (recomputed segments of a :class:`passes.plan.Plan`) say what codegen needs
    to know of the cost graph; they follow from the fields above and the graph, so they
    take no part in comparing segments.
    ``remat`` (top-level recomputed segments only) are inputs dropped after forward and
    recomputed without gradients from kept values when the segment is recomputed
    (:mod:`passes.remat`).
    ``remake_each_use`` (segments run by saved-tensor hooks only, :mod:`passes.hooked`):
    backward makes a dropped value again for each op that unpacks it, from the inputs and
    kept values, and lets it go after that op's backward, instead of making its group once
    and holding it to its last use: less memory for more recompute, as the exact schedule
    does at tight budgets (:func:`passes.hooked.value_recipe`).
    ``remake_held`` (with ``remake_each_use``): values of the segment that, once made again,
    are held until no remake or op left may need them, and recipes start from them rather
    than from further back (:func:`passes.hooked.each_use_schedule`): between remaking every
    use and remaking each group once.
    ``schedule``: the segment (every op of the graph) runs the exact solver's schedule
    (:mod:`passes.exact`); ``saved_inside`` are then the values it keeps from forward, and
    no other field above applies.
    """

    nodes: tuple[str, ...]
    recompute: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    saved_inside: tuple[str, ...] = ()
    children: tuple[Segment, ...] = ()
    facts: RecomputeFacts | None = field(default=None, compare=False, repr=False)
    remat: tuple[Remat, ...] = ()
    remake_each_use: bool = False
    remake_held: tuple[str, ...] = ()
    schedule: Schedule | None = None

    @property
    def depth(self) -> int:
        """Levels of recomputation inside this segment: 0 when nothing is recomputed, 1
        for a flat recomputed segment, 2 when a child is recomputed again, ..."""
        if not self.recompute:
            return 0
        return 1 + max((child.depth for child in self.children), default=0)


Step = str | Segment  # one step of a recompute: an op, or a recomputed child run as a whole


def segment_edges(graph: nx.DiGraph, nodes: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The values a group of nodes reads from outside and the ones read after it.

    Parameters are inputs too (recomputation needs them); the output sink is not a node of
    any segment, so values it reads are outputs.
    """
    inside = set(nodes)
    inputs = {u for v in nodes for u in graph.predecessors(v) if u not in inside}
    outputs = {v for v in nodes if any(w not in inside for w in graph.successors(v))}
    return tuple(in_order(graph, inputs)), tuple(in_order(graph, outputs))


def make_segments(graph: nx.DiGraph, groups: Iterable[tuple[Iterable[str], bool]]) -> tuple[Segment, ...]:
    """Segments from ``(nodes, recompute)`` groups; empty groups dropped, neighbours of
    the same kind with nothing recomputed merged, non-recomputable nodes split out."""
    pieces: list[tuple[list[str], tuple | None]] = []  # (nodes, edges when recomputed)
    for nodes, recompute in groups:
        for piece, flag in _split_unrecomputable(graph, in_order(graph, nodes), recompute):
            edges = segment_edges(graph, piece) if flag else None
            if edges is not None and not _edges_cuttable(graph, edges):
                edges = None
            if pieces and edges is None and pieces[-1][1] is None:
                pieces[-1][0].extend(piece)
            else:
                pieces.append((list(piece), edges))
    return tuple(Segment(tuple(nodes), edges is not None, *(edges or segment_edges(graph, nodes)))
                 for nodes, edges in pieces if nodes)


def _edges_cuttable(graph: nx.DiGraph, edges: tuple[tuple[str, ...], tuple[str, ...]]) -> bool:
    """Whether every value crossing a group's edge (:func:`segment_edges`) may be kept at a boundary."""
    inputs, outputs = edges
    return all(graph.nodes[v]["cuttable"] for v in (*inputs, *outputs))


def _split_unrecomputable(graph: nx.DiGraph, nodes: list[str], recompute: bool):
    """Yield runs of ``nodes``: nodes that may not be recomputed become kept runs."""
    if not recompute:
        yield nodes, False
        return
    run: list[str] = []
    for name in nodes:
        if graph.nodes[name]["recomputable"]:
            run.append(name)
            continue
        if run:
            yield run, True
            run = []
        yield [name], False
    if run:
        yield run, True


def checkpoints_of(graph: nx.DiGraph, segments: Sequence[Segment]) -> tuple[str, ...]:
    """Activations kept at the edges of recomputed segments (and the sources of inputs they
    rematerialize), but the values only rematerialized inputs and the inputs of a segment
    whose call keeps nothing (:func:`passes.graph_facts.leaves_nothing`: they go at their
    last use, as in eager code)."""
    if plan_schedule(segments) is not None:  # the values its schedule keeps
        return tuple(in_order(graph, {v for s in segments for v in s.saved_inside if is_activation(graph, v)}))
    held = {v for s in segments if s.recompute and not leaves_nothing(graph, s) for v in kept_inputs(s)}
    dropped = {r.value for s in segments for r in s.remat} - held
    edges = held | {v for s in segments if s.recompute for v in s.outputs}
    kept = {v for v in edges if is_activation(graph, v) and v not in dropped}
    return tuple(in_order(graph, kept))


def validate_plan(graph: nx.DiGraph, segments: Sequence[Segment]) -> None:
    """Raise :class:`PlanError` unless the segments are a runnable, safe partition.

    Every op node sits in exactly one segment; a segment only reads values computed by an
    earlier segment (or inputs and parameters); recomputed segments hold only recomputable
    nodes and keep only cuttable values at their edges, so each recomputed value can be
    computed again from kept ones; random ops and in-place writes run in their eager order.
    """
    done = {n for n, kind in graph.nodes(data="kind") if kind in ("input", "param")}
    expected = set(op_nodes(graph))
    ordered = [n for s in segments for n in s.nodes if keeps_order(graph, n)]
    if ordered != in_order(graph, ordered):
        raise PlanError(f"random ops or in-place writes run out of their eager order: {ordered}")
    for index, segment in enumerate(segments):
        for name in segment.nodes:
            if name not in expected:
                raise PlanError(f"segment {index}: {name!r} is not an op node, or is in two segments")
            expected.discard(name)
            missing = [u for u in graph.predecessors(name) if u not in done]
            if missing:
                raise PlanError(f"segment {index}: {name!r} reads {missing} before they are computed")
            done.add(name)
        _validate_shape(graph, segment, f"segment {index}")
    if expected:
        raise PlanError(f"op nodes in no segment: {in_order(graph, expected)}")
    validate_remat(graph, segments, PlanError)


def _validate_shape(graph: nx.DiGraph, segment: Segment, where: str) -> None:
    """Check one segment's edges, recompute safety, selective values and children."""
    if (segment.inputs, segment.outputs) != segment_edges(graph, segment.nodes):
        raise PlanError(f"{where}: inputs/outputs do not match the graph")
    if not segment.recompute:
        if segment.saved_inside or segment.children or segment.schedule:
            raise PlanError(f"{where}: only recomputed segments have saved_inside, children or a schedule")
        return
    if segment.schedule is not None:
        _validate_scheduled(graph, segment, where)
        return
    bad = [n for n in segment.nodes if not graph.nodes[n]["recomputable"]]
    if bad:
        raise PlanError(f"{where} recomputes {bad}, which may not be recomputed")
    edge_values = [*segment.inputs, *segment.outputs]
    if boundary_bytes(graph, edge_values) == float("inf"):
        stuck = [v for v in edge_values if not graph.nodes[v]["cuttable"]]
        raise PlanError(f"{where} keeps {stuck}, which are written in place later")
    if not set(segment.saved_inside) <= set(segment.nodes):
        raise PlanError(f"{where}: saved_inside must be nodes of the segment")
    if segment.remake_held and not (segment.remake_each_use and set(segment.remake_held) <= set(holdable(graph, segment))):
        raise PlanError(f"{where}: remake_held must be values it may hold once made again "
                        "(passes.hooked.holdable), with remake_each_use")
    if segment.children:
        if segment.saved_inside:
            raise PlanError(f"{where}: a segment with children keeps nothing from forward (saved_inside)")
        if tuple(n for child in segment.children for n in child.nodes) != segment.nodes:
            raise PlanError(f"{where}: children must split the segment's nodes in order")
        for index, child in enumerate(segment.children):
            _validate_shape(graph, child, f"{where}.{index}")


def _validate_scheduled(graph: nx.DiGraph, segment: Segment, where: str) -> None:
    """Check a segment run by an exact schedule: every op, nothing else set, a schedule
    that runs (:func:`passes.schedule.check_schedule`)."""
    if segment.nodes != tuple(op_nodes(graph)) or segment.children or segment.remat or segment.remake_held:
        raise PlanError(f"{where}: a scheduled segment holds every op and no children, remat or held values")
    if segment.saved_inside != segment.schedule.kept:
        raise PlanError(f"{where}: saved_inside must be what its schedule keeps")
    try:
        check_schedule(graph, segment.schedule)
    except ScheduleError as error:
        raise PlanError(f"{where}: {error}") from None


def merge_kept(graph: nx.DiGraph, segments: Iterable[Segment]) -> tuple[Segment, ...]:
    """``segments`` with neighbouring kept segments joined into one."""
    merged: list[Segment] = []
    for segment in segments:
        if merged and not segment.recompute and not merged[-1].recompute:
            nodes = merged[-1].nodes + segment.nodes
            merged[-1] = Segment(nodes, False, *segment_edges(graph, nodes))
        else:
            merged.append(segment)
    return tuple(merged)


def nested(graph: nx.DiGraph, children: Iterable[Segment]) -> Segment:
    """The recomputed segment made of ``children`` (ready segments, in order): when backward
    recomputes it, its recomputed children keep only their edges and are recomputed again
    when backward reaches them. A parent whose children are all kept is a flat recomputed
    segment."""
    merged = merge_kept(graph, children)
    nodes = tuple(n for child in merged for n in child.nodes)
    kept_only = all(not child.recompute for child in merged)
    return Segment(nodes, True, *segment_edges(graph, nodes), children=() if kept_only else merged)
