"""A checkpointing plan: which values are kept after forward and what is recomputed, and
the one way to make one from segments.

A :class:`Plan` is a sequence of :class:`passes.segments.Segment` s over a cost graph's op
nodes, validated and simulated: its ``checkpoints`` are the activations kept at the edges of
recomputed segments, its ``peak_bytes`` the simulator's estimate. Strategies build
:class:`Candidate` s (segments not yet simulated, cheap to make and to price) and turn the
ones worth it into plans with :func:`simulated`; every plan is made by
:func:`plan_of_segments`, which also gives each recomputed segment what codegen needs to
know of the cost graph (:class:`passes.segments.RecomputeFacts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import networkx as nx

from passes.graph_facts import inputs_without_grad, op_nodes
from passes.kept_bytes import boundary_bytes, storage_bytes
from passes.recompute import overhead_cost, recomputed_count, with_facts
from passes.schedule import describe as describe_schedule
from passes.schedule import plan_schedule
from passes.segments import Segment, checkpoints_of, make_segments, validate_plan
from passes.simulate import simulate
from passes.units import format_bytes

Progress = Callable[[int, int], None]  # (done, total): a strategy slow enough to show how far it is

@dataclass(frozen=True)
class Checkpoint:
    """A value a plan keeps from forward, as a person reads it: its name, its own bytes,
    and its shape and dtype when the cost graph knows them."""

    name: str
    bytes: int
    shape: str = ""
    dtype: str = ""


@dataclass(frozen=True)
class Plan:
    """What a strategy chose for a cost graph; ``peak_bytes`` is the simulator's estimate.

    ``checkpoint_details`` describe ``checkpoints`` (for codegen's header);
    ``inputs_without_grad`` are the inputs the plan was simulated for without a gradient
    (:func:`passes.graph_facts.inputs_without_grad`) and ``autocast`` the autocast state
    (the cost graph's): the rewritten module warns when a call differs. Like the segments'
    ``facts`` they follow from the graph and take no part in comparing plans.
    """

    strategy: str
    segments: tuple[Segment, ...]
    checkpoints: tuple[str, ...]
    checkpoint_bytes: float
    peak_bytes: int
    eager_peak_bytes: int
    recompute_flops: int
    forward_flops: int
    notes: tuple[str, ...] = field(default=())
    recompute_bytes: int = 0
    cost_unit: str = "FLOPs"  # what recompute_flops and forward_flops count ("ns": measured time)
    overhead: int = 0  # checkpointing's own cost, in cost_unit (passes.recompute.overhead_cost)
    checkpoint_details: tuple[Checkpoint, ...] = field(default=(), compare=False, repr=False)
    inputs_without_grad: tuple[str, ...] = field(default=(), compare=False, repr=False)
    autocast: str = field(default="", compare=False, repr=False)

    @property
    def recomputed_segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.recompute)

    @property
    def cost_key(self) -> tuple[int, int, int]:
        """What "least recompute" compares: recomputed FLOPs (plus checkpointing's own cost
        where it was measured), then bytes written by the recompute, then checkpoint calls
        (recomputed segments, nested ones included)."""
        return self.recompute_flops + self.overhead, self.recompute_bytes, recomputed_count(self.segments)

    def __str__(self) -> str:
        lines = [
            f"Plan({self.strategy}): {len(self.recomputed_segments)} recomputed segment(s) "
            f"of {len(self.segments)}, {len(self.checkpoints)} checkpoint(s) "
            f"({format_bytes(self.checkpoint_bytes, 'MiB')})",
            f"  simulated peak {format_bytes(self.peak_bytes, 'MiB')} vs eager "
            f"{format_bytes(self.eager_peak_bytes, 'MiB')}"
            f" ({self.peak_bytes / max(self.eager_peak_bytes, 1):.2f}x); recompute "
            f"{self.recompute_flops / max(self.forward_flops, 1):.0%} of forward {self.cost_unit}",
        ]
        for index, segment in enumerate(self.segments):
            lines.extend(_describe(segment, f"segment {index}", "  "))
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _describe(segment: Segment, name: str, indent: str) -> list[str]:
    """One line per segment, nested children indented under their parent."""
    if segment.schedule is not None:
        return [f"{indent}{name} (run by an exact schedule, {len(segment.nodes)} nodes): keeps "
                f"{', '.join(segment.saved_inside) or 'nothing'} from forward",
                *(f"{indent}  {line}" for line in describe_schedule(segment.schedule))]
    what = "recomputed" if segment.recompute else "kept"
    whole = len(segment.facts.kept_whole) if segment.facts else 0
    if len(segment.saved_inside) > whole:
        what += f", keeps {len(segment.saved_inside) - whole} matmul/conv outputs"
    if whole:
        what += f", keeps {whole} other values"
    lines = [f"{indent}{name} ({what}, {len(segment.nodes)} nodes): "
             f"{segment.nodes[0]} .. {segment.nodes[-1]} -> {', '.join(segment.outputs)}"]
    lines.extend(f"{indent}  rematerializes {r.value} from {', '.join(r.sources) or 'parameters'} "
                 f"({len(r.nodes)} ops, no grad)" for r in segment.remat)
    for index, child in enumerate(segment.children):
        lines.extend(_describe(child, f"{name}.{index}", indent + "  "))
    return lines


@dataclass(frozen=True)
class Candidate:
    """A strategy's segments before simulation: cheap to make and to price
    (:func:`passes.recompute.cost_key`), so a search can simulate only the ones that could win."""

    strategy: str
    segments: tuple[Segment, ...]
    notes: tuple[str, ...] = ()


def plan_of_segments(graph: nx.DiGraph, strategy: str, segments: Sequence[Segment],
                     notes: Sequence[str] = (), peak_bytes: int | None = None) -> Plan:
    """A :class:`Plan` of ready segments: validated, simulated (unless the caller just did:
    ``peak_bytes``, :func:`passes.simulate.simulate`), and described for codegen."""
    segments = tuple(segments)
    validate_plan(graph, segments)
    checkpoints = checkpoints_of(graph, segments)
    result = simulate(graph, segments, peak_bytes)
    return Plan(
        strategy=strategy,
        segments=tuple(with_facts(graph, s) for s in segments),
        checkpoints=checkpoints,
        checkpoint_bytes=(storage_bytes(graph, checkpoints) if plan_schedule(segments) is not None
                          else boundary_bytes(graph, checkpoints)),  # a schedule keeps values it never cuts at
        peak_bytes=result.peak_bytes,
        eager_peak_bytes=result.eager_peak_bytes,
        recompute_flops=result.recompute_flops,
        forward_flops=result.forward_flops,
        notes=tuple(notes),
        recompute_bytes=result.recompute_bytes,
        cost_unit=graph.graph.get("cost_unit", "FLOPs"),
        overhead=overhead_cost(graph, segments),
        checkpoint_details=tuple(_checkpoint(graph, name) for name in checkpoints),
        inputs_without_grad=inputs_without_grad(graph),
        autocast=graph.graph.get("autocast", ""),
    )


def _checkpoint(graph: nx.DiGraph, name: str) -> Checkpoint:
    attributes = graph.nodes[name]
    return Checkpoint(name, attributes["bytes"], attributes.get("shape", ""), attributes.get("dtype", ""))


def build_plan(graph: nx.DiGraph, strategy: str, groups: Iterable[tuple[Iterable[str], bool]],
               notes: Sequence[str] = ()) -> Plan:
    """The plan of ``(nodes, recompute)`` groups (:func:`passes.segments.make_segments`)."""
    return plan_of_segments(graph, strategy, make_segments(graph, groups), notes)


def simulated(graph: nx.DiGraph, candidate: Candidate) -> Plan:
    """The :class:`Plan` of a candidate: validated and simulated."""
    return plan_of_segments(graph, candidate.strategy, candidate.segments, candidate.notes)


def from_positions(graph: nx.DiGraph, strategy: str, positions: Sequence[int], notes: Sequence[str] = ()) -> Candidate:
    """Segments whose boundaries are prefix cuts after the given op positions."""
    ops = op_nodes(graph)
    starts = [0, *(p + 1 for p in positions)]
    groups = [(ops[start:end], True) for start, end in pairwise(starts)]
    return Candidate(strategy, make_segments(graph, [*groups, (ops[starts[-1]:], False)]), tuple(notes))


def selective(graph: nx.DiGraph, candidate: Candidate) -> Candidate:
    """``candidate`` with every matmul/convolution output of its recomputed segments kept
    from forward (selective checkpointing): more memory, far less recompute."""
    segments = tuple(selective_segment(graph, s) if s.recompute else s for s in candidate.segments)
    return Candidate(f"{candidate.strategy}+selective", segments, candidate.notes)


def selective_segment(graph: nx.DiGraph, segment: Segment) -> Segment:
    """``segment`` recomputed selectively: its matmul/convolution outputs kept from forward."""
    return replace(segment, saved_inside=tuple(n for n in segment.nodes if graph.nodes[n]["expensive"]))
