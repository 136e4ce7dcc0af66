"""An exact recompute schedule as a plan can run it: which values forward keeps, and what
backward makes again and lets go just before each op's backward.

The exact solver (:mod:`passes.checkmate`) answers with matrices: ``R[t][i]``, op ``i``
runs in stage ``t``; ``S[t][i]``, value ``i`` is held entering stage ``t``. A
:class:`Schedule` is that answer read as a program for the runtime
(:class:`graphckpt.exact.ScheduledModule`): forward runs the graph as eager code and keeps
``kept``; backward runs each :class:`ScheduleStep` just before autograd runs the backward of its
``op`` (a hook on that op's ``grad_fn``), and every saved tensor autograd unpacks is taken
from what the steps hold. Only schedules whose work falls where such a hook fires are
solved for (:func:`passes.checkmate.checkmate_schedule` with ``executable=True``): no
recompute in forward, none between the gradient buffers one backward node makes, and
only pure ops made again.

Example: a chain ``a -> b -> c -> d`` keeping ``b`` makes ``c`` again just before the
backward of ``d`` (which saved ``c``) and lets ``c`` go before the backward of ``b``::

    Schedule(kept=("b",), steps=(ScheduleStep("d", release=(), make=("c",), free=((),)),
                                 ScheduleStep("b", release=("c",), make=(), free=())), ...)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from passes.graph_facts import graph_outputs, needs_grad, per_graph_value, pure_ops

Matrix = tuple[tuple[int, ...], ...]
"""A schedule's ``R`` or ``S``: row ``t`` a stage, column ``i`` a node of the training graph."""


@dataclass(frozen=True)
class ScheduleStep:
    """Work just before the backward of ``op``: let ``release`` go (held until now, needed
    no more), then make each of ``make`` again in order, without gradients, from what is
    held, letting ``free[i]`` go right after ``make[i]`` is made."""

    op: str
    release: tuple[str, ...]
    make: tuple[str, ...]
    free: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Schedule:
    """A plan's exact schedule (see the module's docstring). ``peak_bytes`` is its peak in
    the simulator's memory model (:func:`passes.training_graph.stage_peaks`), ``optimal``
    whether the solver proved no schedule of its kind under the same budget recomputes less.
    ``storages`` names, for each value whose storage an op made, that op's value (its storage
    root: itself, or what a view or tuple element is of): saved tensors are taken from there."""

    kept: tuple[str, ...]
    steps: tuple[ScheduleStep, ...]
    peak_bytes: int
    optimal: bool = False
    storages: tuple[tuple[str, str], ...] = ()  # (value, the value whose storage it is), for values of op storages
    stages: tuple[Matrix, Matrix] = field(default=((), ()), compare=False, repr=False)  # R and S as run:
    # what each stage computes and holds (passes.training_graph), from which its peak and breakdown come

    @property
    def made(self) -> tuple[str, ...]:
        """Every value backward makes again, once per time it is made."""
        return tuple(name for step in self.steps for name in step.make)


def plan_schedule(segments: Iterable[Any]) -> Schedule | None:
    """The exact schedule a plan's segments run (``Segment.schedule``), or ``None``: the one
    question every stage that treats such a plan apart asks."""
    return next((s.schedule for s in segments if s.schedule is not None), None)


@per_graph_value
def hooked_ops(graph: nx.DiGraph) -> frozenset[str]:
    """The ops before whose backward a step can run: those a gradient reaches
    (:func:`reached_by_gradients`) whose value is one tensor with a ``grad_fn`` of its own,
    where the runtime hooks. Not an op returning several tensors (its value is a tuple;
    ``shape`` lists one shape per tensor), nor an element taken from one (its ``grad_fn`` is
    the tuple op's, shared with its siblings)."""
    several = {name for name, shape in graph.nodes(data="shape") if "], [" in (shape or "")}
    return frozenset(name for name in reached_by_gradients(graph) if name not in several
                     and several.isdisjoint(graph.predecessors(name)))


@per_graph_value
def reached_by_gradients(graph: nx.DiGraph) -> frozenset[str]:
    """The ops whose ``grad_fn`` backward runs: those with a path of ops needing a gradient
    to what backward starts from (the model's own ``loss``, else every output needing one).
    An op whose value nothing reads on the way to the loss never has its backward run, so a
    step placed before it would never run (found by the random-model property test: a
    Linear called once more for nothing)."""
    loss = graph.graph.get("loss")
    starts = [loss] if loss is not None else [v for v in graph_outputs(graph) if needs_grad(graph, v)]
    reached, stack = set(), [v for v in starts if graph.nodes[v]["kind"] == "op"]
    while stack:
        name = stack.pop()
        if name in reached or not needs_grad(graph, name):
            continue
        reached.add(name)
        stack.extend(u for u in graph.predecessors(name) if graph.nodes[u]["kind"] == "op")
    return frozenset(reached)


class ScheduleError(ValueError):
    """A schedule that cannot run on its graph: what is wrong, and at which op."""


def check_schedule(graph: nx.DiGraph, schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every value a step makes is a pure op's
    (:func:`passes.graph_facts.pure_ops`) made from values held at that point, inputs or
    parameters, and nothing is let go that is not held."""
    pure = pure_ops(graph)
    held = set(schedule.kept)
    free_anytime = {n for n, kind in graph.nodes(data="kind") if kind in ("input", "param")}
    for step in schedule.steps:
        _let_go(held, step.release, step.op)
        for name, after in zip(step.make, step.free, strict=True):
            if name not in pure:
                raise ScheduleError(f"before the backward of {step.op!r}: {name!r} is made again but is not a "
                                    "pure op (state, random draw or in-place write)")
            missing = [u for u in graph.predecessors(name) if u not in held and u not in free_anytime]
            if missing:
                raise ScheduleError(f"before the backward of {step.op!r}: {name!r} is made from {missing}, "
                                    "which nothing holds there")
            held.add(name)
            _let_go(held, after, step.op)


def _let_go(held: set[str], names: tuple[str, ...], op: str) -> None:
    for name in names:
        if name not in held:
            raise ScheduleError(f"before the backward of {op!r}: {name!r} is let go but not held")
        held.discard(name)


def describe(schedule: Schedule) -> list[str]:
    """One line per step that makes something again, as ``print(plan)`` shows them."""
    return [f"before the backward of {step.op}: makes {', '.join(step.make)} again"
            for step in schedule.steps if step.make]
