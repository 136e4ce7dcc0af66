"""Replay a plan's forward and backward over the cost graph and report its peak memory.

The model of memory (activations only: parameters and their ``.grad`` already exist):

* forward: each op allocates its new bytes (its temporaries, ``forward_extra_bytes``, for a
  moment on top of them and what it saves); a storage is freed once no later op reads it,
  no pending backward saved it and it is not a graph output. In a recomputed segment
  nothing is saved; the segment's inputs stay alive until its backward has run. Under
  autocast, the parameter casts autocast's cache keeps (``autocast_cache_bytes``) live from
  their op to the end of forward, except in a checkpoint call (its cache is off).
* rematerialized inputs (:mod:`passes.remat`): a recomputed segment keeps their sources
  instead of them; they are freed after their last forward use and made again, with the
  temporaries of their chains, at the start of the segment's recompute.
* backward, ops in reverse: a recomputed segment first runs forward again (this time
  saving; values kept from forward, ``saved_inside``, are reused, with the matmul outputs
  inside them, ``selective_extra_bytes``) as far as backward needs
  (:func:`passes.recompute.recompute_steps`: torch's checkpoint stops once it has every saved
  tensor), then each op turns its output's gradient into its inputs' gradients (and
  parameter gradients, freed once added into ``.grad``; a parameter several ops read, such as
  a tied embedding, keeps one summed gradient until the last of them) and releases what it
  saved.
  Gradients are as large as their values.

* the loss: what it holds between forward and backward, :mod:`passes.sim_loss`.

This is an estimate; ``graphckpt.tools.measure`` is the truth it is checked against.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import groupby
from weakref import WeakKeyDictionary

import networkx as nx

from passes.graph_facts import (
    draws_random,
    graph_outputs,
    leaves_nothing,
    op_nodes,
)
from passes.hooked import keeps_by_hooks, redrawn
from passes.hooked_lifetimes import held_in_forward, last_needed
from passes.kept_bytes import gradient_bytes
from passes.recompute import (
    random_calls,
    recompute_steps,
    recompute_totals,
    recompute_trigger,
    step_nodes,
    trailing_backward,
)
from passes.remat import kept_inputs, remat_nodes, run_remat
from passes.schedule import plan_schedule
from passes.segments import Segment, Step, make_segments
from passes.sim_hooked import backward_hooked
from passes.sim_loss import loss_scalar_bytes, loss_working_bytes, trained_outputs
from passes.sim_memory import AUTOCAST_CACHE, EXTRA, GRAD, SELECTIVE_EXTRA, STATE_COPY, LimitExceeded, LiveMemory, slot
from passes.sim_ops import run_backward, run_forward


@dataclass(frozen=True)
class Simulation:
    """Peak bytes of one training step under a plan, and what it recomputes."""

    peak_bytes: int
    eager_peak_bytes: int
    recompute_flops: int
    forward_flops: int
    recompute_bytes: int = 0  # bytes written by recomputation: the cost of pointwise work FLOPs miss


def _call_recomputed(memory: LiveMemory, graph: nx.DiGraph, segment: Segment, tag: tuple,
                     within: set[int] | None = None, kept: Iterable[str] | None = None) -> None:
    """One checkpoint call of a recomputed segment, saving nothing: it holds the segment's
    inputs, and each random call its body makes (:func:`random_calls`: itself and every
    recomputed segment nested in it) copies the generator state, ``(*tag, id(call))``, when
    the body reaches it. Called in forward (``tag`` ``("rng",)``: the copies live until each
    call's backward) or rerun by an enclosing recompute (freed when that recompute ends).
    A call that :func:`passes.graph_facts.leaves_nothing` runs like eager code that saves nothing.
    ``kept``: the values kept from forward that it holds (default: ``saved_inside``, a call
    torch's selective checkpointing runs under its dispatch mode; given: run by hooks)."""
    index = memory.index
    nodes = index.id_list(segment.nodes)
    if leaves_nothing(graph, segment):  # keeps nothing either
        run_forward(memory, nodes, save=False, within=within)
        return
    keep = index.id_list(segment.saved_inside if kept is None else kept)
    moded = kept is None and bool(segment.saved_inside)  # torch's selective checkpointing, not hooks
    for value in index.id_list(kept_inputs(segment)):  # a rematerialized input is not kept: its sources are
        memory.hold(value)
    done = 0
    for call in random_calls(graph, segment):  # in call order, so their first nodes in order
        at = segment.nodes.index(call.nodes[0], done)
        run_forward(memory, nodes[done:at], save=False, within=within, keep=keep, moded=moded)
        memory.allocate((*tag, id(call)), graph.graph.get("rng_state_bytes", 0))
        done = at
    run_forward(memory, nodes[done:], save=False, within=within, keep=keep, moded=moded)


def _forward_sequence(memory: LiveMemory, graph: nx.DiGraph, segments: Sequence[Segment],
                      hooked: dict[Segment, Mapping[str, str]]) -> None:
    """Run the step's forward: kept segments save for backward, recomputed ones hold their
    inputs and generator states (and their matmul outputs, when selective; and what their
    ops save beyond values, when run by hooks: ``hooked``, with :func:`passes.hooked_lifetimes.last_needed`)."""
    for segment in segments:
        if segment.recompute:
            needed = hooked.get(segment)
            kept = None if needed is None else held_in_forward(graph, segment)
            _call_recomputed(memory, graph, segment, ("rng",), kept=kept)
            if needed is not None:  # run by hooks: what its ops save beyond values stays, but dropout noise
                drawn = redrawn(graph, segment)
                for node in memory.index.id_list(n for n in segment.nodes if n not in drawn):
                    memory.allocate(slot(node, EXTRA), memory.index.saved_extra[node])
                for node in memory.index.id_list(segment.nodes):  # its body runs with autocast's cache on
                    if memory.index.autocast_cache[node]:
                        memory.allocate(slot(node, AUTOCAST_CACHE), memory.index.autocast_cache[node])
                memory.allocate(("rng-draws", id(segment)),  # a generator state per dropout, one counted above
                                max(len(drawn) - 1, 0) * graph.graph.get("rng_state_bytes", 0))
                for value in (*kept_inputs(segment), *kept):  # the rest goes now
                    if value not in needed:
                        memory.release(memory.index.ids[value])
        else:
            run_forward(memory, memory.index.id_list(segment.nodes), save=True)


def _backward_sequence(memory: LiveMemory, graph: nx.DiGraph, segments: Sequence[Segment], grads: set[int],
                       ran: Sequence[Step] | None = None, hooked: dict[Segment, Mapping[str, str]] | None = None) -> None:
    """Backward of segments in reverse; each recomputed one is first run again, with its
    kept matmul outputs when they were cached (always at the top level; nested, only when
    the enclosing recompute ran it: ``ran``), or, run by hooks (``hooked``, top level only),
    makes its values again as backward needs them."""
    for segment in reversed(segments):
        if not segment.recompute:
            run_backward(memory, memory.index.id_list(segment.nodes), grads)
            continue
        if hooked and segment in hooked:
            backward_hooked(memory, graph, segment, grads, hooked[segment])  # lets its inputs go as it goes
        else:
            _backward_recomputed(memory, graph, segment, grads, cached=ran is None or segment in ran)
            if not leaves_nothing(graph, segment):
                for value in memory.index.id_list(kept_inputs(segment)):
                    memory.release(value)
        memory.free(("rng", id(segment)))
        memory.free(("rng-draws", id(segment)))


def _backward_recomputed(memory: LiveMemory, graph: nx.DiGraph, segment: Segment, grads: set[int],
                         cached: bool) -> None:
    """Recompute a segment as far as :func:`recompute_steps` runs it (its children as a plan
    of their own), then run its backward; the backward of the ops :func:`trailing_backward`
    names runs before the recompute."""
    index = memory.index
    ran, stop = recompute_steps(graph, segment)
    first = trailing_backward(graph, segment)
    run_backward(memory, index.id_list(first), grads)
    trigger = recompute_trigger(graph, segment, first)
    if trigger is not None:  # what its backward made before it unpacked, alive through the recompute
        memory.allocate(("unpack", id(segment)), graph.nodes[trigger]["unpack_held_bytes"])
    kept = set(index.id_list(segment.saved_inside)) if cached else set()
    computed = set(index.id_list(step_nodes(ran)))
    within = set(index.id_list(segment.nodes))  # readers that hold a value: the body's, run or not
    memory.fresh.append(computed - kept | set(index.id_list(remat_nodes(segment))))
    unwound = _held_until_stop(memory, segment, computed, within)
    copied = _copy_state(memory, segment, first) if ran else []
    remade = run_remat(memory, segment) if ran or stop is not None else set()  # before its own ops
    for value in _stop_holds(graph, stop):
        memory.hold(index.ids[value])  # saved by the step the recompute stops at, which does not run
    rerun = ("rng-rerun", len(memory.fresh))
    if ran and draws_random(graph, segment.nodes):  # the recompute forks the generator while it runs
        memory.allocate(("rng-fork", id(segment)), graph.graph.get("rng_state_bytes", 0))
    run_plain = set(index.id_list(step for step in ran if not isinstance(step, Segment)))  # not as a child
    taken = kept & run_plain
    for is_segment, steps in groupby(ran, key=lambda step: isinstance(step, Segment)):
        if not is_segment:
            run_forward(memory, index.id_list(steps), save=True, within=within, consumed=taken,
                        moded=bool(segment.saved_inside))
            continue
        for child in steps:
            _call_recomputed(memory, graph, child, rerun, within=within)
    for value in remade:  # the recompute is over: a rematerialized input lives on if backward saved it
        memory.release(value)
    for value, times in unwound.items():  # the body's frame unwinds at the stop
        memory.release(value, times)
    for value in kept - taken:  # what the recompute did not reach is dropped from the cache
        memory.release(value)
        memory.free(slot(value, SELECTIVE_EXTRA))
    for node in copied:  # the copies no op it ran saved go with the recompute
        if node not in run_plain:
            memory.free(slot(node, STATE_COPY))
    memory.free(("rng-fork", id(segment)))  # the recompute's own graph, and the states its calls took, go
    for call in (call for step in ran if isinstance(step, Segment) for call in random_calls(graph, step)):
        memory.free((*rerun, id(call)))
    children = segment.children or (Segment(segment.nodes, False, segment.inputs, segment.outputs),)
    memory.free(("unpack", id(segment)))
    if first:  # their backward has run
        last = children[-1]
        children = (*children[:-1], replace(last, nodes=last.nodes[: len(last.nodes) - len(first)]))
    _backward_sequence(memory, graph, children, grads, ran)
    for node in copied:  # (each goes at its op's backward: :func:`passes.sim_ops.run_backward`)
        memory.free(slot(node, STATE_COPY))
    memory.fresh.pop()


def _copy_state(memory: LiveMemory, segment: Segment, first: Sequence[str]) -> list[int]:
    """The scratch copies of running statistics a recompute of ``segment`` makes as it starts
    (``state_copy_bytes`` of each op of its body, but for those whose backward ran first:
    ``first``), so that the model's buffers move once per step: allocated here, each held until
    its op's backward when the recompute runs the op (its batch norm saves them), else until
    the recompute ends. Returns the ops copied for."""
    index = memory.index
    if not index.state_copied:
        return []
    before = set(index.id_list(first))
    copied = [node for node in index.id_list(segment.nodes) if node in index.state_copied and node not in before]
    for node in copied:
        memory.allocate(slot(node, STATE_COPY), index.state_copy[node])
    return copied


def _held_until_stop(memory: LiveMemory, segment: Segment, computed: set[int], body: set[int]) -> dict[int, int]:
    """The holds a recompute's body keeps on what it computed until the recompute stops:
    the body is Python code that lets a value go after its last use *in the body*, so a
    value read by an op past the stop, or returned by the segment, lives until then (T5's
    decoder mask and encoder output did, 86 KB over the simulated peak). Held here for
    the segment's outputs; :func:`passes.sim_ops.run_forward` holds for readers past the stop when given
    the whole ``body`` (its node ids) as ``within``. Returns the holds to release once the
    recompute ends."""
    index = memory.index
    unwound: dict[int, int] = {}
    for node in index.id_list(segment.outputs):
        if node in computed:
            memory.hold(node)
            unwound[node] = 1
    for node in computed:
        later = sum(r in body and r not in computed for r in index.readers[node])
        if later:
            unwound[node] = unwound.get(node, 0) + later
    return unwound


def _stop_holds(graph: nx.DiGraph, stop: Step | None) -> Sequence[str]:
    """What the step a recompute stops at saved, which it holds without running: a
    recomputed child's inputs, or an op's ``saved`` values."""
    if isinstance(stop, Segment):
        return stop.inputs
    return graph.nodes[stop]["saved"] if stop else ()


def step_peak(graph: nx.DiGraph, segments: Sequence[Segment], limit: float = float("inf"),
              memory: LiveMemory | None = None) -> int:
    """Peak live bytes of one forward + backward run segment by segment (raises
    :class:`passes.sim_memory.LimitExceeded` as soon as they go above ``limit``), replayed
    onto ``memory`` when given (a fresh :class:`passes.sim_memory.LiveMemory` of ``graph``,
    whose own limit then applies: :mod:`passes.sim_peak` passes one that watches the live set)."""
    scheduled = plan_schedule(segments)
    if scheduled is not None:  # found with its peak, in the same memory model (passes.exact)
        if memory is not None:
            raise ValueError("step_peak: a plan run by an exact schedule (passes.exact) is not replayed op by op: "
                             "its peak is the schedule's own (Schedule.peak_bytes)")
        if scheduled.peak_bytes > limit:
            raise LimitExceeded(scheduled.peak_bytes)
        return scheduled.peak_bytes
    memory = LiveMemory(graph, limit) if memory is None else memory
    index = memory.index
    for name, kind in graph.nodes(data="kind"):
        if kind == "input":
            memory.hold(index.ids[name], graph.out_degree(name))
    for value in index.id_list(graph_outputs(graph)):
        memory.hold(value)
    hooked = {segment: last_needed(graph, segment) for segment in segments
              if segment.recompute and keeps_by_hooks(graph, segment)}  # asked in forward and backward
    _forward_sequence(memory, graph, segments, hooked)
    for node in index.autocast_cached:  # forward's autocast region ends: its cache goes
        memory.free(slot(node, AUTOCAST_CACHE))
    grads: set[int] = set()
    memory.allocate(("loss scalars",), loss_scalar_bytes(graph))
    memory.allocate(("loss",), loss_working_bytes(graph))
    own_loss = graph.graph.get("loss")
    for value in trained_outputs(graph):  # the model's own loss's gradient is the seed, held to the end
        memory.allocate(("seed",) if value == own_loss else slot(index.ids[value], GRAD), gradient_bytes(graph, value))
        grads.add(index.ids[value])
    memory.free(("loss",))
    _backward_sequence(memory, graph, segments, grads, hooked=hooked)
    return memory.peak


def eager_segments(graph: nx.DiGraph) -> tuple[Segment, ...]:
    """The plan of plain eager execution: one kept segment holding every op."""
    return make_segments(graph, [(op_nodes(graph), False)])


_EAGER_PEAKS: WeakKeyDictionary[nx.DiGraph, int] = WeakKeyDictionary()


def eager_peak(graph: nx.DiGraph) -> int:
    """Simulated peak of plain eager execution; computed once per cost graph (cost graphs
    are not changed after they are built)."""
    if graph not in _EAGER_PEAKS:
        _EAGER_PEAKS[graph] = step_peak(graph, eager_segments(graph))
    return _EAGER_PEAKS[graph]


_FORWARD_FLOPS: WeakKeyDictionary[nx.DiGraph, int] = WeakKeyDictionary()


def forward_flops(graph: nx.DiGraph) -> int:
    """What one forward computes (every op's ``flops``); summed once per cost graph, not
    once per simulated plan."""
    if graph not in _FORWARD_FLOPS:
        _FORWARD_FLOPS[graph] = sum(graph.nodes[n]["flops"] for n, k in graph.nodes(data="kind") if k == "op")
    return _FORWARD_FLOPS[graph]


def simulate(graph: nx.DiGraph, segments: Iterable[Segment], peak_bytes: int | None = None) -> Simulation:
    """Peak bytes and recompute FLOPs of a training step run with ``segments``; ``peak_bytes``
    is their peak when the caller has just replayed them (:func:`passes.peak_queries.peak_within`: a search's
    winning trial), so that the step is not replayed again (a second at 50k ops)."""
    segments = tuple(segments)
    recompute_flops, recompute_bytes = recompute_totals(graph, segments)
    forward = forward_flops(graph)
    return Simulation(
        peak_bytes=step_peak(graph, segments) if peak_bytes is None else peak_bytes,
        eager_peak_bytes=eager_peak(graph),
        recompute_flops=recompute_flops,
        forward_flops=forward,
        recompute_bytes=recompute_bytes,
    )
