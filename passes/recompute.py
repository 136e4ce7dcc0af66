"""What backward recomputes of a plan's segments, and what that costs.

torch's checkpoint reruns a recomputed segment only as far as backward needs
(:func:`recompute_steps`), at the first unpack of a saved tensor: after the backward of the
ops that save nothing at its end (:func:`trailing_backward`), inside the backward of the op
that unpacks (:func:`recompute_trigger`). A segment run by saved-tensor hooks remakes only its dropped
values (:func:`passes.hooked.remake_runs`). :func:`recomputed_nodes` lists what a plan
reruns, :func:`cost_key` prices it with checkpointing's own overheads
(:func:`overhead_cost`), and :func:`with_facts` gives codegen what it needs of the cost
graph for each recomputed segment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import networkx as nx

from passes.graph_facts import draws_random, node_attribute
from passes.hooked import keeps_by_hooks, redrawn, remake_closures, remake_groups, remake_runs, remake_units
from passes.kept_bytes import boundary_bytes, storage_bytes
from passes.remat import remat_nodes, runs_by_hooks
from passes.segments import RecomputeFacts, Segment, Step


def recompute_steps(graph: nx.DiGraph, segment: Segment) -> tuple[list[Step], Step | None]:
    """What backward's recompute of ``segment`` runs, in order, and the step it stops at.

    torch's checkpoint stops recomputing as soon as it has every tensor backward saved in
    forward: ops after the last one that saves anything never run again, nor that one when
    all it saves are its inputs (its saves are taken, it is not run: the returned stop). A
    recomputed child saves its inputs before its body runs, so a child that is the last to
    save is not run either. For example, a recomputed ``Linear -> GELU -> Linear`` segment
    reruns only its first Linear and the GELU: the last Linear saves only its input.
    """
    steps: list[tuple[Step, str]] = []
    saves_from = node_attribute(graph, "saves_from")
    for child in segment.children or (segment,):
        if child is not segment and child.recompute:
            steps.append((child, "inputs"))
        else:
            steps.extend((n, saves_from[n]) for n in child.nodes)
    last = max((i for i, (_, saves) in enumerate(steps) if saves != "nothing"), default=-1)
    if last < 0:
        return [], None
    if steps[last][1] == "outputs":
        return [step for step, _ in steps[: last + 1]], None
    return [step for step, _ in steps[:last]], steps[last][0]


def random_calls(graph: nx.DiGraph, segment: Segment) -> list[Segment]:
    """``segment`` and the recomputed segments nested in it, at any depth, that draw random
    numbers, in call order: running ``segment``'s body calls each of them, and every such
    checkpoint call takes a copy of the generator's state (``rng_state_bytes``)."""
    own = [segment] if segment.recompute and draws_random(graph, segment.nodes) else []
    return own + [call for child in segment.children for call in random_calls(graph, child)]


def step_nodes(steps: Iterable[Step]) -> list[str]:
    """The op nodes computed by ``steps`` (a recomputed child's forward computes all of it)."""
    return [n for step in steps for n in (step.nodes if isinstance(step, Segment) else (step,))]


def rerun_nodes(graph: nx.DiGraph, segment: Segment, cached: bool = True) -> list[str]:
    """The nodes one recompute of ``segment`` computes (its recomputed children's bodies
    included, their own later recomputes not); ``saved_inside`` excluded when ``cached``."""
    return _without_kept(step_nodes(recompute_steps(graph, segment)[0]), segment, cached)


def _closures_by_remake(graph: nx.DiGraph, segment: Segment, units: Sequence[tuple[tuple[str, ...], tuple[str, ...]]],
                        ) -> tuple[tuple[str, ...], ...]:
    """:func:`passes.hooked.remake_closures` of each remake's value, in the remakes' order;
    none when the segment holds nothing."""
    closures = remake_closures(graph, segment)
    return tuple(closures[marked[0]] for _, marked in units) if closures else ()


def with_facts(graph: nx.DiGraph, segment: Segment, top: bool = True) -> Segment:
    """``segment`` (and its children) with the :class:`RecomputeFacts` of ``graph`` that
    codegen reads; a kept segment has none. Only a ``top``-level segment runs by hooks
    (:mod:`passes.hooked`): a nested one runs inside its parent's checkpoint."""
    if not segment.recompute:
        return segment
    if segment.schedule is not None:  # codegen reads the schedule itself
        kept = storage_bytes(graph, segment.saved_inside)  # kept whole, cut at or not
        return replace(segment, facts=RecomputeFacts(kept_bytes=kept,
                                                     draws_random=False, reruns=segment.schedule.made, state_inputs=()))
    hooked = top and keeps_by_hooks(graph, segment)
    units = remake_units(graph, segment) if hooked else []
    facts = RecomputeFacts(
        kept_bytes=boundary_bytes(graph, segment.inputs),
        draws_random=draws_random(graph, segment.nodes),
        reruns=tuple(rerun_nodes(graph, segment)),
        state_inputs=tuple(i for i, name in enumerate(segment.inputs) if graph.nodes[name]["state"]),
        kept_whole=tuple(n for n in segment.saved_inside if not graph.nodes[n]["expensive"]),
        by_hooks=runs_by_hooks(graph, segment),
        keeps_by_hooks=hooked,
        remakes=tuple(marked for _, marked in units),
        remake_ops=tuple(nodes for nodes, _ in units),
        redrawn=redrawn(graph, segment) if hooked else (),
        remake_each_use=hooked and segment.remake_each_use,
        remake_held=segment.remake_held if hooked else (),
        remake_closures=_closures_by_remake(graph, segment, units) if hooked else (),
    )
    return replace(segment, children=tuple(with_facts(graph, c, top=False) for c in segment.children), facts=facts)


def recomputed_nodes(graph: nx.DiGraph, segments: Iterable[Segment], cached: bool = True,
                     top: bool = True) -> list[str]:
    """Every node backward computes again, once per time it is recomputed (a node in a
    recomputed child of a recomputed segment appears twice), as :func:`recompute_steps` runs
    them; ``saved_inside`` excluded when ``cached`` (a nested child's are only cached when
    its enclosing segment's recompute ran it). A ``top``-level segment run by hooks makes
    again only what its remake groups need (:func:`passes.hooked.remake_groups`)."""
    again: list[str] = []
    for segment in segments:
        if not segment.recompute:
            continue
        if segment.schedule is not None:
            again.extend(segment.schedule.made)
            continue
        if top and keeps_by_hooks(graph, segment):
            again.extend(name for run in remake_runs(graph, segment) for name in run)
            continue
        ran, stop = recompute_steps(graph, segment)
        if ran or stop is not None:  # a recompute that runs at all first rematerializes the inputs
            again.extend(remat_nodes(segment))
        again.extend(_without_kept(step_nodes(ran), segment, cached))
        for child in segment.children:
            again.extend(recomputed_nodes(graph, [child], cached=child in ran, top=False))
    return again


def recompute_totals(graph: nx.DiGraph, segments: Iterable[Segment]) -> tuple[int, int]:
    """FLOPs and bytes written by everything backward recomputes (:func:`recomputed_nodes`)."""
    again = recomputed_nodes(graph, segments)
    flops, nbytes = node_attribute(graph, "flops"), node_attribute(graph, "bytes")
    return sum(map(flops.__getitem__, again)), sum(map(nbytes.__getitem__, again))


def cost_key(graph: nx.DiGraph, segments: Sequence[Segment]) -> tuple[int, int, int]:
    """:attr:`Plan.cost_key` of segments not yet simulated: what they recompute is known
    without simulating them."""
    recomputed, written = recompute_totals(graph, segments)
    return recomputed + overhead_cost(graph, segments), written, recomputed_count(segments)


def overhead_cost(graph: nx.DiGraph, segments: Iterable[Segment], top: bool = True) -> int:
    """What checkpointing itself costs a step, beyond the ops it reruns: each checkpoint
    call, each op of a selective segment, and each value a segment run by hooks drops
    (the graph's ``checkpoint_call_cost``, ``selective_op_cost`` and ``dropped_value_cost``,
    0 unless measured); a selective segment run by hooks (:mod:`passes.hooked`) costs a
    dropped value's price for the call, for each remake group and for each value it marks,
    and ``hooked_op_cost`` for each of its ops. Without it a plan of many small or
    selective segments looks cheaper than it runs (GPT-2 at per-block's memory stepped
    1.27x per-block's with pointwise ops counted free)."""
    call, per_op = graph.graph.get("checkpoint_call_cost", 0), graph.graph.get("selective_op_cost", 0)
    per_drop, per_hooked_op = graph.graph.get("dropped_value_cost", 0), graph.graph.get("hooked_op_cost", 0)
    if not call and not per_op and not per_drop and not per_hooked_op:
        return 0
    total = 0
    for s in segments:
        if s.schedule is not None:  # like a value a segment run by hooks drops: one hook call each
            total += per_drop * len(s.schedule.made)
        elif runs_by_hooks(graph, s):
            total += per_drop * len(s.remat)
        elif top and keeps_by_hooks(graph, s):
            groups = remake_groups(graph, s)
            total += per_drop * (1 + len(remake_runs(graph, s)) + sum(len(group.marked) for group in groups))
            total += per_hooked_op * len(s.nodes)
        elif s.recompute:
            total += call + per_op * len(s.nodes) * bool(s.saved_inside) + overhead_cost(graph, s.children, top=False)
    return int(total)


def _without_kept(nodes: list[str], segment: Segment, cached: bool) -> list[str]:
    kept = set(segment.saved_inside) if cached else set()
    return [n for n in nodes if n not in kept]


def recomputed_count(segments: Iterable[Segment]) -> int:
    """Recomputed segments, nested ones included: the checkpoint calls a step makes."""
    return sum(s.recompute + recomputed_count(s.children) for s in segments)


def trailing_backward(graph: nx.DiGraph, segment: Segment) -> tuple[str, ...]:
    """The ops ending a recomputed ``segment`` whose backward runs before its recompute, in
    forward order: those after the last op that saves anything (of its last child, when it
    has children and that child is kept; none when that child is recomputed), when one of
    them makes a new storage in backward (``backward_allocates``). torch's
    checkpoint recomputes at the first saved tensor backward unpacks, so what they make
    lives through the recompute: under bf16 autocast a residual ``add`` ending the segment
    casts its bf16 input's gradient there (ViT's plan at the floor measured 1.7% over its
    simulated peak, stop 67). When none allocates (float32's ``add`` passes its gradient
    through), the simulator's order, recompute first, is kept: its ``add`` backward makes a
    buffer per input, which float32's does not, and held through the recompute it cost
    BERT's floor 3%. ViT's plan at the floor, a nested segment whose kept last child ends
    in such an ``add``, measured 1.6% over its simulated peak before children were looked
    into (stop 68)."""
    nodes = _backward_starts_in(segment)
    if nodes is None:
        return ()
    attributes = graph.nodes
    count = 0
    for name in reversed(nodes):
        if attributes[name]["saves_from"] != "nothing":
            break
        count += 1
    trailing = nodes[len(nodes) - count:]
    return trailing if any(attributes[name]["backward_allocates"] for name in trailing) else ()


def recompute_trigger(graph: nx.DiGraph, segment: Segment, trailing: Sequence[str]) -> str | None:
    """The op of a recomputed ``segment`` whose backward's first unpack of a saved value runs
    the recompute: the last that saves anything (of its last child, when that child is kept),
    before the ``trailing`` ops (:func:`trailing_backward`), whose backward runs first; its
    ``unpack_held_bytes`` live through the recompute. ``None`` when the last child is
    recomputed (its own recompute runs within), or nothing saves."""
    nodes = _backward_starts_in(segment)
    if nodes is None:
        return None
    for name in reversed(nodes[: len(nodes) - len(trailing)]):
        if graph.nodes[name]["saves_from"] != "nothing":
            return name
    return None


def _backward_starts_in(segment: Segment) -> tuple[str, ...] | None:
    """The ops among which a recomputed ``segment``'s backward starts, before its recompute
    runs: its own, or its last child's when that child is kept; ``None`` when the last
    child is recomputed (its own recompute runs first)."""
    if segment.children and segment.children[-1].recompute:
        return None
    return segment.children[-1].nodes if segment.children else segment.nodes
