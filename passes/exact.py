"""Plans that run the exact solver's schedule: the least recompute any schedule of its
kind reaches under a budget, on graphs small enough to solve.

Segments over prefix cuts, kept values and remakes (every other strategy) cannot say
everything the optimum does: it holds a value through part of backward, lets it go and
makes it again later, or makes a value from a mix of kept and remade ones, one op's
backward at a time. :func:`exact_plan` asks the MILP (:mod:`passes.checkmate`) for the
cheapest schedule the runtime can run (``executable=True``: work only just before an op's
backward, pure ops only, and an op's extra, max-pool's indices, only with its op) and reads
it as a :class:`passes.schedule.Schedule`, carried by one recomputed segment over the whole
graph (``Segment.schedule``), which codegen runs as a :class:`graphckpt.exact.ScheduledModule`.

On the 16-op random DAGs of ``scripts/planner_gap.py`` at 0.5 and 0.7 of eager these
schedules recompute exactly what the unrestricted MILP's do, in 0.1-3 s; on 40 ops HiGHS
often stops at its time limit, and then the schedule is the best it found, polished window by
window in the last part of that time (:func:`passes.polish.polish`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import networkx as nx

from passes.checkmate import CheckmateResult, checkmate_schedule, remakeable_extras
from passes.floor import Floor, least_peak_schedule, true_floor
from passes.graph_facts import needs_grad, op_nodes, storage_root
from passes.highs import at_once, lanes
from passes.plan import Plan, plan_of_segments
from passes.plan_start import plan_makes, start_schedule
from passes.schedule import Schedule, ScheduleStep, check_schedule, plan_schedule
from passes.segments import Segment, segment_edges
from passes.training_backward import BACKWARD_PREFIX
from passes.training_graph import Matrix, TrainingGraph, hooked_stages, stage_peaks, training_graph

EXACT_MAX_OPS = 40  # larger graphs: HiGHS rarely finds a schedule in seconds
EXACT_TIME_LIMIT = 5.0  # seconds a budget plan may spend in the solver


def exact_plan(graph: nx.DiGraph, budget_bytes: float, time_limit: float = EXACT_TIME_LIMIT,
               beat: float | None = None, start: Sequence[Segment] = ()) -> Plan | None:
    """The plan running the cheapest executable schedule under ``budget_bytes`` found in
    ``time_limit`` seconds (on one CPU up to 28% more: :data:`passes.guided_solve.FREED_AT`; and up to
    ``time_limit`` more while its polish still betters the schedule:
    :data:`passes.polish.POLISH_OVERTIME`); ``None``
    when ``time_limit`` is 0 (the user asked for no such schedule:
    ``graphckpt.rewrite(..., exact=False)``), above :data:`EXACT_MAX_OPS` ops, on a graph
    whose runtime has no hooks (``hooks``), when no schedule fits or none is found in time.
    With ``beat`` (a plan in hand's recompute), also ``None`` when no schedule recomputes
    less: the solver, told so, prunes what cannot beat it and proves that in a fraction of
    the full solve's time. ``start``: that plan's segments, read as a schedule the search
    starts from (:mod:`passes.plan_start`)."""
    if not exact_solvable(graph, time_limit):
        return None
    result, optimal = _cheapest_schedule(graph, budget_bytes, time_limit, beat, start)
    if result is None:
        return None
    training = training_graph(graph)
    schedule = schedule_of(graph, training, result.R, result.S, optimal=optimal)
    if schedule.peak_bytes > budget_bytes:  # what it lets go where no hook fires held too long
        return None
    return _schedule_plan(graph, schedule, "the least recompute")


def floor_plan(graph: nx.DiGraph, time_limit: float = EXACT_TIME_LIMIT, below: float | None = None) -> Plan | None:
    """The plan running the executable schedule of least peak found in ``time_limit``
    seconds (of those, the one recomputing least): the floor of graphckpt's plans where the
    other strategies' plans stop above it, which a refused budget names; ``None`` where
    :func:`exact_plan` makes none (``time_limit`` 0, a graph too large or without hooks) or
    the solve found none in time (with ``below``, the peak of a plan in hand: none peaking
    less, :func:`passes.floor.least_peak_schedule`). Its peak is the schedule's as the
    runtime runs it, at or above the solver's."""
    if not exact_solvable(graph, time_limit):
        return None
    found = least_peak_schedule(graph, time_limit, executable=True, below=below)
    if found is None or found.R is None or found.S is None:
        return None
    schedule = schedule_of(graph, training_graph(graph), found.R, found.S, optimal=found.floor.proven)
    return _schedule_plan(graph, schedule, "the least peak")


def floors_below(graph: nx.DiGraph, time_limit: float, below: float) -> tuple[Plan | None, Floor | None]:
    """What a refused budget names, looking below ``below`` (the least peak of the plans in
    hand): the plan of least peak :func:`floor_plan` finds in ``time_limit`` seconds, and the
    true floor of every schedule (:func:`passes.floor.true_floor`), which is at most that
    plan's peak. The two solves run at once where the machine has two CPUs
    (:func:`passes.highs.lanes`: a refusal of the zoo DenseNet at 0.5 of eager spent 5 s in
    each, one after the other); on one, the true floor looks only below the plan found."""
    if lanes() < 2:
        lowest = floor_plan(graph, time_limit, below=below)
        return lowest, true_floor(graph, below=below if lowest is None else min(below, lowest.peak_bytes))
    lowest, floor = at_once(lambda: floor_plan(graph, time_limit, below=below), lambda: true_floor(graph, below=below))
    if floor is not None and lowest is not None:
        floor = floor.below(lowest.peak_bytes)
    return lowest, floor


def exact_solvable(graph: nx.DiGraph, time_limit: float) -> bool:
    """Whether exact schedules are sought for ``graph``: time given (``exact=False`` gives
    none), at most :data:`EXACT_MAX_OPS` ops, and a runtime with hooks (``hooks``)."""
    return time_limit > 0 and len(op_nodes(graph)) <= EXACT_MAX_OPS and bool(graph.graph.get("hooks", True))


def _schedule_plan(graph: nx.DiGraph, schedule: Schedule, aim: str) -> Plan:
    """``schedule`` as a plan: one recomputed segment it runs, its peak the schedule's."""
    return plan_of_segments(graph, "exact", [scheduled_segment(graph, schedule)], notes=(_note(schedule, aim),),
                            peak_bytes=schedule.peak_bytes)


MIN_EXTRAS_SECONDS = 0.5  # the least time left worth a second solve that may make extras again


def _cheapest_schedule(graph: nx.DiGraph, budget_bytes: float, time_limit: float, beat: float | None,
                       plan: Sequence[Segment] = ()) -> tuple[CheckmateResult | None, bool]:
    """The cheapest executable schedule found in ``time_limit`` seconds, and whether it is
    proven cheapest: first among those holding every extra from forward, then, in the time
    left, among those that may make one again (told to beat the first). The wider search is
    the harder one: asked first, it left DenseNet at its tightest budget (0.54 of eager)
    with a plan recomputing 1.65x the optimum, which the narrower one finds in the 5 s.
    Each search starts from ``plan`` (the plan in hand's segments) where it reads as a
    schedule of its kind (:func:`passes.plan_start.start_schedule`)."""
    started = time.perf_counter()
    remakeable = remakeable_extras(graph)
    wider = bool(remakeable)
    training = training_graph(graph)
    makes = plan_makes(graph, plan) if plan and plan_schedule(plan) is None else None

    def start(with_extra: frozenset[str]) -> tuple[Matrix, Matrix] | None:
        return None if makes is None else start_schedule(graph, training, makes, with_extra)

    try:  # where a wider search follows, a first that beats nothing leaves it the time rather than polish
        held = checkmate_schedule(graph, budget_bytes, time_limit=time_limit, executable=True, beat=beat,
                                  extras=False, polish_start=not wider, start=start(frozenset()))
    except TimeoutError:
        held = None
    left = time_limit - (time.perf_counter() - started)
    if left < MIN_EXTRAS_SECONDS or not wider:
        return held, held is not None and held.status == "optimal"
    cheaper = min((c for c in (beat, held and held.recompute_flops) if c is not None), default=None)
    try:
        made = checkmate_schedule(graph, budget_bytes, time_limit=left, executable=True, beat=cheaper,
                                  start=start(remakeable))
    except TimeoutError:  # none better found in time: the first stands, not proven among the wider kind
        return held, False
    if made is None:  # none better, proven
        return held, held is not None and held.status == "optimal"
    return made, made.status == "optimal"


def scheduled_segment(graph: nx.DiGraph, schedule: Schedule) -> Segment:
    """One recomputed segment over every op, run by ``schedule``."""
    nodes = tuple(op_nodes(graph))
    inputs, outputs = segment_edges(graph, nodes)
    return Segment(nodes, True, inputs, outputs, saved_inside=schedule.kept, schedule=schedule)


def schedule_of(graph: nx.DiGraph, training: TrainingGraph, R: Matrix, S: Matrix, optimal: bool = False) -> Schedule:
    """The :class:`Schedule` of an executable MILP solution (``R``, ``S``), checked
    (:func:`passes.schedule.check_schedule`). Its peak is the solution's as the runtime runs
    it: values held in forward past their last use let go there, as eager code does, and
    what the solution lets go where no hook fires let go at the next hook. An extra
    the solution makes again or does not hold into backward is the runtime's to hold, as a
    value (:func:`_dropped_extras`); every other extra autograd holds, as ``S`` does."""
    S = _eager_in_forward(training, S)
    values = set(op_nodes(graph))
    names, first = training.names, training.n_forward
    value_ids = [i for i in range(first) if names[i] in values]
    extra_ids = _dropped_extras(training, R, S)
    hooks, readers = hooked_stages(graph, training), training.readers()
    steps, held = [], {i for i in (*value_ids, *extra_ids) if S[first][i]}
    kept = tuple(names[i] for i in sorted(held) if i in value_ids)
    entering: dict[int, set[int]] = {}  # values the runtime holds entering each stage past forward
    for t in range(first, training.size):
        if t not in hooks:  # nothing runs here (pinned): what it lets go, the next step lets go
            entering[t] = set(held)
            continue
        step, entering[t] = _step(training, R, S, t, value_ids, held, readers)
        if step is not None:
            steps.append(step)
    held_values = {*value_ids, *extra_ids}
    executed = tuple(S[t] if t < first else tuple(int(i in entering[t]) if i in held_values else S[t][i]
                                                  for i in range(training.size)) for t in range(training.size))
    storages = tuple((name, root) for name in op_nodes(graph) for root in (storage_root(graph, name),) if root in values)
    about = training.about
    schedule = Schedule(kept, tuple(steps), int(max(stage_peaks(training, R, executed), default=0)), optimal, storages,
                        dropped_extras=tuple(about[e] for e in extra_ids),
                        kept_extras=tuple(about[e] for e in extra_ids if S[first][e]),
                        grad_reads=tuple((about[e], tuple(u for u in graph.predecessors(about[e]) if needs_grad(graph, u)))
                                         for e in extra_ids), stages=(R, executed))
    check_schedule(graph, schedule)
    return schedule


def _dropped_extras(training: TrainingGraph, R: Matrix, S: Matrix) -> list[int]:
    """The extras of a solution that forward does not leave to autograd: those backward
    makes again (autograd's copy could not be let go early) and those not held into
    backward (only an op whose backward never runs leaves its extra unread)."""
    first = training.n_forward
    return [e for e in range(first) if training.role(e) == "extra"
            and (not S[first][e] or any(R[t][e] for t in range(first, training.size)))]


def _step(training: TrainingGraph, R: Matrix, S: Matrix, t: int, value_ids: list[int], held: set[int],
          readers: list[list[int]]) -> tuple[ScheduleStep | None, set[int]]:
    """The step before stage ``t``'s backward (``None`` when it does nothing), updating
    ``held``, what the runtime holds, as the step runs; and what it holds once it has let go
    what ``S`` holds no more, which the stage starts from. A value made again is let go right
    after the last one made from it unless backward reads it here or ``S`` holds it on; so
    is an extra made with its op (which nothing made after it reads)."""
    names, home = training.names, training.home
    made = [i for i in value_ids if R[t][i] and i != t]
    extras = {home[e]: e for e in range(training.n_forward) if R[t][e] and home[e] != e}  # op -> its extra
    release = sorted(i for i in held if not S[t][i])
    held -= set(release)
    entering = set(held)
    if not made and not release:
        return None, entering
    free = []
    for position, k in enumerate(made):
        made_here = (k, extras[k]) if k in extras else (k,)
        held.update(made_here)
        later = {*made[position + 1:], t}
        gone = [i for i in (*training.preds[k], *made_here) if i in held and not (t + 1 < training.size and S[t + 1][i])
                and not any(j in later for j in readers[i])]
        held -= set(gone)
        free.append(tuple(names[i] for i in gone))
    return ScheduleStep(names[t].removeprefix(BACKWARD_PREFIX), tuple(names[i] for i in release),
                        tuple(names[i] for i in made), tuple(free),
                        extras=tuple(names[k] for k in made if k in extras)), entering


def _eager_in_forward(training: TrainingGraph, S: Matrix) -> Matrix:
    """``S`` with each value not held into backward let go in forward after its last
    reader's stage, as eager code lets it go (the solver may hold it longer where memory
    is to spare)."""
    first, readers = training.n_forward, training.readers()
    rows = [list(row) for row in S]
    for i in range(first):
        if S[first][i]:
            continue
        last = max((j for j in readers[i] if j < first), default=i)
        for t in range(last + 1, first):
            rows[t][i] = 0
    return tuple(tuple(row) for row in rows)


def _note(schedule: Schedule, aim: str) -> str:
    made = schedule.made
    proof = "proven optimal among them" if schedule.optimal else "the best the solver found in its time"
    return (f"exact: the solver's schedule of {aim} ({proof}): keeps {len(schedule.kept)} values from forward and "
            f"makes {len(made)} again in {sum(1 for s in schedule.steps if s.make)} backward steps"
            + (f", {extras} of them with the extra their op saves" if (extras := sum(len(s.extras) for s in schedule.steps))
               else ""))
