"""The ``optimal`` pass: least recompute whose simulated peak fits a memory budget.

A dynamic program over a chain of stages (:mod:`passes.chain`), in the spirit of Chen et
al.'s recursive checkpointing and of Rotor's DP for heterogeneous chains: its table (the
least recompute of every range of stages at each amount of free memory, solved as far as
a plan asks) is :mod:`passes.dp_table`; this module chooses the memory unit, turns the
table's choices into nested, selective and kept segments, and finds the plan whose
*simulated* peak fits a budget (:func:`plan_for_budget`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import networkx as nx
import numpy as np

from passes.chain import Chain, build_chain
from passes.dp_table import KEPT, RECOMPUTED, SELECTIVE, SLOTS, Table, slots
from passes.plan import Plan, Progress, plan_of_segments
from passes.segments import Segment, make_segments, merge_kept, nested
from passes.simulate import eager_peak


def memory_span(chain: Chain, eager_peak_bytes: float) -> float:
    """Bytes the slots must span: eager's peak, or the program's own estimate of eager when
    that is higher, so storing everything is always one of its answers."""
    everything = chain.stored(0, chain.stages) + max(chain.working(0, chain.stages), chain.finish)
    return max(eager_peak_bytes, everything, 1)


def memory_unit(chain: Chain, eager_peak_bytes: float, slot_count: int, common_bytes: int = 0) -> float:
    """Bytes per slot: about ``slot_count`` slots over :func:`memory_span`, shrunk (to at
    most twice as many) so a value of ``common_bytes`` fills a whole number of slots.

    Slots round every value up: a chain of 4 MiB activations in 1.7 MiB slots would pay
    for 5.1 MiB each and the program would keep fewer of them than fit; in 1.33 MiB slots
    each takes exactly three.
    """
    unit = memory_span(chain, eager_peak_bytes) / slot_count
    if common_bytes > unit:
        unit = common_bytes / math.ceil(common_bytes / unit)
    return unit


def children(table: Table, i: int, j: int, m: int, top: bool = False) -> list[tuple[int, int, int, list]]:
    """The children the table chose for ``[i, j)`` with ``m`` free slots, as
    ``(kind, start, end, grandchildren)``; ``top`` for the whole forward's entry."""
    chain, unit = table.chain, table.unit
    how = int(table.top_choice[i, m] if top else table.choice[i, j, m])
    if how < 0:
        return [(KEPT, i, j, [])]
    k, kind = divmod(how, 3)
    boundary = slots(chain.boundaries[k - 1], unit)
    if k == j:  # the end of the forward as one recomputed or selective child (only at the top)
        return [(kind, i, j, children(table, i, j, m - boundary) if kind == RECOMPUTED else [])]
    if kind == KEPT:
        return [(KEPT, i, k, []), *children(table, k, j, m - slots(chain.stored(i, k), unit), top)]
    if kind == RECOMPUTED:
        inner = m - boundary + min(boundary, 0 if top else int(table.freed(np.array([j]))[0]))  # as the table read it
        return [(RECOMPUTED, i, k, children(table, i, k, inner)), *children(table, k, j, m - boundary, top)]
    rest = m - boundary - slots(chain.expensive_bytes(i, k), unit)
    return [(SELECTIVE, i, k, []), *children(table, k, j, rest, top)]


def segments_of(graph: nx.DiGraph, chain: Chain, chosen: list) -> list[Segment]:
    """Plan segments for chosen children: kept ones plain, recomputed ones nested."""
    segments: list[Segment] = []
    for kind, i, k, inner in chosen:
        nodes = chain.nodes(i, k)
        if kind == KEPT:
            segments.extend(make_segments(graph, [(nodes, False)]))
        elif kind == SELECTIVE:
            expensive = tuple(n for n in nodes if graph.nodes[n]["expensive"])
            segments.extend(_keeping(s, expensive) if s.recompute else s for s in make_segments(graph, [(nodes, True)]))
        elif len(inner) == 1:
            segments.extend(make_segments(graph, [(nodes, True)]))
        else:
            segments.append(nested(graph, segments_of(graph, chain, inner)))
    return segments


def _keeping(segment: Segment, expensive: tuple[str, ...]) -> Segment:
    """``segment`` keeping those of ``expensive`` it runs (tested against a set of its
    nodes: scanning its node tuple per value made selective stages n^2)."""
    inside = set(segment.nodes)
    return replace(segment, saved_inside=tuple(n for n in expensive if n in inside))


def common_value_bytes(graph: nx.DiGraph) -> int:
    """The size of value that makes up the most activation bytes (0 for none): what the
    memory unit should divide evenly."""
    by_size = Counter(b for _, b in graph.nodes(data="bytes") if b)
    return max(by_size, key=lambda size: (size * by_size[size], size), default=0)


class DynamicProgram:
    """The solved table of one cost graph, turned into plans for any amount of memory.

    ``slot_count`` is a resolution: the table has between that many and twice as many
    slots (:func:`memory_unit`), ``self.slot_count`` of them. ``within_bytes``: the memory
    the caller will ask plans for (a budget); the table is solved up to it first and grown
    only as far as plans are asked beyond it (:meth:`Table.extend`), instead of up to all
    of eager's memory. ``tight``: the table's accounting (:class:`passes.dp_table.Table`);
    ``chain``: the graph's chain when built already."""

    def __init__(self, graph: nx.DiGraph, max_stages: int = 64, slot_count: int = SLOTS,
                 progress: Progress | None = None, within_bytes: float | None = None, tight: bool = True,
                 chain: Chain | None = None) -> None:
        self.graph = graph
        self.chain = build_chain(graph, max_stages) if chain is None else chain
        unit = memory_unit(self.chain, eager_peak(graph), slot_count, common_value_bytes(graph))
        self.slot_count = slots(memory_span(self.chain, eager_peak(graph)), unit)
        self.table = Table(self.chain, unit, self.slot_count, selective=True, tight=tight)
        self._progress = progress
        self.table.extend(self.slot_count if within_bytes is None else slots(within_bytes, unit), progress)
        self._plans: dict[int, Plan] = {}

    def _solved_to(self, m: int) -> None:
        """The table solved up to ``m`` at least, grown by a quarter at a time so a walk
        up the slots does not re-enter the solver at every step."""
        if m >= self.table.solved:
            self.table.extend(max(m, self.table.solved + self.table.solved // 4), self._progress)

    def feasible(self, m: int) -> bool:
        self._solved_to(m)
        return bool(np.isfinite(self.table.top[0, m]))

    def lowest_feasible(self) -> int | None:
        """The fewest free slots any plan of the program runs in (``None``: none does)."""
        return next((m for m in range(self.slot_count + 1) if self.feasible(m)), None)

    def plan(self, m: int) -> Plan:
        """The program's plan with ``m`` free slots for the whole forward (memoised)."""
        if m not in self._plans:
            self._solved_to(m)
            chosen = children(self.table, 0, self.chain.stages, m, top=True)
            top = merge_kept(self.graph, segments_of(self.graph, self.chain, chosen))
            same = next((p for p in self._plans.values() if p.segments == top), None)  # more memory, same plan
            self._plans[m] = same or plan_of_segments(self.graph, "optimal", top)
        return self._plans[m]

    def plans(self) -> list[Plan]:
        """Every plan built so far (by :meth:`plan`), distinct."""
        return list({id(p): p for p in self._plans.values()}.values())

    def smallest(self) -> Plan:
        """The plan of least memory the program can build."""
        lowest = self.lowest_feasible()
        if lowest is None:  # memory_span makes storing everything an answer: this is a bug, not a budget
            raise RuntimeError("the dynamic program has no plan even with all of eager's memory")
        return self.plan(lowest)


HELD_TOO_UP_TO = 400  # ops; larger graphs ask the tight program alone


class DynamicPrograms:
    """The graph's program under both accountings of a table (:class:`passes.dp_table.Table`'s
    ``tight`` or not), as one: the budget search's plans come from both. The tight one
    reaches lower memory and recomputes less on chains (the zoo MLP at 0.3 of eager: the
    12 matmuls of the exact solver's best known schedule, where the other has no plan, its
    floor a third of eager); the other's plans, estimated more
    conservatively, are at times the better start for the keeps and searches after it (the
    zoo U-Net at 0.7 of eager, GPT at 0.3). On graphs over :data:`HELD_TOO_UP_TO` ops only
    the tight one runs: its walk to a budget costs 0.3 s of simulations on 500-op DAGs, and
    there, as on Hugging Face GPT-2 and LLaMA (about 700 ops), the two gave the same plans."""

    def __init__(self, graph: nx.DiGraph, progress: Progress | None = None, within_bytes: float | None = None) -> None:
        self.tight = DynamicProgram(graph, progress=progress, within_bytes=within_bytes)
        self.held = (DynamicProgram(graph, progress=progress, within_bytes=within_bytes, tight=False,
                                    chain=self.tight.chain)
                     if len(self.tight.chain.ops) <= HELD_TOO_UP_TO else None)
        self.programs = (self.tight,) if self.held is None else (self.held, self.tight)
        self._walks: dict[float, dict[DynamicProgram, Plan | None]] = {}

    def plans(self) -> list[Plan]:
        """Every plan either program built, distinct."""
        return list({plan.segments: plan for program in self.programs for plan in program.plans()}.values())

    def smallest(self) -> Plan:
        """The plan of least memory either program builds."""
        return min((program.smallest() for program in self.programs), key=lambda p: (p.peak_bytes, p.cost_key))

    def _walked(self, budget_bytes: float) -> dict[DynamicProgram, Plan | None]:
        """:func:`plan_for_budget` of each program, walked once per budget (its walk simulates)."""
        if budget_bytes not in self._walks:
            self._walks[budget_bytes] = {program: plan_for_budget(program, budget_bytes) for program in self.programs}
        return self._walks[budget_bytes]

    def plan_for_budget(self, budget_bytes: float) -> Plan | None:
        """The least recompute of :func:`plan_for_budget` over both programs."""
        found = [plan for plan in self._walked(budget_bytes).values() if plan is not None]
        return min(found, key=lambda plan: (plan.cost_key, plan.peak_bytes), default=None)

    def only_tight_fits(self, budget_bytes: float) -> bool:
        """Whether ``budget_bytes`` is below the floor of the program that is not tight
        and above the tight one's: there the tight program's plans nest deep and rerun
        much, and a search toward the floor from other plans may do better."""
        walked = self._walked(budget_bytes)
        return self.held is not None and walked[self.held] is None and walked[self.tight] is not None


def plan_for_budget(program: DynamicProgram, budget_bytes: float, tries: int = 8) -> Plan | None:
    """The program's plan with the most free memory whose *simulated* peak fits the budget
    (so the least recompute), or ``None`` when none fits within ``tries`` simulations.

    The program's own estimate puts the plan with ``budget / unit`` free slots near the
    budget; each simulation then moves the free memory by what the estimate missed.
    """
    unit, top = program.table.unit, program.slot_count
    lowest = program.lowest_feasible()
    if lowest is None:
        return None
    m = max(lowest, min(top, math.floor(budget_bytes / unit)))
    best: Plan | None = None
    tried: set[int] = set()
    while m not in tried and len(tried) < tries:
        tried.add(m)
        plan = program.plan(m)
        if plan.peak_bytes <= budget_bytes:
            if best is None or _less_recompute(plan, best):
                best = plan
            step = max(1, math.floor((budget_bytes - plan.peak_bytes) / unit))
            m = min(top, m + step)
        else:
            step = max(1, math.ceil((plan.peak_bytes - budget_bytes) / unit))
            m = max(lowest, m - step)
    return best


def _less_recompute(plan: Plan, other: Plan) -> bool:
    return plan.cost_key < other.cost_key
