"""The simulator's backward of a segment run by saved-tensor hooks (:mod:`passes.hooked`):
forward's own graph run in reverse, with dropped values made again from the segment's
inputs and kept values, per remake group when backward first needs one, or per value at
every use (``remake_each_use``). :mod:`passes.simulate` replays the rest of the step.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from passes.hooked import RemakeGroup, RemakeStep, each_use_schedule, marked_values, redrawn, remake_groups, remake_units
from passes.segments import Segment
from passes.sim_memory import EXTRA, LiveMemory, slot
from passes.sim_ops import run_backward, run_forward


def backward_hooked(memory: LiveMemory, graph: nx.DiGraph, segment: Segment, grads: set[int],
                     needed: Mapping[str, str]) -> None:
    """Backward of a segment run by saved-tensor hooks (:mod:`passes.hooked`): its ops in
    reverse, on forward's own graph; the first op that unpacks a value of a remake group
    makes the whole group again, and each value made goes after its last saver's backward
    (a dropout drawn again saves itself: its noise and value go after its own backward).
    The inputs and kept values, held by the call since forward, go after the backward of
    the last op needing them (``needed``: :func:`passes.hooked_lifetimes.last_needed`)."""
    if segment.remake_each_use:
        _backward_remaking_each_use(memory, graph, segment, grads, needed)
        return
    index = memory.index
    groups = remake_groups(graph, segment)
    group_of = {index.ids[name]: group for group in groups for name in group.marked}
    memory.fresh.append({index.ids[name] for group in groups for name in group.nodes})
    nodes = index.id_list(segment.nodes)
    drawn = set(index.id_list(redrawn(graph, segment)))
    unpacks = {node: (*index.saved[node], node) if node in drawn else index.saved[node] for node in nodes}
    savers: dict[int, int] = {}
    for node in nodes:
        for value in unpacks[node]:
            savers[index.roots[value]] = savers.get(index.roots[value], 0) + 1
    made: set[RemakeGroup] = set()
    let_go = _let_go(memory, needed)
    for node in reversed(nodes):
        for value in unpacks[node]:
            group = group_of.get(index.roots[value])
            if group is None:
                memory.hold(value)  # an input or kept value, alive since forward
            elif group not in made:
                made.add(group)
                _remake(memory, group, savers, drawn)
        run_backward(memory, [node], grads)
        if node in drawn:
            memory.release(node)  # held by its own noise's handle
        for value in let_go.get(node, ()):
            memory.release(value)
    memory.fresh.pop()


def _backward_remaking_each_use(memory: LiveMemory, graph: nx.DiGraph, segment: Segment, grads: set[int],
                                needed: Mapping[str, str]) -> None:
    """:func:`backward_hooked` of a segment that makes each marked value again at every
    use (:attr:`passes.segments.Segment.remake_each_use`): before an op's backward, each
    marked value it saved is made as :func:`passes.hooked.each_use_schedule` says, from its
    recipe (:func:`passes.hooked.value_recipe`) and the held values (``remake_held``, made
    first when not alive, then held until their last unpack); it is held by that op, so it
    goes after the op's backward (a dropout's noise with it)."""
    index = memory.index
    marked = set(marked_values(graph, segment))
    memory.fresh.append({index.ids[name] for name in segment.nodes if name not in segment.saved_inside})
    drawn, held = set(redrawn(graph, segment)), set(segment.remake_held)
    let_go = _let_go(memory, needed)
    steps: dict[str, list[RemakeStep]] = {}
    for step in each_use_schedule(graph, segment):
        steps.setdefault(step.op, []).append(step)
    recipes = {marked[0]: index.id_list(nodes) for nodes, marked in remake_units(graph, segment)}
    for name in reversed(segment.nodes):
        node = index.ids[name]
        for value in index.saved[node]:
            if index.names[index.roots[value]] not in marked:
                memory.hold(value)  # an input or kept value, alive since forward
        for step in steps.get(name, ()):
            memory.hold(index.ids[step.value])  # by the op unpacking it
            for value in step.made:
                made = recipes[value]
                if value in held:
                    memory.hold(index.ids[value])  # by the runtime, until its last unpack
                if value == name and name in drawn:  # its own noise
                    memory.allocate(slot(node, EXTRA), index.saved_extra[node])
                run_forward(memory, made, save=False, within=set(made))
            for value in step.let_go:
                memory.release(index.ids[value])
        run_backward(memory, [node], grads)
        if name in drawn:
            memory.release(node)
        for value in let_go.get(node, ()):
            memory.release(value)
    memory.fresh.pop()


def _remake(memory: LiveMemory, group: RemakeGroup, savers: dict[int, int], drawn: set[int]) -> None:
    """One remake group made again without saving: each of its marked values held once
    for every op that saved it (``savers``), the rest gone when the group is done; the
    noise of each dropout drawn again (``drawn``) held until its backward."""
    index = memory.index
    for name in group.marked:
        memory.hold(index.ids[name], savers[index.ids[name]])
    nodes = index.id_list(group.nodes)
    for node in nodes:  # a dropout's noise, drawn again: what it saves beyond values (none for other
        if node in drawn:  # ops made here, which save nothing in a remake)
            memory.allocate(slot(node, EXTRA), index.saved_extra[node])
    run_forward(memory, nodes, save=False, within=set(nodes))


def _let_go(memory: LiveMemory, needed: Mapping[str, str]) -> dict[int, list[int]]:
    """Op id -> the inputs and kept values going after its backward (``needed``:
    :func:`passes.hooked_lifetimes.last_needed`, value -> the op needing it last)."""
    let_go: dict[int, list[int]] = {}
    for value, name in needed.items():
        let_go.setdefault(memory.index.ids[name], []).append(memory.index.ids[value])
    return let_go
