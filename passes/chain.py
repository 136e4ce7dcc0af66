"""A cost graph seen as a chain of stages: what the ``optimal`` dynamic program works on.

The forward's op order is cut at candidate boundaries (prefix cuts of the execution order
that are allowed and cheap: articulation points and the cheapest cut of each window); the
ops between two boundaries form a *stage*. A range of stages then has a few numbers that
are enough to plan it, all prefix sums or range maxima so the program reads them in O(1):

* ``rerun_flops`` / ``rerun_written``: what recomputing the range costs (FLOPs, and bytes
  written, the cost of pointwise work that the FLOP counter calls free), counting only the
  ops a recompute runs: it stops after the last op that saves anything for backward, or
  before it when it saves only its inputs (:func:`passes.recompute.recompute_steps`);
* ``stored``: bytes the range keeps alive when run saving for backward;
* ``expensive_bytes``: the part of ``stored`` that matmul/convolution outputs make up (kept
  by a selective segment instead of recomputed), and ``rerun_expensive_flops`` /
  ``rerun_expensive_bytes`` the part of the rerun they make up;
* ``boundary``: bytes kept at each boundary;
* ``working``: the transient bytes of the range's backward (gradients in flight);
* ``finish``: what the loss adds between forward and backward (its working set and the
  outputs' gradients), held on top of everything the forward keeps.

These are estimates in the same model of memory as :mod:`passes.simulate`; plans the
program builds are simulated before anyone trusts their peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import networkx as nx
import numpy as np

from passes.cuts import INF, op_positions, op_weights, prefix_costs
from passes.kept_bytes import gradient_bytes
from passes.sim_loss import loss_scalar_bytes, loss_working_bytes, trained_outputs


@dataclass(frozen=True)
class Chain:
    """Stages of a cost graph. ``ends[s]`` is the position (in op order) of the last op of
    stage ``s``; ranges ``[i, j)`` of stages are read through the methods."""

    ops: tuple[str, ...]
    ends: tuple[int, ...]
    boundaries: tuple[float, ...]  # bytes kept at the end of each stage
    prefix_stored: tuple[float, ...]
    prefix_expensive_bytes: tuple[float, ...]
    prefix_unrecomputable: tuple[int, ...]
    rerun_stops: tuple[int, ...]  # per stage: op position a recompute ending there stops at
    op_prefix: dict[str, tuple[float, ...]]  # per op position: "flops", "written", "exp_flops", "exp_bytes"
    stage_working: tuple[float, ...]
    finish: float
    call_cost: float = 0.0  # the graph's checkpoint_call_cost
    selective_op_cost: float = 0.0  # the graph's selective_op_cost

    @property
    def stages(self) -> int:
        return len(self.ends)

    def nodes(self, i: int, j: int) -> tuple[str, ...]:
        """Op nodes of stages ``i .. j-1``."""
        start = self.ends[i - 1] + 1 if i else 0
        return self.ops[start: self.ends[j - 1] + 1]

    def rerun(self, i: int, j: int) -> tuple[int, int]:
        """Op positions ``[start, stop)`` a recompute of stages ``i .. j-1`` runs."""
        start = self.ends[i - 1] + 1 if i else 0
        return start, max(start, self.rerun_stops[j - 1])

    def _rerun_sum(self, key: str, i: int, j: int) -> float:
        start, stop = self.rerun(i, j)
        return self.op_prefix[key][stop] - self.op_prefix[key][start]

    def rerun_flops(self, i: int, j: int) -> float:
        return self._rerun_sum("flops", i, j)

    def rerun_written(self, i: int, j: int) -> float:
        return self._rerun_sum("written", i, j)

    def rerun_expensive_flops(self, i: int, j: int) -> float:
        return self._rerun_sum("exp_flops", i, j)

    def rerun_expensive_bytes(self, i: int, j: int) -> float:
        return self._rerun_sum("exp_bytes", i, j)

    def stored(self, i: int, j: int) -> float:
        return self.prefix_stored[j] - self.prefix_stored[i]

    def expensive_bytes(self, i: int, j: int) -> float:
        return self.prefix_expensive_bytes[j] - self.prefix_expensive_bytes[i]

    def recomputable(self, i: int, j: int) -> bool:
        return self.prefix_unrecomputable[j] == self.prefix_unrecomputable[i]

    def op_count(self, i: int, j: int) -> int:
        """Ops of stages ``i .. j-1``."""
        return len(self.nodes(i, j))

    def working(self, i: int, j: int) -> float:
        return max(self.stage_working[i:j])


class ChainRanges:
    """The numbers :class:`Chain`'s methods give for one range, for arrays of ranges ``[i,
    j)`` at once (numpy broadcasting; ``i < j``): the dynamic program prices every pair of
    boundaries before it starts (:func:`passes.optimal.recompute_cost` reads either), a
    few thousand calls of Chain's methods otherwise. Same sums, in the same order, so the
    same floats.

    >>> chain = Chain(ops=("a", "b"), ends=(0, 1), boundaries=(4.0, 0.0), prefix_stored=(0.0, 4.0, 6.0),
    ...               prefix_expensive_bytes=(0.0, 4.0, 4.0), prefix_unrecomputable=(0, 0, 0), rerun_stops=(1, 2),
    ...               op_prefix={"flops": (0.0, 8.0, 9.0)}, stage_working=(3.0, 5.0), finish=0.0)
    >>> ranges = ChainRanges(chain)
    >>> ranges.stored(np.array([0, 0, 1]), np.array([1, 2, 2])).tolist(), chain.stored(0, 2)
    ([4.0, 6.0, 2.0], 6.0)
    >>> ranges.rerun_flops(np.array([0, 1]), np.array([2, 2])).tolist(), ranges.working(np.array([0]), np.array([2]))
    ([9.0, 1.0], array([5.]))
    """

    def __init__(self, chain: Chain) -> None:
        self.call_cost, self.selective_op_cost = chain.call_cost, chain.selective_op_cost
        self._ends, self._stops = np.array(chain.ends), np.array(chain.rerun_stops)
        self._stored, self._expensive = np.array(chain.prefix_stored), np.array(chain.prefix_expensive_bytes)
        self._unrecomputable = np.array(chain.prefix_unrecomputable)
        self._op_prefix = {key: np.array(values, dtype=float) for key, values in chain.op_prefix.items()}
        n = chain.stages
        self._working = np.zeros((n + 1, n + 1))  # [i, j]: max(stage_working[i:j])
        for i in range(n):
            self._working[i, i + 1:] = np.maximum.accumulate(chain.stage_working[i:])

    def _start(self, i: np.ndarray) -> np.ndarray:
        return np.where(i > 0, self._ends[i - 1] + 1, 0)

    def _rerun_sum(self, key: str, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        start = self._start(i)
        stop = np.maximum(start, self._stops[j - 1])
        return self._op_prefix[key][stop] - self._op_prefix[key][start]

    def rerun_flops(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._rerun_sum("flops", i, j)

    def rerun_written(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._rerun_sum("written", i, j)

    def rerun_expensive_flops(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._rerun_sum("exp_flops", i, j)

    def rerun_expensive_bytes(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._rerun_sum("exp_bytes", i, j)

    def stored(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._stored[j] - self._stored[i]

    def expensive_bytes(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._expensive[j] - self._expensive[i]

    def recomputable(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._unrecomputable[j] == self._unrecomputable[i]

    def op_count(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._ends[j - 1] + 1 - self._start(i)

    def working(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self._working[i, j]


def candidate_ends(graph: nx.DiGraph, max_stages: int) -> list[int]:
    """Positions after which the order may be cut, at most ``max_stages - 1`` of them plus
    the last op: every allowed position when there are few, else the cheapest allowed
    position in each of ``max_stages`` windows of equal bytes."""
    costs = prefix_costs(graph)
    last = len(costs) - 1
    allowed = [p for p, cost in enumerate(costs[:-1]) if cost < INF]
    if len(allowed) < max_stages:
        return [*allowed, last]
    cumulative = list(accumulate(op_weights(graph, op_positions(graph)[0])))
    total = cumulative[-1]
    windows: dict[int, int] = {}
    for p in allowed:
        window = min(int(cumulative[p] / total * max_stages), max_stages - 1)
        if window not in windows or costs[p] <= costs[windows[window]]:
            windows[window] = p
    return [*sorted(windows.values()), last]


def retained_bytes(graph: nx.DiGraph, name: str, saved_by_someone: set[str]) -> float:
    """Bytes an op keeps alive after a saving forward: its storage when backward or a later
    op needs it, plus what its backward saves outside the graph's values."""
    attributes = graph.nodes[name]
    kept = attributes["alias_of"] is None and (name in saved_by_someone or graph.out_degree(name) > 0)
    return attributes["bytes"] * kept + attributes["saved_extra_bytes"]


def build_chain(graph: nx.DiGraph, max_stages: int = 64) -> Chain:
    """The chain of stages of ``graph`` (see the module docstring)."""
    ops, _ = op_positions(graph)
    costs = prefix_costs(graph)
    ends = candidate_ends(graph, max_stages)
    saved_by_someone = {v for n in ops for v in graph.nodes[n]["saved"]}
    stage_of = _stage_of_positions(ends)
    sums = {key: [0.0] * len(ends) for key in ("stored", "exp_bytes", "fixed")}
    per_op = {key: [0.0] * len(ops) for key in ("flops", "written", "exp_flops", "exp_bytes")}
    working = [0.0] * len(ends)
    for position, name in enumerate(ops):
        attributes, stage = graph.nodes[name], stage_of[position]
        sums["stored"][stage] += retained_bytes(graph, name, saved_by_someone)
        per_op["flops"][position] = attributes["flops"]
        per_op["written"][position] = attributes["bytes"]
        if attributes["expensive"]:
            sums["exp_bytes"][stage] += attributes["bytes"] + attributes["selective_extra_bytes"]
            per_op["exp_flops"][position] = attributes["flops"]
            per_op["exp_bytes"][position] = attributes["bytes"]
        sums["fixed"][stage] += not attributes["recomputable"]
        backward = 2 * attributes["bytes"] + attributes["param_grad_bytes"] + attributes["backward_extra_bytes"]
        working[stage] = max(working[stage], backward)
    stops = rerun_stops(graph, ops)
    return Chain(
        ops=tuple(ops),
        ends=tuple(ends),
        boundaries=tuple(costs[e] for e in ends),
        prefix_stored=_prefix(sums["stored"]),
        prefix_expensive_bytes=_prefix(sums["exp_bytes"]),
        prefix_unrecomputable=tuple(int(x) for x in _prefix(sums["fixed"])),
        rerun_stops=tuple(stops[e] for e in ends),
        op_prefix={key: _prefix(values) for key, values in per_op.items()},
        stage_working=tuple(working),
        finish=loss_bytes(graph),
        call_cost=graph.graph.get("checkpoint_call_cost", 0),
        selective_op_cost=graph.graph.get("selective_op_cost", 0),
    )


def rerun_stops(graph: nx.DiGraph, ops: Sequence[str]) -> list[int]:
    """For each op position ``e``: where a recompute of ops ending at ``e`` stops, the
    position after the last op that saves anything (at it, when it saves only inputs).
    A range starting after that position reruns nothing."""
    stops, stop = [], 0
    for position, name in enumerate(ops):
        saves = graph.nodes[name]["saves_from"]
        if saves != "nothing":
            stop = position + (saves == "outputs")
        stops.append(stop)
    return stops


def loss_bytes(graph: nx.DiGraph) -> float:
    """Bytes the loss holds at the end of forward, as :mod:`passes.simulate` counts them:
    its working set, the gradients backward starts from and the loss's scalars."""
    return (loss_working_bytes(graph) + loss_scalar_bytes(graph)
            + sum(gradient_bytes(graph, v) for v in trained_outputs(graph)))


def _stage_of_positions(ends: Sequence[int]) -> list[int]:
    stage_of, start = [], 0
    for stage, end in enumerate(ends):
        stage_of.extend([stage] * (end - start + 1))
        start = end + 1
    return stage_of


def _prefix(values: Sequence[float]) -> tuple[float, ...]:
    return (0.0, *accumulate(values))
