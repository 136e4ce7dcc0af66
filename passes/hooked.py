"""Selective segments run by saved-tensor hooks: per-value keep or recompute, without
torch's selective-checkpoint mode.

A selective segment keeps some values from forward (``saved_inside``: its matmul outputs)
and makes the others again for backward. torch's selective checkpointing does that with a
dispatch mode that sees every op, in forward and again in the recompute: about 70 us an op
on a 2-core CPU, a third of the recompute cost of HF GPT-2's whole-layer selective plans.
A segment this module accepts (:func:`keeps_by_hooks`) runs instead as eager code under
saved-tensor hooks (:class:`graphckpt.hooked.HookedSegmentModule`): the autograd graph is
forward's own, and each tensor an op saves that shares the storage of one of the segment's
dropped values (:func:`marked_values`, everything saved but the values kept) is swapped for
a handle; the first handle backward unpacks makes every dropped value again from the
segment's inputs and kept values, without gradients, and each lives until the last handle
of it is unpacked. The dropped values are made again in groups (:func:`remake_groups`), each
when backward first needs one of its values, so only part of the segment is live again at
a time.

Dropout: a segment may hold training-mode dropouts (``redrawable`` nodes). Each saves its
noise for backward, no value of the graph; the runtime drops it like a marked value and
the remake of its group draws it again from the generator state taken just before the op in
forward (:func:`redrawn`; :mod:`graphckpt.dropout`), so backward sees forward's noise. Any
other random op keeps the segment on torch's selective checkpointing.

Memory (``passes.simulate``): inputs and kept values are held from forward until the
backward of the last op that saved one or saved a value of a group remade from it
(:func:`passes.hooked_lifetimes.last_needed`); what its ops save that is no value of the graph is held from forward
to the end of the segment's backward
(``saved_extra_bytes``: norm statistics, attention's log-sum-exp, the contiguous copies a
``matmul`` of transposed views saves, kept ops' included), which torch's selective mode
would make again in the recompute instead: so only segments where that is small are
accepted. Each group's values live from its remake to their last saver's backward.

Example: HF GPT-2's MLP as one selective segment keeps ``addmm_2`` (the fc output) and
``addmm_3``; ``mul``, ``tanh``, ``add_6`` and ``mul_3`` (8 MiB each) are marked and made
again once, when ``addmm_3``'s backward unpacks ``mul_3``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple, Protocol

import networkx as nx

from passes.graph_facts import draws_random, per_segment, pure_ops, random_nodes, redrawable_ops, storage_root


class SegmentLike(Protocol):
    """What this module and :mod:`passes.remat` read of a :class:`passes.segments.Segment`
    (which imports both)."""

    nodes: tuple[str, ...]
    recompute: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    remat: tuple  # of passes.remat.Remat
    saved_inside: tuple[str, ...]
    remake_each_use: bool
    remake_held: tuple[str, ...]
    schedule: object  # a passes.schedule.Schedule, or None

    @property
    def children(self) -> Sequence[SegmentLike]: ...


SAVED_EXTRA_SHARE = 0.02
"""The most a hooked segment may keep from forward that no value of the graph is (what its
ops save beyond values, ``saved_extra_bytes``), as a share of its values' bytes: it is
held from forward to backward, where torch's selective mode holds it only after the recompute."""


@per_segment
def keeps_by_hooks(graph: nx.DiGraph, segment: SegmentLike) -> bool:
    """Whether a recomputed segment runs as eager code under saved-tensor hooks rather than
    through torch's selective checkpointing: it is selective (keeps values from forward),
    top-level work of its own (no children, no rematerialized inputs), every op :func:`pure`
    (no state, no in-place write, so making a value again gives forward's) or a dropout it
    draws again (:func:`redrawn`, not kept), every kept value the whole of what selective
    checkpointing keeps for it (no ``selective_extra_bytes``), and what its ops save beyond
    values and dropout noise is small (:data:`SAVED_EXTRA_SHARE`); never on a graph whose
    runtime has no hooks (``hooks``)."""
    if not (segment.recompute and segment.saved_inside) or segment.children or segment.remat or segment.schedule:
        return False
    if not graph.graph.get("hooks", True):  # a runtime without them (graphckpt.enable)
        return False
    nodes = graph.nodes
    if any(nodes[v]["state"] for v in segment.inputs):
        return False
    drawn = redrawn(graph, segment)
    if draws_random(graph, segment.nodes) and not (drawn and random_nodes(graph).intersection(segment.nodes) <= set(drawn)):
        return False
    if not pure_ops(graph).issuperset(name for name in segment.nodes if name not in drawn):
        return False
    if any(nodes[name]["selective_extra_bytes"] for name in segment.saved_inside):
        return False
    extra = sum(nodes[name]["saved_extra_bytes"] for name in segment.nodes if name not in drawn)  # kept ones' too:
    return extra <= SAVED_EXTRA_SHARE * sum(nodes[name]["bytes"] for name in segment.nodes)  # a recompute remade them


@per_segment
def redrawn(graph: nx.DiGraph, segment: SegmentLike) -> tuple[str, ...]:
    """The dropouts of a segment that a run by hooks draws again, in order: its
    ``redrawable`` ops that it does not keep. Their noise (``saved_extra_bytes``) goes after
    forward and is made again with their remake group, from the generator state the op
    drew from in forward; they count as marked values (:func:`marked_values`)."""
    candidates = redrawable_ops(graph)
    if not candidates:
        return ()
    kept = set(segment.saved_inside)
    return tuple(name for name in segment.nodes if name in candidates and name not in kept)


def saved_by(graph: nx.DiGraph, name: str, drawn: Collection[str]) -> tuple[str, ...]:
    """What op ``name`` of a hooked segment saves for backward, as values: its ``saved``,
    and itself when it is a dropout drawn again (in ``drawn``, :func:`redrawn`: its noise
    goes and comes with it)."""
    saved = graph.nodes[name]["saved"]
    return (*saved, name) if name in drawn and name not in saved else saved


@per_segment
def marked_values(graph: nx.DiGraph, segment: SegmentLike) -> tuple[str, ...]:
    """The values of a hooked segment whose saved copies are dropped after forward, in
    order: the storage owners, among the segment's own values and not kept, of what its
    ops save (a view saved is its owner's storage; a dropout drawn again saves itself)."""
    inside, kept = set(segment.nodes), set(segment.saved_inside)
    drawn = set(redrawn(graph, segment))
    roots = {storage_root(graph, value) for name in segment.nodes for value in saved_by(graph, name, drawn)}
    return tuple(name for name in segment.nodes if name in roots and name in inside and name not in kept)


class RemakeGroup(NamedTuple):
    """Dropped values of a hooked segment made again together: ``nodes``, what the remake
    computes (in order), and ``marked``, the values among them backward unpacks."""

    nodes: tuple[str, ...]
    marked: tuple[str, ...]


@per_segment
def remake_groups(graph: nx.DiGraph, segment: SegmentLike) -> tuple[RemakeGroup, ...]:
    """The marked values of a hooked segment in groups each made again on its own from the
    segment's inputs and kept values: the connected parts of the segment's ops that are not
    kept. Backward makes a group when it first unpacks one of its values, and each value
    goes after its last unpack, so what is live again is one part of the segment, not all.

    Example: a GPT-2 layer keeping its matmul outputs falls into three groups, each made
    when its backward comes: the GELU chain between ``addmm_6`` and ``addmm_7``, the
    residual sum with ``ln_2``'s output, and ``ln_1``'s output.
    """
    kept, marked = set(segment.saved_inside), set(marked_values(graph, segment))
    free = [name for name in segment.nodes if name not in kept]
    parts = nx.utils.UnionFind(free)
    inside = set(free)
    for name in free:
        for source in graph.predecessors(name):
            if source in inside:
                parts.union(name, source)
    needed = _needed_for(graph, marked, inside)
    groups: dict[str, list[str]] = {}
    for name in free:
        if name in needed:
            groups.setdefault(parts[name], []).append(name)
    return tuple(RemakeGroup(tuple(nodes), tuple(n for n in nodes if n in marked)) for nodes in groups.values())


def value_recipe(graph: nx.DiGraph, segment: SegmentLike, value: str) -> tuple[str, ...]:
    """What makes marked ``value`` again on its own, in order: it and the ops of the
    segment it reads from, back to the segment's inputs, kept values and the values held
    once made (``remake_held``, but ``value`` itself: :func:`held_sources`). A segment that
    remakes each value at every use (``remake_each_use``) runs this for each unpack."""
    inside = set(segment.nodes) - set(segment.saved_inside) - (set(segment.remake_held) - {value})
    needed = _needed_for(graph, {value}, inside)
    return tuple(name for name in segment.nodes if name in needed)


def held_sources(graph: nx.DiGraph, segment: SegmentLike, value: str) -> tuple[str, ...]:
    """The values of ``remake_held`` that :func:`value_recipe` of ``value`` reads, in order:
    each is made first when it is not alive."""
    held = set(segment.remake_held) - {value}
    read = {source for name in value_recipe(graph, segment, value) for source in graph.predecessors(name)}
    return tuple(name for name in segment.nodes if name in held and name in read)


def holdable(graph: nx.DiGraph, segment: SegmentLike) -> tuple[str, ...]:
    """The values a segment remaking each value at every use may hold once made
    (``remake_held``): its own values, not kept, owning their storage (a view is held by its
    owner), no dropout drawn again (its noise comes with its own unpack)."""
    skip = {*segment.saved_inside, *redrawn(graph, segment)}
    return tuple(name for name in segment.nodes if name not in skip and storage_root(graph, name) == name)


def remake_phrase(each_use: bool, held: int) -> str:
    """How a hooked segment remakes its dropped values, for notes and reports: ``""`` per
    group, else "each dropped value made again at every use", with how many are held."""
    if not each_use:
        return ""
    return "each dropped value made again at every use" + (f", {held} of them held once made" if held else "")


class RemakeStep(NamedTuple):
    """One unpack of a segment remaking each value at every use: ``op``'s backward unpacks
    ``value``; ``made`` are the values made for it, each by its :func:`value_recipe`, held
    sources first (empty when ``value`` is held and alive); ``let_go`` the held values no
    later unpack may need, dropped once it is done."""

    op: str
    value: str
    made: tuple[str, ...]
    let_go: tuple[str, ...]


@per_segment
def each_use_schedule(graph: nx.DiGraph, segment: SegmentLike) -> tuple[RemakeStep, ...]:
    """What backward makes again at each unpack of a segment remaking each value at every
    use, in backward's order (:func:`uses`): a value's recipe runs from the segment's
    inputs, kept values and held values (``remake_held``), a held value is made first when
    not alive and then held until no unpack left may need it (its own, or one of a value
    made from it, directly or through other held values). With nothing held, every unpack
    runs its value's whole recipe. The runtime (:class:`graphckpt.hooked.HookedSegmentModule`)
    counts the same unpacks, so it holds what this says whatever order backward takes.

    Example: a chain ``a -> b -> c -> d`` of dropped values with ``b`` held: the first
    unpack of ``d`` makes ``b`` (from ``a``'s sources) and then ``c, d`` from ``b``; a later
    unpack of ``c`` makes only ``c``, and ``b`` goes after the last unpack of ``b``, ``c`` or ``d``.
    """
    held = set(segment.remake_held)
    steps = uses(graph, segment)
    sources, closure = _held_sources_of(graph, segment), remake_closures(graph, segment)
    closures = {value: [name for name in closure.get(value, (value,)) if name in held] for _, value in steps}
    pending: dict[str, int] = {}
    for _, value in steps:
        for name in closures[value]:
            pending[name] = pending.get(name, 0) + 1
    alive: set[str] = set()
    schedule: list[RemakeStep] = []

    def make(name: str, made: list[str]) -> None:
        if name not in alive:
            for source in sources.get(name, ()):
                make(source, made)
            made.append(name)
            if name in held:
                alive.add(name)

    for op, value in steps:
        made: list[str] = []
        make(value, made)
        let_go = []
        for name in closures[value]:
            pending[name] -= 1
            if not pending[name]:
                alive.discard(name)
                let_go.append(name)
        schedule.append(RemakeStep(op, value, tuple(made), tuple(let_go)))
    return tuple(schedule)


@per_segment
def _held_sources_of(graph: nx.DiGraph, segment: SegmentLike) -> Mapping[str, tuple[str, ...]]:
    """:func:`held_sources` of every value a segment holding values remakes (marked or
    held); empty when it holds none."""
    if not segment.remake_held:
        return MappingProxyType({})
    made = set(marked_values(graph, segment)).union(segment.remake_held)
    return MappingProxyType({name: held_sources(graph, segment, name) for name in segment.nodes if name in made})


@per_segment
def remake_closures(graph: nx.DiGraph, segment: SegmentLike) -> Mapping[str, tuple[str, ...]]:
    """For each value a segment holding values remakes, it and the held values making it
    again may make first (:func:`held_sources`, again and again): what its handles keep the
    sources of, and what the runtime counts its unpacks against. Empty when it holds none
    (a value's closure is then the value alone)."""
    sources = _held_sources_of(graph, segment)

    def closure(value: str) -> tuple[str, ...]:
        found, stack = [value], [value]
        while stack:
            for source in sources[stack.pop()]:
                if source not in found:
                    found.append(source)
                    stack.append(source)
        return tuple(found)

    return MappingProxyType({name: closure(name) for name in sources})


@per_segment
def uses(graph: nx.DiGraph, segment: SegmentLike) -> tuple[tuple[str, str], ...]:
    """``(op, marked value)`` for every tensor of a marked value an op of a hooked segment
    saves (a dropout drawn again saves its noise), in backward's order: each is one unpack,
    and one remake when the segment remakes each value at every use."""
    marked, drawn = set(marked_values(graph, segment)), set(redrawn(graph, segment))
    return tuple((name, root) for name in reversed(segment.nodes) for value in saved_by(graph, name, drawn)
                 for root in (storage_root(graph, value),) if root in marked)


def remake_runs(graph: nx.DiGraph, segment: SegmentLike) -> list[tuple[str, ...]]:
    """The ops each remake of a hooked segment's backward computes: each group once
    (:func:`remake_groups`), or, remaking each value at every use, the recipes each unpack
    runs (:func:`each_use_schedule`)."""
    if not segment.remake_each_use:
        return [nodes for nodes, _ in remake_units(graph, segment)]
    recipes = {marked[0]: nodes for nodes, marked in remake_units(graph, segment)}
    return [recipes[value] for step in each_use_schedule(graph, segment) for value in step.made]


@per_segment
def remake_units(graph: nx.DiGraph, segment: SegmentLike) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """``(ops, marked values)`` of each remake a hooked segment's runtime can run: its groups,
    or each value's recipe when it remakes each value at every use (each marked value's and
    each held value's, ``remake_held``). The one place that
    decides between the two: the runtime's remake modules, the simulator's replay and the
    cost all follow it."""
    if segment.remake_each_use:
        made = set(marked_values(graph, segment)).union(segment.remake_held)
        return tuple((value_recipe(graph, segment, name), (name,)) for name in segment.nodes if name in made)
    return tuple((group.nodes, group.marked) for group in remake_groups(graph, segment))


def _needed_for(graph: nx.DiGraph, values: set[str], inside: set[str]) -> set[str]:
    """``values`` and what computes them among ``inside`` (their ancestors there)."""
    needed, stack = set(values), list(values)
    while stack:
        for source in graph.predecessors(stack.pop()):
            if source in inside and source not in needed:
                needed.add(source)
                stack.append(source)
    return needed
