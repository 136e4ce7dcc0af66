"""What a plan keeps from forward, value by value: which values a recomputed segment may keep
(:func:`keepable`), which keeping saves most per byte (:func:`ranked_keeps`) and which least
(:func:`ranked_removals`), and the plan edits that add or remove them (:func:`add_keeps`,
:func:`remove_keeps`, :func:`keeping`). The searches that choose them under a budget,
simulating each trial, are :mod:`passes.keeps`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import networkx as nx

from passes.dp_table import BYTE_WEIGHT  # what a byte written by a recompute costs
from passes.graph_facts import op_nodes
from passes.plan import Candidate, Plan, selective
from passes.recompute import cost_key, rerun_nodes
from passes.remat import validate_remat
from passes.segments import PlanError, Segment, make_segments

Path = tuple[int, ...]  # a segment's place in a plan: index at the top, then index among children


def keepable(graph: nx.DiGraph, name: str) -> bool:
    """Whether a recomputed segment may keep ``name`` from forward: a computed value that owns
    its storage, that no later write changes, and whose op draws no random numbers (a
    recompute that skipped a draw would shift every later draw of the stream) and updates no
    state (the runtime keeps the op's outputs, not its side effects). A node kept whole keeps
    every output of its ops, so one that makes more than its value (a max-pool's indices, a
    norm's statistics: ``saved_extra_bytes``) is kept only as a matmul node, by its kernels:
    what the simulator holds for it is its value alone (a unet kept its pools' indices, 5%
    above the simulated peak)."""
    attributes = graph.nodes[name]
    whole_fits = attributes["expensive"] or not attributes["saved_extra_bytes"]
    return (attributes["kind"] == "op" and attributes["alias_of"] is None and attributes["bytes"] > 0
            and attributes["cuttable"] and attributes["recomputable"] and whole_fits
            and not (attributes["random"] or attributes["ordered"] or attributes["state"]))


def leaf_segments(segments: Sequence[Segment], at: Path = ()) -> list[tuple[Path, Segment]]:
    """Recomputed segments without children, at any depth, with their paths: the ones whose
    recompute runs their own nodes, so that keeping one of them saves its rerun. Not a
    segment run by an exact schedule: what it keeps is its schedule's."""
    found = []
    for index, segment in enumerate(segments):
        if not segment.recompute or segment.schedule is not None:
            continue
        if segment.children:
            found += leaf_segments(segment.children, (*at, index))
        else:
            found.append(((*at, index), segment))
    return found


def keep_value(graph: nx.DiGraph, name: str) -> float:
    """What keeping ``name`` saves per byte it holds: its recompute FLOPs and (a little) the
    bytes its rerun writes, over its own bytes and the kernel outputs a kept matmul node
    holds beside them."""
    attributes = graph.nodes[name]
    return (attributes["flops"] + BYTE_WEIGHT * attributes["bytes"]) / max(held_bytes(graph, name), 1)


def held_bytes(graph: nx.DiGraph, name: str) -> int:
    """What keeping ``name`` holds: its bytes and, for a matmul node, the kernel outputs
    selective checkpointing keeps beside them."""
    attributes = graph.nodes[name]
    return attributes["bytes"] + (attributes["selective_extra_bytes"] if attributes["expensive"] else 0)


def ranked_keeps(graph: nx.DiGraph, segments: Sequence[Segment]) -> list[tuple[Path, str]]:
    """Every value a leaf recomputed segment could keep and would otherwise rerun, best
    saving per byte first (ties: earlier values first, so the order is deterministic)."""
    order = {name: graph.nodes[name]["order"] for name in graph}
    options = [(path, name) for path, segment in leaf_segments(segments)
               for kept in (set(segment.saved_inside),)  # a set: a tuple scanned per node made this n^2
               for name in rerun_nodes(graph, segment, cached=False)
               if name not in kept and keepable(graph, name)]
    return sorted(options, key=lambda option: (-keep_value(graph, option[1]), order[option[1]]))


def _edit_leaves(segments: Sequence[Segment], keeps: Sequence[tuple[Path, str]],
                 edit: Callable[[Segment, set[str]], Segment]) -> tuple[Segment, ...]:
    """``segments`` with ``edit(segment, names)`` applied to each leaf segment that ``keeps``
    names values of, by path."""
    by_path: dict[Path, set[str]] = {}
    for path, name in keeps:
        by_path.setdefault(path, set()).add(name)

    def rebuild(items: Sequence[Segment], at: Path) -> tuple[Segment, ...]:
        out = []
        for index, segment in enumerate(items):
            path = (*at, index)
            if segment.children:
                segment = replace(segment, children=rebuild(segment.children, path))
            elif path in by_path:
                segment = edit(segment, by_path[path])
            out.append(segment)
        return tuple(out)

    return rebuild(segments, ())


def add_keeps(graph: nx.DiGraph, segments: Sequence[Segment], keeps: Sequence[tuple[Path, str]]) -> tuple[Segment, ...]:
    """``segments`` with each ``(path, value)`` of ``keeps`` added to that segment's
    ``saved_inside`` (in the segment's own order, :func:`saving_inside`)."""
    def add(segment: Segment, names: set[str]) -> Segment:
        return saving_inside(segment, set(segment.saved_inside) | names)

    return _edit_leaves(segments, keeps, add)


def saving_inside(segment: Segment, kept: set[str]) -> Segment:
    """``segment`` keeping from forward exactly its values in ``kept``; one it held once
    made again (``remake_held``) and now keeps is not made again, so no longer held."""
    return replace(segment, saved_inside=tuple(n for n in segment.nodes if n in kept),
                   remake_held=tuple(n for n in segment.remake_held if n not in kept))


def remove_keeps(segments: Sequence[Segment], keeps: Sequence[tuple[Path, str]]) -> tuple[Segment, ...]:
    """``segments`` with each ``(path, value)`` of ``keeps`` taken out of that segment's
    ``saved_inside``: the inverse of :func:`add_keeps` for values the segment did not hold
    once made again (one it held and was made to keep is no longer held, :func:`saving_inside`)."""
    def remove(segment: Segment, names: set[str]) -> Segment:
        return replace(segment, saved_inside=tuple(n for n in segment.saved_inside if n not in names))

    return _edit_leaves(segments, keeps, remove)


def whole_graph(graph: nx.DiGraph) -> tuple[Segment, ...]:
    """One recomputed segment over the whole graph, split where ops cannot be recomputed."""
    return make_segments(graph, [(op_nodes(graph), True)])


def keeping(segments: Sequence[Segment], kept: set[str]) -> tuple[Segment, ...]:
    """``segments`` with each recomputed one keeping exactly the values of ``kept`` it runs."""
    return tuple(saving_inside(s, kept) if s.recompute else s for s in segments)


def remat_still_valid(graph: nx.DiGraph, segments: Sequence[Segment]) -> bool:
    """Whether ``segments``' rematerialized inputs still have their sources alive after a
    change of kept values: a segment that comes to run by saved-tensor hooks, or keeps
    other values, holds only what its own backward needs (:func:`passes.remat.held_at_each`)."""
    if not any(segment.remat for segment in segments):
        return True
    try:
        validate_remat(graph, segments, PlanError)
    except PlanError:
        return False
    return True


def selective_whole(graph: nx.DiGraph) -> tuple[Segment, ...]:
    """One recomputed segment over the whole graph (split where ops cannot be recomputed),
    selective (:func:`passes.plan.selective`): where torch.compile's min cut starts, and a
    start for :func:`passes.keeps.with_keeps` and :func:`passes.keeps.without_keeps` that no plan of the dynamic
    program is near. Empty when the graph has no matmul/convolution output to keep."""
    if not any(graph.nodes[name]["expensive"] for name in op_nodes(graph)):
        return ()
    return selective(graph, Candidate("whole", whole_graph(graph))).segments


def _keep_value_band(graph: nx.DiGraph, name: str) -> int:
    """:func:`keep_value` on a logarithmic scale of 25% steps: measured op times vary that
    much between nodes of one kind, so values in one band count as equal."""
    return math.floor(math.log(max(keep_value(graph, name), 1e-12)) / math.log(1.25))


def ranked_removals(graph: nx.DiGraph, segments: Sequence[Segment]) -> list[tuple[Path, str]]:
    """Every value a leaf recomputed segment keeps, the one whose keeping saves least per
    byte first (:func:`_keep_value_band`); among equals the later value first (made again
    late in backward, when less is alive: the last matmul of a chain is the one
    torch.compile's min cut gives up)."""
    order = {name: graph.nodes[name]["order"] for name in graph}
    options = [(path, name) for path, segment in leaf_segments(segments) for name in segment.saved_inside]
    return sorted(options, key=lambda option: (_keep_value_band(graph, option[1]), -order[option[1]]))


def least_with_keeps(graph: nx.DiGraph, plan: Plan | Candidate) -> int:
    """The recompute FLOPs of ``plan`` keeping every value :func:`ranked_keeps` offers, memory
    aside: no plan :func:`passes.keeps.with_keeps` makes of it recomputes less (each value kept takes its
    rerun away), so a start that cannot beat a plan already found is not simulated."""
    return cost_key(graph, add_keeps(graph, plan.segments, ranked_keeps(graph, plan.segments)))[0]
