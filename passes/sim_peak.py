"""What is alive at a plan's simulated peak, by name: where a budget is missed, and why.

:func:`passes.simulate.simulate` gives one number, the peak. When a plan misses a budget,
or peaks higher than a user expected, the question is which storages make it up: the
activations a checkpoint call keeps, the values backward saved, copies a recompute made,
gradients. :func:`peak_breakdown` replays the plan once to find the peak and once more to
take the live set where the running total first reaches it, and names every storage in it.
The parts add up to the simulated peak exactly (the replay is the simulator's own).

>>> import networkx as nx
>>> from passes.costgraph import add_value
>>> from passes.simulate import eager_segments
>>> g = nx.DiGraph()
>>> add_value(g, "x", kind="input", order=0, bytes=8, requires_grad=False)
>>> add_value(g, "a", kind="op", order=1, bytes=100, reads=["x"], saved=("x",))
>>> add_value(g, "b", kind="op", order=2, bytes=100, reads=["a"], saved=("a",))
>>> add_value(g, "out", kind="output", order=3, bytes=0, reads=["b"])
>>> breakdown = peak_breakdown(g, eager_segments(g))
>>> breakdown.peak_bytes, breakdown.reached_by
(600, 'the gradient of b')
>>> breakdown.bytes_by_kind()
{'loss': 300, 'activation': 200, 'gradient': 100}
>>> sum(s.bytes for s in breakdown.storages) + breakdown.temporary_bytes == breakdown.peak_bytes
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from passes.schedule import Matrix, Schedule, plan_schedule
from passes.segments import Segment
from passes.sim_memory import (
    AUTOCAST_CACHE,
    BACKWARD_EXTRA,
    EXTRA,
    FORWARD_EXTRA,
    GRAD,
    GRAD_PARTIAL,
    PARAM_ACCUMULATOR,
    PARAM_GRAD,
    SELECTIVE_EXTRA,
    SLOT_KINDS,
    STATE_COPY,
    VALUE,
    LiveMemory,
)
from passes.simulate import step_peak
from passes.training_graph import TrainingGraph, peak_moment, training_graph

KIND_NAMES = {
    VALUE: "activation",
    EXTRA: "saved beyond values",  # masks, indices an op saves for its backward
    FORWARD_EXTRA: "forward scratch",
    SELECTIVE_EXTRA: "selective cache",
    GRAD_PARTIAL: "partial gradient",
    GRAD: "gradient",
    PARAM_ACCUMULATOR: "shared parameter's gradient",
    PARAM_GRAD: "parameter gradients",
    BACKWARD_EXTRA: "backward scratch",
    AUTOCAST_CACHE: "autocast's cached cast",  # a parameter's 16-bit copy, kept to the end of forward
    STATE_COPY: "running statistics' copy",  # a recompute's, saved by its batch norm until its backward
}
"""What each kind of simulator storage is called in a breakdown."""


@dataclass(frozen=True)
class LiveStorage:
    """One storage alive at the peak: the node it belongs to (or what it is, for the loss and
    generator states), its ``kind`` (:data:`KIND_NAMES`, ``"recomputed copy"`` for a value a
    recompute made, ``"loss"``, ``"generator state"``), how deep in nested recomputes it
    was made (0: forward's) and its bytes."""

    name: str
    kind: str
    level: int
    bytes: int


@dataclass(frozen=True)
class PeakBreakdown:
    """The live set where the simulated peak is first reached: ``storages``, largest first;
    ``temporary_bytes`` an op's scratch alive for that moment only (0 when the peak is
    reached by an allocation); ``reached_by`` the storage (or temporary) that reached it."""

    peak_bytes: int
    storages: tuple[LiveStorage, ...]
    temporary_bytes: int
    reached_by: str

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes at the peak per kind, largest first (the temporary as ``"temporary"``)."""
        totals: dict[str, int] = {}
        for storage in self.storages:
            totals[storage.kind] = totals.get(storage.kind, 0) + storage.bytes
        if self.temporary_bytes:
            totals["temporary"] = self.temporary_bytes
        return dict(sorted(totals.items(), key=lambda item: -item[1]))


class _SnapshotMemory(LiveMemory):
    """The simulator's live memory that copies its live set the first time the running
    total reaches ``target`` (the peak a first replay found)."""

    def __init__(self, graph: nx.DiGraph, target: int) -> None:
        super().__init__(graph)
        self.target = target
        self.snapshot: dict | None = {} if target <= 0 else None  # nothing is ever alive: the peak is 0
        self.temporary = 0
        self.allocating: int | tuple | None = None  # the key being allocated
        self.reached_by: int | tuple | None = None  # the key whose allocation reached the peak

    def allocate(self, key: int | tuple, nbytes: int) -> None:
        self.allocating = key
        super().allocate(key, nbytes)
        self.allocating = None

    def touch(self, nbytes: int) -> None:
        if self.snapshot is None and self.current + nbytes >= self.target > self.current:
            self.snapshot, self.temporary = dict(self.live), self.target - self.current
        super().touch(nbytes)

    def raise_peak(self, peak: int) -> None:
        if self.snapshot is None and peak >= self.target and self.current >= self.target:
            self.snapshot, self.reached_by = dict(self.live), self.allocating
        super().raise_peak(peak)


def peak_breakdown(graph: nx.DiGraph, segments: Sequence[Segment]) -> PeakBreakdown:
    """What is alive at the simulated peak of ``segments`` on ``graph`` (see the module's
    docstring): two replays, so about twice a simulation's time. A plan run by an exact
    schedule is broken down from the schedule's stages (:func:`schedule_breakdown`)."""
    segments = tuple(segments)
    scheduled = plan_schedule(segments)
    if scheduled is not None:
        return schedule_breakdown(graph, scheduled)
    memory = _SnapshotMemory(graph, step_peak(graph, segments))
    step_peak(graph, segments, memory=memory)
    assert memory.snapshot is not None, "the second replay reaches the first one's peak"
    storages = sorted((_described(memory, key, nbytes) for key, nbytes in memory.snapshot.items()),
                      key=lambda s: (-s.bytes, s.name, s.kind))
    reached = (f"a temporary of {memory.temporary} bytes" if memory.temporary else
               _phrase(_described(memory, memory.reached_by, 0)) if memory.reached_by is not None else "nothing")
    return PeakBreakdown(memory.target, tuple(storages), memory.temporary, reached)


def schedule_breakdown(graph: nx.DiGraph, schedule: Schedule) -> PeakBreakdown:
    """What is alive at an exact schedule's peak (:mod:`passes.exact`), from the stages it
    runs (:func:`passes.training_graph.peak_moment`): values held from forward
    (``activation``), made again in that stage (``recomputed copy``), what ops save beyond
    values, gradients, the loss, autocast's cached casts; the parts add up to ``schedule.peak_bytes``."""
    R, S = schedule.stages
    if not R:
        raise ValueError("schedule_breakdown: this schedule carries no stages (made without passes.exact.schedule_of)")
    training = training_graph(graph)
    stage, moment = peak_moment(training, R, S)
    casts = (LiveStorage(training.about[i], KIND_NAMES[AUTOCAST_CACHE], 0, training.cached[i]) for i in moment.cached)
    storages = sorted((*(_stage_storage(training, R, stage, i) for i in moment.live if training.mem[i]), *casts),
                      key=lambda s: (-s.bytes, s.name, s.kind))
    reached = (f"a temporary of {moment.temporary} bytes" if moment.temporary else
               _phrase(_stage_storage(training, R, stage, moment.reached)) if moment.reached is not None
               else "what the stage holds")
    return PeakBreakdown(int(moment.peak), tuple(storages), moment.temporary, reached)


def _stage_storage(training: TrainingGraph, R: Matrix, stage: int, node: int) -> LiveStorage:
    """The :class:`LiveStorage` of a training-graph node alive in ``stage``."""
    role, about, nbytes = training.role(node), training.about[node], training.mem[node]
    if role != "value":
        return LiveStorage(about, {"extra": KIND_NAMES[EXTRA], "gradient": KIND_NAMES[GRAD]}.get(role, role), 0, nbytes)
    made_again = max(t for t in range(stage + 1) if R[t][node]) != training.home[node]  # its latest making
    return LiveStorage(about, "recomputed copy" if made_again else KIND_NAMES[VALUE], int(made_again), nbytes)


def _described(memory: LiveMemory, key: int | tuple, nbytes: int) -> LiveStorage:
    """The :class:`LiveStorage` a live-set key names (:func:`passes.sim_memory.slot`, a
    recompute's copy one level up per nesting, shared parameters past the nodes' ids)."""
    if isinstance(key, tuple):  # a generator state, what a backward made before its recompute, or the loss's
        tag = str(key[0])
        kind = "generator state" if tag.startswith("rng") else KIND_NAMES[GRAD] if tag == "unpack" else "loss"
        return LiveStorage(tag, kind, 0, nbytes)
    node, kind = divmod(key, SLOT_KINDS)
    names, size = memory.index.names, memory.size
    if kind == VALUE and node >= size:
        level, root = divmod(node, size)
        return LiveStorage(names[root], "recomputed copy", level, nbytes)
    name = names[node] if node < size else f"shared parameter {node - size}"
    return LiveStorage(name, KIND_NAMES[kind], 0, nbytes)


def _phrase(storage: LiveStorage) -> str:
    """``"the gradient of op7"``-style words for what reached the peak (``reached_by``)."""
    depth = f" (recompute depth {storage.level})" if storage.level else ""
    return f"the {storage.kind} of {storage.name}{depth}"
