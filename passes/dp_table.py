"""The dynamic program's table (:class:`Table`), what :mod:`passes.optimal` builds plans from.

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
resulting plans (:func:`passes.optimal.plan_for_budget`):
the budget is judged by the simulator, not by the program's own estimate.

A *tight* table (``Table(..., tight=True)``) counts two things as the simulator does where
the other does not:

* a recomputed child's backward comes after the rest's, which consumed the gradient of the
  range's output: that memory is free again for the child, up to its own output's gradient.
  Counted held (the other table), every level of nesting costs one more boundary, and long
  chains could not nest below a few boundaries' worth of memory;
* the end of the forward may be one recomputed or selective child
  (:meth:`Table.last_child_options`), keeping only the forward's output through the loss.

Neither table's plans are always the better start for the searches after it, so the budget
search asks both (:class:`passes.optimal.DynamicPrograms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from passes.chain import Chain, ChainRanges
from passes.plan import Progress

KEPT, RECOMPUTED, SELECTIVE = 0, 1, 2
SLOTS = 160


def slots(nbytes: float | np.ndarray, unit: float) -> int | np.ndarray:
    """Memory slots ``nbytes`` needs (rounded up: a plan never gets less than it needs);
    elementwise for an array."""
    if isinstance(nbytes, np.ndarray):
        return np.ceil(nbytes / unit - 1e-9).astype(np.int64)
    return math.ceil(nbytes / unit - 1e-9)


BYTE_WEIGHT = 1e-3  # FLOPs a recomputed byte costs: a tie-break among plans of equal FLOPs
SEGMENT_COST = 1.0  # a recomputed segment's own cost: a tie-break, so none is made that saves nothing


def recompute_cost(chain: Chain | ChainRanges, i: int | np.ndarray, j: int | np.ndarray) -> float | np.ndarray:
    """What recomputing stages ``i..j-1`` costs: FLOPs, plus a little per byte written so
    pointwise work (which the FLOP counter calls free) is not free, plus the checkpoint
    call's own cost where it was measured. For arrays of ranges through a
    :class:`passes.chain.ChainRanges`."""
    return chain.rerun_flops(i, j) + BYTE_WEIGHT * chain.rerun_written(i, j) + max(SEGMENT_COST, chain.call_cost)


def selective_cost(chain: Chain | ChainRanges, i: int | np.ndarray, j: int | np.ndarray) -> float | np.ndarray:
    """What recomputing stages ``i..j-1`` costs when their matmul/convolution outputs are
    kept from forward: the pointwise work, and the selective policy's cost per op (arrays
    of ranges as :func:`recompute_cost`)."""
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
    output_gradient: np.ndarray
    recompute: np.ndarray
    selective: np.ndarray


def _first_children(chain: Chain, ranges: ChainRanges, unit: float, selective: bool) -> _FirstChild:
    """The :class:`_FirstChild` arrays of ``chain`` (read through its ``ranges``) in slots
    of ``unit`` bytes."""
    n = chain.stages
    i, k = np.triu_indices(n + 1, 1)  # every first child [i, k)
    never = 2**40  # the forward's last "boundary" is not one (it may be uncuttable): no first child ends there
    boundary = np.array([0, *(slots(b, unit) for b in chain.boundaries[:-1]), never], dtype=np.int64)
    last = chain.boundaries[-1]
    output_gradient = np.array([*boundary[:-1], slots(last, unit) if math.isfinite(last) else 0], dtype=np.int64)
    stored, own, expensive = (np.zeros((n + 1, n + 1), dtype=np.int64) for _ in range(3))
    recompute, cheap = np.full((n + 1, n + 1), np.inf), np.full((n + 1, n + 1), np.inf)
    stored_bytes, expensive_bytes = ranges.stored(i, k), ranges.expensive_bytes(i, k)
    stored[i, k] = slots(stored_bytes, unit)
    own[i, k] = slots(stored_bytes + ranges.working(i, k), unit) + boundary[k]
    expensive[i, k] = slots(expensive_bytes, unit)
    allowed = ranges.recomputable(i, k)
    recompute[i[allowed], k[allowed]] = recompute_cost(ranges, i[allowed], k[allowed])
    if selective:
        allowed &= expensive_bytes != 0
        cheap[i[allowed], k[allowed]] = selective_cost(ranges, i[allowed], k[allowed])
    return _FirstChild(stored, own, expensive, boundary, output_gradient, recompute, cheap)


def _padded(shape: tuple[int, ...], width: int) -> tuple[np.ndarray, np.ndarray]:
    """A table of rows ``width`` long, all ``inf``, stored with ``width`` more ``inf`` left of
    each row: the table, and its storage (what :func:`_shifted` reads). The table is a view
    of the storage, so what is written to it is read back shifted."""
    storage = np.full((*shape, 2 * width), np.inf)
    return storage[..., width:], storage


def _windows(storage: np.ndarray, columns: range) -> np.ndarray:
    """Every run of ``len(columns)`` entries of each row of a :func:`_padded` storage: what
    :func:`_shifted` picks from for those columns."""
    return np.lib.stride_tricks.sliding_window_view(storage, len(columns), axis=-1)


def _shifted(windows: np.ndarray, rows: tuple[np.ndarray, ...], by: np.ndarray, low: int) -> np.ndarray:
    """``out[..., m - low] = table[rows][..., m - by]`` for the columns ``m`` from ``low`` on
    that ``windows`` spans (:func:`_windows`): each row's sub-problem run with ``by`` slots
    already taken (``inf`` where that is more than ``m``). A row copied per row, not an
    element gathered per element: half the dynamic program's time went to this on a 500-op
    graph.

    >>> table, storage = _padded((1,), 3)
    >>> table[0] = [1.0, 2.0, 3.0]
    >>> _shifted(_windows(storage, range(3)), (np.array([0]),), np.array([1]), 0)
    array([[inf,  1.,  2.]])
    >>> _shifted(_windows(storage, range(2, 3)), (np.array([0]),), np.array([1]), 2)
    array([[2.]])
    """
    width = (windows.shape[-2] + windows.shape[-1] - 1) // 2  # the table's: its storage is twice as long
    return windows[(*rows, width + low - np.minimum(by, width + low))]


class Table:
    """The program's answers over free memory ``m``: ``least[i, j, m]`` for ranges inside the
    forward and ``top[i, m]`` for ranges ``[i, stages)`` that end it, and how it got each
    (``choice`` and ``top_choice``; ``-1``: one kept child, else ``3 * k + kind`` for a
    first child ``[i, k)`` of that kind).

    Solved for ``m`` below :attr:`solved` and grown on demand (:meth:`extend`): an answer
    at ``m`` reads only answers at ``m`` or less, so a budget's plans need the table only
    up to about the budget (62-78 of 161 slots at 0.3 of eager on 500-op random DAGs)."""

    def __init__(self, chain: Chain, unit: float, slot_count: int = SLOTS, selective: bool = True,
                 tight: bool = True) -> None:
        n, width = chain.stages, slot_count + 1
        self.chain, self.unit, self.slot_count, self.tight = chain, unit, slot_count, tight
        self.ranges = ChainRanges(chain)
        self.first = _first_children(chain, self.ranges, unit, selective)
        self.least, self._least_storage = _padded((n + 1, n + 1), width)
        self.top, self._top_storage = _padded((n + 1,), width)
        self.choice, self.top_choice = np.full((n + 1, n + 1, width), -1), np.full((n + 1, width), -1)
        self.solved = 0

    def extend(self, m: int, progress: Progress | None = None) -> None:
        """Solve every ``m`` up to ``m`` (at most :attr:`slot_count`): every range, shortest
        first (each range reads shorter ones; all ranges of one length at once), then the
        whole forward, ``top[0]``, whose last child also holds the loss."""
        columns = range(self.solved, min(m, self.slot_count) + 1)
        if not columns:
            return
        chain, n = self.chain, self.chain.stages
        least_windows, top_windows = _windows(self._least_storage, columns), _windows(self._top_storage, columns)
        for length in range(1, n + 1):
            starts = np.arange(n - length + 1)
            ends, k = starts + length, starts[:, None] + np.arange(1, length)[None, :]
            rest = (least_windows, (k, ends[:, None]))
            self.least[starts, ends, columns.start:columns.stop], self.choice[starts, ends, columns.start:columns.stop] = (
                self._fill(starts, length, rest, 0.0, least_windows, columns, self.freed(ends)))
            if progress:
                progress(length, n + 1)
        for i in range(n - 1, -1, -1):
            rest = (top_windows, (np.arange(i + 1, n)[None, :],))
            cost, how = self._fill(np.array([i]), n - i, rest, chain.finish, least_windows, columns, np.zeros(1, int))
            cost, how = cost[0], how[0]
            for kind, last in (self.last_child_options(i, least_windows, columns) if self.tight else {}).items():
                better = last < cost
                cost, how = np.where(better, last, cost), np.where(better, 3 * n + kind, how)
            self.top[i, columns.start:columns.stop], self.top_choice[i, columns.start:columns.stop] = cost, how
        self.solved = columns.stop
        if progress:
            progress(n + 1, n + 1)

    def freed(self, ends: np.ndarray) -> np.ndarray:
        """Slots of each range's output gradient that its first recomputed child's backward
        finds free again (ranges ending at ``ends``; none in a table that is not tight)."""
        return self.first.output_gradient[ends] if self.tight else np.zeros(len(ends), dtype=np.int64)

    def last_child_options(self, i: int, least_windows: np.ndarray, columns: range) -> dict[int, np.ndarray]:
        """Cost over ``columns`` of running ``[i, stages)``, the end of the forward, as one
        recomputed or selective child: forward keeps only its output (and, selective, its
        matmul outputs) while the loss runs, where a kept last child holds everything it
        saves. The exact solver's schedule for the zoo MLP at 0.3 of eager drops the last
        layer's activations too. Empty where the forward's output is no cut (a value not
        kept by bytes) or ``[i, stages)`` cannot be recomputed."""
        chain, unit, n = self.chain, self.unit, self.chain.stages
        if not math.isfinite(chain.boundaries[-1]) or not chain.recomputable(i, n):
            return {}
        memory = np.arange(columns.start, columns.stop)
        output, finish = slots(chain.boundaries[-1], unit), slots(chain.finish, unit)
        inner = _shifted(least_windows, (np.array([i]), np.array([n])), np.array([output]), columns.start)[0]
        options = {RECOMPUTED: np.where(memory >= output + finish, self.first.recompute[i, n] + inner, np.inf)}
        if np.isfinite(self.first.selective[i, n]):
            expensive = int(self.first.expensive[i, n])
            own = slots(chain.stored(i, n) + chain.working(i, n), unit) + output
            fits = memory >= max(own, output + expensive + finish)
            options[SELECTIVE] = np.where(fits, self.first.selective[i, n], np.inf)
        return options

    def _fill(self, starts: np.ndarray, length: int, rest: tuple[np.ndarray, tuple], extra: float,
              least_windows: np.ndarray, columns: range, freed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Least recompute of each range ``[i, i + length)`` (``i`` in ``starts``) over
        ``columns`` and how; ``rest`` gives the cost of running ``[k, i + length)`` after a
        first child ``[i, k)`` (the windows and the rows to read, ``(range, k - i - 1)``)."""
        memory = np.arange(columns.start, columns.stop)
        ends = starts + length
        need = slots(self.ranges.stored(starts, ends) + np.maximum(self.ranges.working(starts, ends), extra), self.unit)
        one_kept = np.where(memory[None, :] >= need[:, None], 0.0, np.inf)
        if length == 1:
            return one_kept, np.full(one_kept.shape, -1)
        options = _first_child_options(self.first, columns, least_windows, rest, starts, length, freed)
        options = options.reshape(len(starts), -1, len(memory))
        best = options.argmin(axis=1)
        cost = np.take_along_axis(options, best[:, None, :], axis=1)[:, 0]
        better = cost < one_kept
        return np.where(better, cost, one_kept), np.where(better, 3 * (starts[:, None] + 1) + best, -1)


def solve(chain: Chain, unit: float, slot_count: int = SLOTS, selective: bool = True,
          progress: Progress | None = None, tight: bool = True) -> Table:
    """The whole :class:`Table`, every ``m`` up to ``slot_count``."""
    table = Table(chain, unit, slot_count, selective, tight)
    table.extend(slot_count, progress)
    return table


def _first_child_options(first: _FirstChild, columns: range, least_windows: np.ndarray,
                         rest: tuple[np.ndarray, tuple], starts: np.ndarray, length: int,
                         freed: np.ndarray) -> np.ndarray:
    """Cost over the free memory ``m`` in ``columns`` of each way to run a first child ``[i, k)`` of
    each range ``[i, i + length)`` (``i`` in ``starts``; ``k`` in ``i+1 .. i + length - 1``)
    then the rest, shaped ``(range, k - i - 1, kind, m)``: kept, recomputed with its own
    children (the table's ``[i, k)``), selective. ``rest`` is the windows and rows of the
    rest's costs."""
    i, memory = starts[:, None], np.arange(columns.start, columns.stop)
    k = i + np.arange(1, length)[None, :]
    rest_windows, rest_rows = rest
    boundary = first.boundary[k]
    options = np.empty((*k.shape, 3, len(memory)))
    kept, recomputed, cheap = options[:, :, KEPT], options[:, :, RECOMPUTED], options[:, :, SELECTIVE]
    kept[...] = _shifted(rest_windows, rest_rows, first.stored[i, k], columns.start)
    taken = boundary - np.minimum(boundary, freed[:, None])  # its gradient in, the range's out gone
    np.add(first.recompute[i, k][..., None], _shifted(least_windows, (i, k), taken, columns.start), out=recomputed)
    recomputed += _shifted(rest_windows, rest_rows, boundary, columns.start)
    np.add(first.selective[i, k][..., None],
           _shifted(rest_windows, rest_rows, boundary + first.expensive[i, k], columns.start), out=cheap)
    too_small = memory < first.own_backward[i, k][..., None]  # the child's own backward does not fit
    kept[too_small], cheap[too_small] = np.inf, np.inf
    return options
