"""How long the inputs and kept values of a segment run by saved-tensor hooks live
(:mod:`passes.hooked`): autograd holds what an op saved until that op's backward, and each
handle of a remake holds what its remake reads, so a value goes after the backward of the
last op needing it (:func:`last_needed`), or in forward when backward needs it not at all
(:func:`held_in_forward`). The simulator, the forward floor and rematerialization's
``held_at_each`` ask these; what is made again, and how, is :mod:`passes.hooked`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import networkx as nx

from passes.graph_facts import per_segment, storage_root
from passes.hooked import SegmentLike, redrawn, remake_closures, remake_units, saved_by


@per_segment
def last_needed(graph: nx.DiGraph, segment: SegmentLike) -> Mapping[str, str]:
    """For each input and kept value of a hooked segment that backward needs, the op of the
    segment whose backward needs it last (the earliest in forward order): an op that saved
    it (autograd holds it until that op's backward), or one that saved a marked value of a
    remake group reading it (each handle of a group holds what the group's remake reads,
    :class:`graphckpt.hooked.HookedSegmentModule`, so a retained graph can remake it again).
    After that op's backward the value is let go; one missing from the map is let go when
    the segment's forward ends if a remake reads it (:func:`held_in_forward`), else at its
    last use in forward. Values are matched by storage (a saved view holds its owner).

    Example: a segment ``fc1, relu1, fc2, relu2, fc3`` keeping ``fc1`` and ``fc2`` remakes
    ``relu2`` from ``fc2``; ``relu2`` is saved by ``fc3`` and by ``relu2`` itself, so ``fc2``
    goes after ``relu2``'s backward, before backward reaches ``fc2`` (a linear saves its
    input, not its output), where it used to stay until the segment's backward ended.
    """
    sources = _sources(graph, segment)
    reads = _remake_reads(graph, segment)
    if segment.remake_held:  # a handle keeps what the held values made before its own may read
        closure = remake_closures(graph, segment)
        reads = {name: set().union(*(reads[v] for v in closure[name])) for name in reads}
    needed: dict[str, str] = {}
    drawn = set(redrawn(graph, segment))
    earliest: dict[int, tuple[set[str], str]] = {}  # per read set: it, and the earliest op saving a reader
    for name in reversed(segment.nodes):  # backward's order: the last write per value wins
        for value in saved_by(graph, name, drawn):
            root = storage_root(graph, value)
            if root in sources:
                needed[sources[root]] = name
            read = reads.get(root)
            if read is None:
                continue
            if id(read) not in earliest:  # a group's values share one set: walked once, not per saver
                for source in read:
                    needed[source] = name
            earliest[id(read)] = (read, name)
    position = {name: index for index, name in enumerate(segment.nodes)}
    for read, name in earliest.values():
        for source in read:
            if position[name] < position[needed[source]]:
                needed[source] = name
    return MappingProxyType(needed)  # shared by every caller (per_segment)


def _sources(graph: nx.DiGraph, segment: SegmentLike) -> dict[str, str]:
    """A hooked segment's inputs and kept values by their storage root."""
    return {storage_root(graph, v): v for v in (*segment.inputs, *segment.saved_inside)}


@per_segment
def _remake_reads(graph: nx.DiGraph, segment: SegmentLike) -> Mapping[str, set[str]]:
    """For each marked value, the inputs and kept values (:func:`_sources`) its remake reads:
    found once per segment, for :func:`last_needed` and :func:`held_in_forward` both."""
    sources = _sources(graph, segment)
    reads: dict[str, set[str]] = {}
    for nodes, marked in remake_units(graph, segment):
        inside = set(nodes)
        read = {sources[root] for name in nodes for pred in graph.predecessors(name)
                if pred not in inside for root in (storage_root(graph, pred),) if root in sources}
        for name in marked:
            reads[name] = read
    return MappingProxyType(reads)


@per_segment
def held_in_forward(graph: nx.DiGraph, segment: SegmentLike) -> tuple[str, ...]:
    """The kept values a hooked segment's call holds until its forward ends: those backward
    needs (:func:`last_needed`) and those a remake reads
    (:class:`graphckpt.hooked.HookedSegmentModule` gives each remake what it reads as forward
    makes it). A kept value no op saves and no remake reads goes at its last use in forward,
    as in eager code."""
    read = set().union(*_remake_reads(graph, segment).values())
    needed = last_needed(graph, segment)
    return tuple(v for v in segment.saved_inside if v in needed or v in read)
