"""Rematerialized inputs: a recomputed segment's input dropped after forward and recomputed,
without gradients, from kept values at the start of the segment's recompute.

A recomputed segment keeps its inputs from forward until its backward. When an input ``v`` is
cheap to compute again from values that stay alive anyway (another input of the segment, an
input of an earlier recomputed segment, a value an earlier kept op saved for its backward, the
model's inputs, parameters: :func:`held_at_each`), the segment can drop
``v`` after its last forward use and compute it again from those *sources* when backward
recomputes the segment: the ops between (:attr:`Remat.nodes`) run under ``no_grad`` just
before the segment's own ops. This is the exact optimum's (:mod:`passes.checkmate`) "recompute
a value from several kept values just before its use", which segments over prefix cuts alone
cannot express.

**Gradients.** The copy made in the recompute never carries a gradient: it is detached, with
``requires_grad`` set as the forward value's (so the ops of the segment save the same tensors
as in forward), and only fills the tensors backward saved. The gradient the segment computes
for ``v`` flows along the autograd graph forward built, whose edge from the segment to ``v``'s
producer exists because forward ran the segment on the real ``v``. So ``v`` may require grad
and its producer may sit anywhere (a kept segment, an earlier recomputed one): no gradient
is lost or counted twice, and the chain's parameters get no gradient from the copy. The rule
the validation enforces is therefore about *values*, not gradients: the copy must equal
forward's ``v`` (pure chain, unchanged sources), and the sources must be alive when the
segment's recompute runs (:func:`held_at_each`).

Only top-level recomputed segments rematerialize inputs (a nested child's recompute runs
inside its parent's, where its inputs are recomputed values anyway).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import networkx as nx

from passes.graph_facts import graph_outputs, in_order, leaves_nothing, node_attribute, per_graph_value, pure, pure_ops
from passes.hooked import SegmentLike, keeps_by_hooks
from passes.hooked_lifetimes import last_needed
from passes.sim_memory import LiveMemory
from passes.sim_ops import run_forward


@dataclass(frozen=True)
class Remat:
    """Segment input ``value`` rematerialized from ``sources`` (activations or model inputs that
    stay alive; parameters are read by the ops themselves) by running ``nodes`` (in execution
    order, ending with ``value``) without gradients at the start of the segment's recompute."""

    value: str
    sources: tuple[str, ...]
    nodes: tuple[str, ...]


MAX_REMAT_OPS = 48
"""The most ops one rematerialized value is made again through. Longer chains cost more to
run than most values are worth dropping, and tracing them is what cost: on a 1000-op
residual stack a budget plan traced 55k chains, many back toward the model's input, and
took 22 s (1.3 s at 10k ops, where dropping values is not tried)."""


class ChainTooLong(ValueError):
    """A value's chain back to the kept values is longer than asked (:data:`MAX_REMAT_OPS`)."""


def remat_chain(graph: nx.DiGraph, value: str, keep: Iterable[str], limit: int | None = None) -> Remat:
    """The :class:`Remat` computing ``value`` from ``keep``: the ops on paths into ``value``
    that start at a value of ``keep``, a model input or a parameter (the sources are the ones
    of those that are not parameters and that the chain reads). :class:`ChainTooLong` as soon
    as the chain has more than ``limit`` ops."""
    stop = keep if isinstance(keep, (set, frozenset, HeldAt)) else set(keep)
    last = _last_chains(graph).get(value)
    if last is not None and _same_chain(graph, last, stop) and (limit is None or len(last.nodes) <= limit):
        return last
    chain, sources, todo = {value}, set(), [value]
    while todo:
        for u in graph.predecessors(todo.pop()):
            kind = graph.nodes[u]["kind"]
            if kind == "param" or u in chain:
                continue
            if u in stop or kind == "input":
                sources.add(u)
            else:
                chain.add(u)
                todo.append(u)
                if limit is not None and len(chain) > limit:
                    raise ChainTooLong(f"{value!r} is more than {limit} ops from the values kept")
    remat = Remat(value, tuple(in_order(graph, sources)), tuple(in_order(graph, chain)))
    _last_chains(graph)[value] = remat
    return remat


@per_graph_value
def _last_chains(graph: nx.DiGraph) -> dict[str, Remat]:
    """The chain :func:`remat_chain` last traced to each value of ``graph``: a cache, not a
    fact. Plan searches ask for the chains of the same values again and again with kept sets
    that differ elsewhere (the drop search checks ~200 plans on a 500-op graph, each
    re-tracing every chain); one still the same is checked in a few set lookups."""
    return {}


def _same_chain(graph: nx.DiGraph, remat: Remat, stop: Container[str]) -> bool:
    """Whether tracing ``remat.value`` back to ``stop`` gives ``remat`` again: the trace
    looks only at the nodes it visits, and it visits the same ones when each source is still
    a stop (or a model input) and no op of the chain but the value itself is one."""
    kind = node_attribute(graph, "kind")
    return (all(s in stop or kind[s] == "input" for s in remat.sources)
            and not any(n in stop for n in remat.nodes if n != remat.value))


def runs_by_hooks(graph: nx.DiGraph, segment: SegmentLike) -> bool:
    """Whether a recomputed segment needs no checkpoint call: one op whose recompute runs
    nothing but the chains of its rematerialized inputs, because it saves no output of its
    own or keeps it whole from forward (the segments of a plan dropping values,
    :mod:`passes.drops`). Its op then runs as eager code and only the copies of the
    rematerialized inputs it saves are dropped, each made again when backward unpacks it
    (:class:`graphckpt.dropping.DropModule`): a few microseconds, where a checkpoint call
    costs about a tenth of a millisecond. Memory is the same or less (it keeps only the
    inputs the op saves, the call all of them)."""
    if not (segment.recompute and segment.remat and not segment.children and len(segment.nodes) == 1):
        return False
    (name,) = segment.nodes
    attributes = graph.nodes[name]
    return attributes["saves_from"] != "outputs" or (name in segment.saved_inside and not attributes["expensive"])


class HeldAt(Container[str]):
    """The activations :func:`held_at_each` finds alive at one segment's recompute: the
    graph's outputs, what the segments before it hold for later ones, and its own kept
    inputs. A view of what the whole plan holds, by the segment each value is first held
    after, not a copy per segment: a plan dropping hundreds of values has hundreds of
    segments, and copying the growing set for each was a quarter of building one."""

    __slots__ = ("always", "first_held", "index", "own")

    def __init__(self, always: set[str], first_held: dict[str, int], index: int, own: set[str]) -> None:
        self.always, self.first_held, self.index, self.own = always, first_held, index, own

    def __contains__(self, value: object) -> bool:
        return value in self.own or value in self.always or self.first_held.get(value, self.index) < self.index

    def __iter__(self) -> Iterator[str]:
        earlier = (value for value, after in self.first_held.items() if after < self.index)
        return iter({*self.always, *earlier, *self.own})


def held_at_each(graph: nx.DiGraph, segments: Sequence[SegmentLike]) -> list[HeldAt]:
    """For each top-level segment, the activations certainly alive when backward recomputes it
    (its backward comes before the segments before it): the graph's outputs; the inputs the
    recomputed segments up to it keep from forward (not counting inputs they rematerialize,
    nor those of a call that :func:`passes.graph_facts.leaves_nothing`);
    the values recomputed segments before it keep inside (``saved_inside``, held until their
    own recompute) and return (one the segment uses only inside never reaches the forward code
    calling later segments); and what the ops of kept segments before it saved for their
    backward. A segment run by saved-tensor hooks holds an input or kept value only while its
    own backward needs it (:func:`passes.hooked_lifetimes.last_needed`), so only those count for it.
    One pass over the plan."""
    returned = set(graph_outputs(graph))
    saved = node_attribute(graph, "saved")
    first_held: dict[str, int] = {}  # value -> the segment after which it is held for later ones
    result = []
    for index, segment in enumerate(segments):
        own: set[str] = set()
        if segment.recompute and not leaves_nothing(graph, segment):  # such a call holds nothing
            dropped = {r.value for r in segment.remat}
            own = {v for v in segment.inputs if v not in dropped}
        result.append(HeldAt(returned, first_held, index, own))
        if not segment.recompute:
            for name in segment.nodes:
                for value in saved[name]:
                    first_held.setdefault(value, index)
            continue
        held = own
        if not segment.children:  # forward's value: only an output reaches later calls
            held = own | (set(segment.saved_inside) & set(segment.outputs))
        if keeps_by_hooks(graph, segment):  # let go at their last use, in forward for some
            held = held & last_needed(graph, segment).keys()
        for value in held:
            first_held.setdefault(value, index)
    return result


def validate_remat(graph: nx.DiGraph, segments: Sequence[SegmentLike], error: type[Exception],
                   chains_built: bool = False) -> None:
    """Raise ``error`` naming the node unless every rematerialized input is safe: a top-level
    recomputed segment's own input, owning its storage; its chain as :func:`remat_chain` builds
    it, every op :func:`pure` (not checked again with ``chains_built``: the caller just built
    and checked them, as :func:`with_remat` does); every source a model input or a value
    :func:`held_at_each` the segment's recompute, not written later and not rematerialized itself."""
    alive = held_at_each(graph, segments) if any(s.remat for s in segments) else []
    _validate_held(graph, segments, alive, error, check_chains=not chains_built)


def _validate_held(graph: nx.DiGraph, segments: Sequence[SegmentLike], alive: Sequence[Container[str]],
                   error: type[Exception], check_chains: bool) -> None:
    """:func:`validate_remat` given what is alive at each segment's recompute (``alive``)."""
    for index, segment in enumerate(segments):
        for child in segment.children:
            if child.remat or any(c.remat for c in child.children):
                raise error(f"segment {index}: only top-level segments rematerialize inputs")
        if not segment.remat:
            continue
        where = f"segment {index}"
        if not segment.recompute:
            raise error(f"{where} is kept: only recomputed segments rematerialize inputs")
        held, values = alive[index], [r.value for r in segment.remat]
        if len(set(values)) != len(values):
            raise error(f"{where} rematerializes an input twice: {values}")
        for remat in segment.remat:
            _validate_one(graph, remat, segment, held, f"{where} rematerializing {remat.value!r}", error,
                          check_chain=check_chains)


def _validate_one(graph: nx.DiGraph, remat: Remat, segment: SegmentLike, held: Container[str], where: str,
                  error: type[Exception], check_chain: bool = True) -> None:
    """Check one :class:`Remat` of ``segment`` (see :func:`validate_remat`)."""
    value = remat.value
    if value not in segment.inputs:
        raise error(f"{where}: {value!r} is not an input of the segment")
    if graph.nodes[value]["kind"] != "op" or graph.nodes[value]["alias_of"] is not None:
        raise error(f"{where}: {value!r} must be a computed value owning its storage")
    if check_chain:
        _validate_chain(graph, remat, where, error)
    for source in remat.sources:
        attributes = graph.nodes[source]
        if attributes["state"] or not attributes["cuttable"]:
            raise error(f"{where}: source {source!r} changes after forward reads it")
        if attributes["kind"] != "input" and source not in held:
            raise error(f"{where}: source {source!r} is not kept when the segment is recomputed")


def _validate_chain(graph: nx.DiGraph, remat: Remat, where: str, error: type[Exception]) -> None:
    """Check that ``remat`` runs the chain from its sources to its value, every op pure."""
    if remat != remat_chain(graph, remat.value, remat.sources):
        raise error(f"{where}: its nodes and sources are not the chain from {list(remat.sources)} to {remat.value!r}")
    _check_pure(graph, remat, where, error)


def _check_pure(graph: nx.DiGraph, remat: Remat, where: str, error: type[Exception]) -> None:
    """Check that every op of ``remat``'s chain may run again (:func:`pure`)."""
    pure = pure_ops(graph)
    for name in remat.nodes:
        if name not in pure:
            raise error(f"{where}: {name!r} may not run again without gradients (random, in-place, "
                        "state, or written later)")


def rematerializable(graph: nx.DiGraph, name: str) -> bool:
    """Whether an input ``name`` could be rematerialized at all: a computed value owning
    storage whose own op is :func:`pure` (its chain's ops are checked once its sources are known)."""
    attributes = graph.nodes[name]
    return attributes["alias_of"] is None and attributes["bytes"] > 0 and pure(graph, name)


def remat_options(graph: nx.DiGraph, segments: Sequence[SegmentLike]) -> list[tuple[int, str]]:
    """Every ``(segment index, input)`` a top-level recomputed segment could rematerialize:
    its computed, :func:`rematerializable` inputs, in plan order."""
    return [(index, value) for index, segment in enumerate(segments) if segment.recompute
            for value in segment.inputs if graph.nodes[value]["kind"] == "op" and rematerializable(graph, value)]


def greedy_remat(graph: nx.DiGraph, segments: Sequence[SegmentLike], error: type[Exception] = ValueError,
                 every: int = 1) -> tuple[SegmentLike, ...]:
    """``segments`` rematerializing every ``every``-th of :func:`remat_options` that still
    gives a valid plan with the ones taken before (whatever it does to the peak): a plan that
    uses the new kind wherever it can, for tests."""
    picks: list[tuple[int, str]] = []
    for option in remat_options(graph, segments)[::every]:
        try:
            validate_remat(graph, with_remat(graph, segments, [*picks, option], error), error)
        except error:
            continue
        picks.append(option)
    return with_remat(graph, segments, picks, error)


def with_remat(graph: nx.DiGraph, segments: Sequence[SegmentLike], picks: Iterable[tuple[int, str]],
               error: type[Exception] = ValueError) -> tuple[SegmentLike, ...]:
    """``segments`` with top-level segment ``index`` rematerializing input ``value`` for each
    ``(index, value)`` of ``picks`` (replacing what they rematerialized before), each from the
    nearest values still held at that segment's recompute (:func:`held_at_each`, every pick's drop
    counted); ``error`` when a pick is no input of a recomputed segment or the result fails
    :func:`validate_remat` (a chain that is not pure, a source written after forward) or a
    chain runs more than :data:`MAX_REMAT_OPS` ops."""
    chosen: dict[int, list[str]] = {}
    for index, value in picks:
        if not segments[index].recompute or value not in segments[index].inputs or not rematerializable(graph, value):
            raise error(f"segment {index} cannot rematerialize {value!r}")
        chosen.setdefault(index, []).append(value)
    dropped = [replace(s, remat=tuple(Remat(v, (), ()) for v in in_order(graph, chosen.get(i, ()))))
               if i in chosen or s.remat else s for i, s in enumerate(segments)]
    result, alive = [], held_at_each(graph, dropped)
    for index, segment in enumerate(dropped):
        if not segment.remat:  # nothing to rematerialize: kept as it is
            result.append(segment)
            continue
        held = alive[index]
        try:
            remats = tuple(remat_chain(graph, r.value, held, MAX_REMAT_OPS) for r in segment.remat)
        except ChainTooLong as long:
            raise error(f"segment {index}: {long}") from None
        for remat in remats:
            _check_pure(graph, remat, f"segment {index} rematerializing {remat.value!r}", error)
        result.append(replace(segment, remat=remats))
    # sources that change after forward, ...; what is held depends on which values are
    # rematerialized, not on their chains: ``alive`` is the result's too
    _validate_held(graph, result, alive, error, check_chains=False)
    return tuple(result)


def remat_nodes(segment: SegmentLike) -> list[str]:
    """The ops a recompute of ``segment`` runs to rematerialize its inputs, in order, each once."""
    seen: dict[str, None] = {}
    for remat in segment.remat:
        seen.update(dict.fromkeys(remat.nodes))
    return list(seen)


def remat_sources(segment: SegmentLike) -> tuple[str, ...]:
    """Sources of ``segment``'s rematerialized inputs that are not inputs of the segment: what
    its checkpoint call is given beyond its inputs, and keeps until its backward."""
    extra: dict[str, None] = {}
    for remat in segment.remat:
        extra.update((s, None) for s in remat.sources if s not in segment.inputs)
    return tuple(extra)


def kept_inputs(segment: SegmentLike) -> tuple[str, ...]:
    """What ``segment``'s checkpoint call keeps from forward: its inputs but the rematerialized
    ones, and the sources they are rematerialized from."""
    dropped = {r.value for r in segment.remat}
    return (*(v for v in segment.inputs if v not in dropped), *remat_sources(segment))


def run_remat(memory: LiveMemory, segment: SegmentLike) -> set[int]:
    """Replay the rematerialization at the start of ``segment``'s recompute onto ``memory``:
    each op of the chains allocates its value (recomputed storage: the caller has put the
    chain's nodes in ``memory.fresh``) and temporaries for a moment; a chain value is freed
    after its last use in the chains. Returns the ids of the rematerialized values, held once
    each: the caller releases them once the recompute has run (what backward saved of them stays)."""
    index = memory.index
    chain = index.id_list(remat_nodes(segment))
    targets = set(index.id_list(r.value for r in segment.remat))
    run_forward(memory, chain, save=False, within=set(chain), keep=targets, selective=False)
    return targets
