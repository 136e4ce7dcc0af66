"""A plan in hand read as a schedule of the exact solver (:mod:`passes.checkmate`): the start
its search polishes.

The solver is asked for schedules recomputing less than the plan in hand (a cutoff). At
tight budgets its first solves often find none in their time, and the polish then starts
from whatever schedule a small sub-MIP finds, above the plan, or from none (one of
``scripts/planner_gap.py``'s 40-op random DAGs at 0.3 of eager kept its plan of 978 FLOPs in
two runs; started from the plan, 837-918; the zoo DenseNet at 0.5 of eager 71.4M -> 47.8-51.3M).
Read as a schedule, the plan is a start recomputing at most what it does and peaking at
most where it does (its simulated peak, in the solver's memory model).

The reading (:func:`start_schedule`) replays the plan's step in the simulator and notes what
forward holds when it ends and which values (and extras) backward makes again before which
op's backward (:func:`plan_makes`). The schedule runs forward once, holding those; makes each
of those values at the last stage before that op's backward where the runtime can act (a
hooked op's backward, :func:`passes.checkmate.pin_executable`), with anything it reads that
is not held (views, and the uncuttable values a recompute makes afresh; values of no bytes
are held from forward); and holds every value from where it is made to the last stage reading that copy
(:func:`passes.training_graph.held_between_reads`). Whether it fits the budget in the solver's memory model is the
solver's rows' to say (:func:`start_columns`, solved with these columns fixed).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Sequence
from itertools import pairwise
from typing import NamedTuple

import networkx as nx

from passes.graph_facts import node_attribute, pure_ops
from passes.highs import Milp
from passes.schedule import extra_key
from passes.segments import Segment
from passes.sim_memory import EXTRA, SLOT_KINDS, VALUE, LiveMemory
from passes.simulate import step_peak
from passes.training_backward import backward_stage
from passes.training_graph import Matrix, TrainingGraph, held_between_reads, hooked_stages, stage_peaks

FORWARD_ENDS = ("loss",)  # the key the replay allocates once forward has run (passes.simulate.step_peak)


class PlanMakes(NamedTuple):
    """What a plan's step holds when forward ends and what backward makes again."""

    values: frozenset[str]  # ops whose values (storages) forward holds into backward
    extras: frozenset[str]  # ops whose extras it holds
    made: tuple[tuple[str, str], ...]  # (training-graph node made again, the op before whose backward)
    in_order: bool = True  # its forward runs the ops in the graph's order, as a schedule does
    peak_bytes: float = float("inf")  # the plan's simulated peak


class _MakesRecorder(LiveMemory):
    """The simulator's live memory noting the live set when forward ends and, after, each
    storage or extra made and each op's backward (with a gradient or not), in the order the
    replay runs them."""

    def __init__(self, graph: nx.DiGraph) -> None:
        super().__init__(graph)
        self.entering: frozenset | None = None  # the live keys when forward ended
        self.events: list[tuple[int, int]] = []  # (slot kind, node id); kind -1: the node's backward

    def allocate(self, key: int | tuple, nbytes: int) -> None:
        if self.entering is None and key == FORWARD_ENDS:
            self.entering = frozenset(self.live)
        elif self.entering is not None and isinstance(key, int) and key not in self.live and nbytes:
            if key % SLOT_KINDS in (VALUE, EXTRA):
                self.events.append((key % SLOT_KINDS, (key // SLOT_KINDS) % self.size))
        super().allocate(key, nbytes)

    def backward_begins(self, node: int) -> None:
        if self.entering is not None:
            self.events.append((-1, node))


def plan_makes(graph: nx.DiGraph, segments: Sequence[Segment]) -> PlanMakes:
    """Replay ``segments``' step (:func:`passes.simulate.step_peak`) and read off
    :class:`PlanMakes`. Each value made is made before the next op's backward, that op's gradient
    or not: an op taking no gradient still holds what it saved until its backward (a random
    graph's ``requires_grad=False`` op saving a recomputed value, read as made before the next
    op taking one, was made twice in the reading)."""
    memory = _MakesRecorder(graph)
    step_peak(graph, segments, memory=memory)
    names, index, entering = memory.index.names, memory.index, memory.entering or frozenset()
    backward_at = {node: position for position, (kind, node) in enumerate(memory.events) if kind < 0}
    order = sorted((position, node) for node, position in backward_at.items())
    made = []
    for position, (kind, node) in enumerate(memory.events):
        after = bisect_right(order, (position, len(names)))
        if kind >= 0 and after < len(order):
            made.append((extra_key(names[node]) if kind == EXTRA else names[node], names[order[after][1]]))
    return PlanMakes(frozenset(n for i, n in enumerate(names) if index.value_keys[i] in entering),
                     frozenset(n for i, n in enumerate(names) if i * SLOT_KINDS + EXTRA in entering), tuple(made),
                     _in_graph_order(graph, segments), memory.peak)


def _in_graph_order(graph: nx.DiGraph, segments: Sequence[Segment]) -> bool:
    """Whether ``segments`` run their ops in the graph's execution order. A plan may move an
    op that reads nothing before it ahead (a view of an input recomputed first); a schedule
    runs forward in the graph's order, and read as one such a plan may peak higher than it
    does (an op's extra made beside a value the plan made only after it)."""
    order = node_attribute(graph, "order")
    ranks = [order[name] for segment in segments for name in segment.nodes]
    return all(a < b for a, b in pairwise(ranks))


def start_schedule(graph: nx.DiGraph, training: TrainingGraph, makes: PlanMakes,
                   with_extra: Collection[str]) -> tuple[Matrix, Matrix] | None:
    """``R`` and ``S`` of the executable schedule reading a plan (``makes``, see the module's
    docstring); ``None`` where it would make a value before the first hooked stage or make
    an op the runtime may not run again, where the plan runs forward in another order than
    the graph's (:attr:`PlanMakes.in_order`), or where the reading peaks above the plan's
    simulated peak in the solver's memory model (a start the plan does not vouch for: a random
    graph of views of one input with extras peaked 226 bytes where its plan peaks at 220).
    ``with_extra``: the ops whose extra may be made
    again (:func:`passes.checkmate.remakeable_extras`, or none where the solve holds every extra)."""
    if not makes.in_order:
        return None
    T, first, names, home = training.size, training.n_forward, training.names, training.home
    at = {name: i for i, name in enumerate(names)}
    hooks = hooked_stages(graph, training)
    pure = pure_ops(graph)
    R = [[int(t == i and home[i] == i) for i in range(T)] for t in range(T)]  # each node at home, extras aside
    available: set[int] = set()
    for i in range(first):
        if home[i] == i and (training.kept[i] or names[i] in makes.values or not training.mem[training.root[i]]):
            available.add(i)
        elif home[i] != i and training.about[i] in makes.extras:
            R[home[i]][i] = 1
            available.add(i)
    hook_before = [max((h for h in hooks if h <= t), default=None) for t in range(T)]
    planned: dict[int, list[int]] = {}
    for node, before in makes.made:
        backward = at.get(backward_stage(before))
        stage = None if backward is None else hook_before[backward]
        if node in at and stage is not None:  # else made where backward first reads it, below
            planned.setdefault(stage, []).append(at[node])

    def make(i: int, t: int) -> bool:
        """Make node ``i`` again at stage ``t``, with what it reads and is not held."""
        op = home[i]
        if names[op] not in (pure if op == i else with_extra):
            return False
        needed = [p for p in training.preds[op] if p not in available] + list(training.fresh[op])
        if not all(make(p, t) for p in needed):
            return False
        R[t][op] = R[t][i] = 1
        available.update((op, i))
        return True

    for t in range(first, T):
        if not all(make(i, t) for i in sorted(planned.get(t, ()))):
            return None
        for i in training.preds[t]:
            if i < first and i not in available and (hook_before[t] is None or not make(i, hook_before[t])):
                return None
    _drop_unread(training, R)
    read = tuple(tuple(row) for row in R), held_between_reads(training, R)
    return read if max(stage_peaks(training, *read), default=0) <= makes.peak_bytes else None


def _drop_unread(training: TrainingGraph, R: list[list[int]]) -> None:
    """Take out of ``R`` each value made again that nothing reads before it is made once
    more (a checkpoint remakes its whole segment; the solver's rows admit no make unread),
    and what only those read, until none is left."""
    T, first, readers = training.size, training.n_forward, training.readers()
    dropped = True
    while dropped:
        dropped = False
        for t in range(first, T):
            for i in range(first):
                if not R[t][i]:
                    continue
                later = next((m for m in range(t + 1, T) if R[m][i]), T)
                read = any(R[r][k] for k in readers[i] for r in range(t, later))
                extra = training.extra_node(i)
                if not read and not (extra is not None and R[t][extra]):
                    R[t][i] = 0
                    dropped = True


def start_columns(model: Milp, R: Matrix, S: Matrix) -> dict[int, float] | None:
    """The ``R`` and ``S`` columns of ``model`` at a schedule's values, for
    :func:`passes.guided_solve.guided_solve` to solve the rest (its ``F`` and ``U``) from;
    ``None`` where the schedule sets a variable ``model`` has not, or out of its bounds
    (a value made again where the runtime cannot make it)."""
    fixed: dict[int, float] = {}
    for name, matrix in (("R", R), ("S", S)):
        for t, row in enumerate(matrix):
            for i, value in enumerate(row):
                column = model.columns.get((name, t, i))
                if column is None:
                    if value:
                        return None
                    continue
                lower, upper, _ = model.bounds[column]
                if not lower <= value <= upper:
                    return None
                fixed[column] = float(value)
    return fixed
