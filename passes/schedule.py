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

An op's *extra* (what it saves for backward that is no value of the graph: max-pool's
indices) is left to autograd from forward unless the op is in ``dropped_extras``: then
forward swaps it for a handle and backward takes it from what the steps hold, under
:func:`extra_key` (``"extra:<op>"``), as for a value; a step makes it again by running its op
(in ``ScheduleStep.extras``) with autograd on, keeping what the op saves.

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
    held, letting ``free[i]`` go right after ``make[i]`` is made. An op of ``make`` also in
    ``extras`` runs with autograd on instead, and its extra is held too (:func:`extra_key`;
    ``release`` and ``free`` let it go by that name)."""

    op: str
    release: tuple[str, ...]
    make: tuple[str, ...]
    free: tuple[tuple[str, ...], ...]
    extras: tuple[str, ...] = ()  # ops of make whose extra is made with them


@dataclass(frozen=True)
class Schedule:
    """A plan's exact schedule (see the module's docstring). ``peak_bytes`` is its peak in
    the simulator's memory model (:func:`passes.training_graph.stage_peaks`), ``optimal``
    whether the solver proved no schedule of its kind under the same budget recomputes less.
    ``storages`` names, for each value whose storage an op made, that op's value (its storage
    root: itself, or what a view or tuple element is of): saved tensors are taken from there.
    ``dropped_extras``: the ops whose extra forward does not leave to autograd (each made
    again by a step, or held from forward by the schedule: ``kept_extras``, until let go)."""

    kept: tuple[str, ...]
    steps: tuple[ScheduleStep, ...]
    peak_bytes: int
    optimal: bool = False
    storages: tuple[tuple[str, str], ...] = ()  # (value, the value whose storage it is), for values of op storages
    dropped_extras: tuple[str, ...] = ()  # ops whose extra backward takes from what the steps hold
    kept_extras: tuple[str, ...] = ()  # of those, the ops whose extra forward holds (let go later, made again)
    grad_reads: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (op of dropped_extras, the values it reads that
    # need a gradient): a step running it for its extra reads them requiring grad, so it saves what forward saved
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


def extra_key(op: str) -> str:
    """The name under which a schedule holds ``op``'s extra (the training graph's node of it)."""
    return f"extra:{op}"


def check_schedule(graph: nx.DiGraph, schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every value a step makes is a pure op's
    (:func:`passes.graph_facts.pure_ops`) made from values held at that point, inputs or
    parameters, every extra is a pure op's made only with it (:func:`_check_extras`), and
    nothing is let go that is not held."""
    pure = pure_ops(graph)
    _check_extras(schedule, pure)
    held = {*schedule.kept, *map(extra_key, schedule.kept_extras)}
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
            held.update((name, extra_key(name)) if name in step.extras else (name,))
            _let_go(held, after, step.op)


def _check_extras(schedule: Schedule, pure: frozenset[str]) -> None:
    """Raise :class:`ScheduleError` unless each dropped extra is a pure op's, held from
    forward or made by a step, and each step makes an extra only with its op and only of
    an op whose extra forward drops (else autograd holds forward's, and the copy is waste)."""
    dropped = set(schedule.dropped_extras)
    made = {op for step in schedule.steps for op in step.extras}
    for op in dropped:
        if op not in pure:
            raise ScheduleError(f"the extra of {op!r} is dropped in forward but {op!r} is not a pure op: only "
                                "a pure op's extra can be made again (plan with executable=True)")
        if op not in made and op not in schedule.kept_extras:
            raise ScheduleError(f"the extra of {op!r} is dropped in forward, but no step makes it again and "
                                "forward does not hold it: its backward would find it nowhere")
    if not set(schedule.kept_extras) <= dropped:
        raise ScheduleError(f"kept_extras {sorted(set(schedule.kept_extras) - dropped)} are not in dropped_extras: "
                            "an extra forward holds is one autograd does not")
    for step in schedule.steps:
        for op in step.extras:
            if op not in step.make or op not in dropped:
                raise ScheduleError(f"before the backward of {step.op!r}: the extra of {op!r} is made again, "
                                    + ("but not its op (an extra is made only by running its op)" if op not in step.make
                                       else "but forward leaves it to autograd (add it to dropped_extras)"))


def _let_go(held: set[str], names: tuple[str, ...], op: str) -> None:
    for name in names:
        if name not in held:
            raise ScheduleError(f"before the backward of {op!r}: {name!r} is let go but not held")
        held.discard(name)


def describe(schedule: Schedule) -> list[str]:
    """One line per step that makes something again, as ``print(plan)`` shows them (and
    which of those it runs with autograd on, for the extra each saves)."""
    return [f"before the backward of {step.op}: makes {', '.join(step.make)} again"
            + (f"; runs {', '.join(step.extras)} with autograd on for the extra each saves" if step.extras else "")
            for step in schedule.steps if step.make]
