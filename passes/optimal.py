"""The ``optimal`` pass: least recompute whose simulated peak fits a memory budget.

A dynamic program over a chain of stages (:mod:`passes.chain`), in the spirit of Chen et
al.'s recursive checkpointing and of Rotor's DP for heterogeneous chains. It solves, for
every range of stages ``[i, j)`` and every amount of free memory ``m`` (in slots of the
eager peak):

    ``least[i][j][m]``: the least recompute to run backward through stages ``i..j-1``
    once their forward is to be run again, using at most ``m`` beyond what is already held.

The range runs as a sequence of children. Its first child ``[i, k)`` is one of

* *kept*: run saving everything; the rest runs in ``m - stored(i, k)``;
* *recomputed*: keeps only its output boundary; the rest runs in ``m - boundary(k)`` and,
  when backward reaches the child, it is recomputed with its own children in the same
  memory: nested segments, the O(log n) regime of Chen et al. and revolve;
* *selective*: like recomputed, but keeps its matmul/convolution outputs from forward, so
  its recompute is only the cheap pointwise work;

or the range is one kept child (everything stored). The whole forward is the range
``[0, stages)`` (``top[0]``), whose last child also holds the loss
between forward and backward. How much free memory to give it comes from simulating the
resulting plans (:func:`plan_for_budget`): the budget is judged by the simulator, not by
the program's own estimate.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np

from passes.chain import Chain, build_chain
from passes.plan import Plan, Progress, plan_of_segments
from passes.segments import Segment, make_segments, merge_kept, nested
from passes.simulate import eager_peak

KEPT, RECOMPUTED, SELECTIVE = 0, 1, 2
SLOTS = 160


@dataclass(frozen=True)
class Table:
    """The program's answers over free memory ``m``: ``least[i, j, m]`` for ranges inside the
    forward and ``top[i, m]`` for ranges ``[i, stages)`` that end it, and how it got each
    (``choice`` and ``top_choice``; ``-1``: one kept child, else ``3 * k + kind`` for a
    first child ``[i, k)`` of that kind)."""

    chain: Chain
    unit: float
    least: np.ndarray
    choice: np.ndarray
    top: np.ndarray
    top_choice: np.ndarray


def slots(nbytes: float, unit: float) -> int:
    """Memory slots ``nbytes`` needs (rounded up: a plan never gets less than it needs)."""
    return math.ceil(nbytes / unit - 1e-9)


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


BYTE_WEIGHT = 1e-3  # FLOPs a recomputed byte costs: a tie-break among plans of equal FLOPs
SEGMENT_COST = 1.0  # a recomputed segment's own cost: a tie-break, so none is made that saves nothing


def recompute_cost(chain: Chain, i: int, j: int) -> float:
    """What recomputing stages ``i..j-1`` costs: FLOPs, plus a little per byte written so
    pointwise work (which the FLOP counter calls free) is not free, plus the checkpoint
    call's own cost where it was measured."""
    return chain.rerun_flops(i, j) + BYTE_WEIGHT * chain.rerun_written(i, j) + max(SEGMENT_COST, chain.call_cost)


def selective_cost(chain: Chain, i: int, j: int) -> float:
    """What recomputing stages ``i..j-1`` costs when their matmul/convolution outputs are
    kept from forward: the pointwise work, and the selective policy's cost per op."""
    kept = chain.rerun_expensive_flops(i, j) + BYTE_WEIGHT * chain.rerun_expensive_bytes(i, j)
    return recompute_cost(chain, i, j) - kept + chain.selective_op_cost * chain.op_count(i, j)


@dataclass(frozen=True)
class _FirstChild:
    """What the program needs to know about a first child ``[i, k)``, for every pair at
    once (``[i, k]``; ``boundary[k]``): slots it stores kept, slots its own backward needs,
    slots of its matmul outputs, and its recompute and selective costs (``inf`` where that
    kind is not allowed)."""

    stored: np.ndarray
    own_backward: np.ndarray
    expensive: np.ndarray
    boundary: np.ndarray
    recompute: np.ndarray
    selective: np.ndarray


def _first_children(chain: Chain, unit: float, selective: bool) -> _FirstChild:
    """The :class:`_FirstChild` arrays of ``chain`` in slots of ``unit`` bytes."""
    n = chain.stages
    pairs = {name: np.zeros((n + 1, n + 1)) for name in ("stored", "own", "expensive")}
    recompute, cheap = np.full((n + 1, n + 1), np.inf), np.full((n + 1, n + 1), np.inf)
    never = 2**40  # the forward's last "boundary" is not one (it may be uncuttable): no first child ends there
    boundary = np.array([0, *(slots(b, unit) for b in chain.boundaries[:-1]), never], dtype=np.int64)
    for i in range(n):
        for k in range(i + 1, n + 1):
            pairs["stored"][i, k] = slots(chain.stored(i, k), unit)
            pairs["own"][i, k] = slots(chain.stored(i, k) + chain.working(i, k), unit) + boundary[k]
            pairs["expensive"][i, k] = slots(chain.expensive_bytes(i, k), unit)
            if chain.recomputable(i, k):
                recompute[i, k] = recompute_cost(chain, i, k)
                if selective and chain.expensive_bytes(i, k):
                    cheap[i, k] = selective_cost(chain, i, k)
    as_int = {name: values.astype(np.int64) for name, values in pairs.items()}
    return _FirstChild(as_int["stored"], as_int["own"], as_int["expensive"], boundary, recompute, cheap)


def _padded(shape: tuple[int, ...], width: int) -> tuple[np.ndarray, np.ndarray]:
    """A table of rows ``width`` long, all ``inf``, stored with ``width`` more ``inf`` left of
    each row: the table, and every row seen through every shift (what :func:`_shifted`
    reads). Both are views of one array, so what is written to the table is in the windows."""
    storage = np.full((*shape, 2 * width), np.inf)
    return storage[..., width:], np.lib.stride_tricks.sliding_window_view(storage, width, axis=-1)


def _shifted(windows: np.ndarray, rows: tuple[np.ndarray, ...], by: np.ndarray) -> np.ndarray:
    """``out[..., m] = table[rows][..., m - by]`` of the table ``windows`` views
    (:func:`_padded`): each row's sub-problem run with ``by`` slots already taken (``inf``
    where that is more than ``m``). A row copied per row, not an element gathered per
    element: half the dynamic program's time went to this on a 500-op graph.

    >>> table, windows = _padded((1,), 3)
    >>> table[0] = [1.0, 2.0, 3.0]
    >>> _shifted(windows, (np.array([0]),), np.array([1]))
    array([[inf,  1.,  2.]])
    """
    width = windows.shape[-1]
    return windows[(*rows, width - np.minimum(by, width))]


def solve(chain: Chain, unit: float, slot_count: int = SLOTS, selective: bool = True,
          progress: Progress | None = None) -> Table:
    """Fill the table for every range, shortest first (each range reads shorter ones; all
    ranges of one length at once), then the whole forward, ``top[0]``, whose last child also
    holds the loss."""
    n, width = chain.stages, slot_count + 1
    memory = np.arange(width)
    first = _first_children(chain, unit, selective)
    least, least_windows = _padded((n + 1, n + 1), width)
    top, top_windows = _padded((n + 1,), width)
    choice, top_choice = np.full((n + 1, n + 1, width), -1), np.full((n + 1, width), -1)

    def fill(starts: np.ndarray, length: int, rest: tuple[np.ndarray, tuple], extra: float
             ) -> tuple[np.ndarray, np.ndarray]:
        """Least recompute of each range ``[i, i + length)`` (``i`` in ``starts``) and how;
        ``rest`` gives the cost of running ``[k, i + length)`` after a first child ``[i, k)``
        (the table's windows and the rows to read, ``(range, k - i - 1)``)."""
        need = [slots(chain.stored(i, i + length) + max(chain.working(i, i + length), extra), unit) for i in starts]
        one_kept = np.where(memory[None, :] >= np.array(need)[:, None], 0.0, np.inf)
        if length == 1:
            return one_kept, np.full(one_kept.shape, -1)
        options = _first_child_options(first, memory, least_windows, rest, starts, length).reshape(len(starts), -1, width)
        best = options.argmin(axis=1)
        cost = np.take_along_axis(options, best[:, None, :], axis=1)[:, 0]
        better = cost < one_kept
        return np.where(better, cost, one_kept), np.where(better, 3 * (starts[:, None] + 1) + best, -1)

    for length in range(1, n + 1):
        starts = np.arange(n - length + 1)
        ends, k = starts + length, starts[:, None] + np.arange(1, length)[None, :]
        least[starts, ends], choice[starts, ends] = fill(starts, length, (least_windows, (k, ends[:, None])), 0.0)
        if progress:
            progress(length, n + 1)
    for i in range(n - 1, -1, -1):
        rows = (np.arange(i + 1, n)[None, :],)
        top[i], top_choice[i] = (row[0] for row in fill(np.array([i]), n - i, (top_windows, rows), chain.finish))
    if progress:
        progress(n + 1, n + 1)
    return Table(chain, unit, least, choice, top, top_choice)


def _first_child_options(first: _FirstChild, memory: np.ndarray, least_windows: np.ndarray,
                         rest: tuple[np.ndarray, tuple], starts: np.ndarray, length: int) -> np.ndarray:
    """Cost over memory of each way to run a first child ``[i, k)`` of each range
    ``[i, i + length)`` (``i`` in ``starts``; ``k`` in ``i+1 .. i + length - 1``) then the rest,
    shaped ``(range, k - i - 1, kind, m)``: kept, recomputed with its own children (the
    table's ``[i, k)``), selective. ``rest`` is the windows and rows of the rest's costs."""
    i = starts[:, None]
    k = i + np.arange(1, length)[None, :]
    rest_windows, rest_rows = rest
    boundary = first.boundary[k]
    options = np.empty((*k.shape, 3, len(memory)))
    kept, recomputed, cheap = options[:, :, KEPT], options[:, :, RECOMPUTED], options[:, :, SELECTIVE]
    kept[...] = _shifted(rest_windows, rest_rows, first.stored[i, k])
    np.add(first.recompute[i, k][..., None], _shifted(least_windows, (i, k), boundary), out=recomputed)
    recomputed += _shifted(rest_windows, rest_rows, boundary)
    np.add(first.selective[i, k][..., None], _shifted(rest_windows, rest_rows, boundary + first.expensive[i, k]),
           out=cheap)
    too_small = memory < first.own_backward[i, k][..., None]  # the child's own backward does not fit
    kept[too_small], cheap[too_small] = np.inf, np.inf
    return options


def children(table: Table, i: int, j: int, m: int, top: bool = False) -> list[tuple[int, int, int, list]]:
    """The children the table chose for ``[i, j)`` with ``m`` free slots, as
    ``(kind, start, end, grandchildren)``; ``top`` for the whole forward's entry."""
    chain, unit = table.chain, table.unit
    how = int(table.top_choice[i, m] if top else table.choice[i, j, m])
    if how < 0:
        return [(KEPT, i, j, [])]
    k, kind = divmod(how, 3)
    boundary = slots(chain.boundaries[k - 1], unit)
    if kind == KEPT:
        return [(KEPT, i, k, []), *children(table, k, j, m - slots(chain.stored(i, k), unit), top)]
    if kind == RECOMPUTED:
        return [(RECOMPUTED, i, k, children(table, i, k, m - boundary)), *children(table, k, j, m - boundary, top)]
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
    slots (:func:`memory_unit`), ``self.slot_count`` of them."""

    def __init__(self, graph: nx.DiGraph, max_stages: int = 64, slot_count: int = SLOTS,
                 progress: Progress | None = None) -> None:
        self.graph = graph
        self.chain = build_chain(graph, max_stages)
        unit = memory_unit(self.chain, eager_peak(graph), slot_count, common_value_bytes(graph))
        self.slot_count = slots(memory_span(self.chain, eager_peak(graph)), unit)
        self.table = solve(self.chain, unit, self.slot_count, selective=True, progress=progress)
        self._plans: dict[int, Plan] = {}

    def feasible(self, m: int) -> bool:
        return bool(np.isfinite(self.table.top[0, m]))

    def plan(self, m: int) -> Plan:
        """The program's plan with ``m`` free slots for the whole forward (memoised)."""
        if m not in self._plans:
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
        return self.plan(next(m for m in range(self.slot_count + 1) if self.feasible(m)))


def plan_for_budget(program: DynamicProgram, budget_bytes: float, tries: int = 8) -> Plan | None:
    """The program's plan with the most free memory whose *simulated* peak fits the budget
    (so the least recompute), or ``None`` when none fits within ``tries`` simulations.

    The program's own estimate puts the plan with ``budget / unit`` free slots near the
    budget; each simulation then moves the free memory by what the estimate missed.
    """
    unit, top = program.table.unit, program.slot_count
    feasible = [m for m in range(top + 1) if program.feasible(m)]
    if not feasible:
        return None
    m = max(feasible[0], min(top, math.floor(budget_bytes / unit)))
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
            m = max(feasible[0], m - step)
    return best


def _less_recompute(plan: Plan, other: Plan) -> bool:
    return plan.cost_key < other.cost_key
