"""Per-block checkpointing found from the model's module tree: the plan that
``model.gradient_checkpointing_enable()`` stands for, made without editing the model.

Each op's cost-graph attribute ``block`` names the repeated layer it runs in
(``"transformer.h.3"``). Every run of ops inside one block becomes a recomputed segment;
ops outside every block (embeddings, the final norm, the head, the loss) run as in eager
mode, as they do under Hugging Face's per-block checkpointing. The budget search offers this
plan and its selective variant as candidates, so at per-block's memory it never picks a plan
its own cost model rates worse.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby

import networkx as nx

from passes.graph_facts import op_nodes
from passes.plan import Candidate, Segment, selective_segment
from passes.segments import make_segments


def block_runs(graph: nx.DiGraph) -> list[tuple[str, list[str]]]:
    """``(block, ops)`` for each maximal run of consecutive ops (execution order) in the
    same block; ``block`` is ``""`` for a run outside every block.

    >>> from passes.costgraph import add_value
    >>> g = nx.DiGraph()
    >>> for i, block in enumerate(["", "h.0", "h.0", "h.1", ""]):
    ...     add_value(g, f"op{i}", kind="op", order=i, bytes=1, block=block)
    >>> [(block, len(ops)) for block, ops in block_runs(g)]
    [('', 1), ('h.0', 2), ('h.1', 1), ('', 1)]
    """
    ops = op_nodes(graph)
    return [(block, list(run)) for block, run in groupby(ops, key=lambda n: graph.nodes[n].get("block", ""))]


def block_names(graph: nx.DiGraph) -> list[str]:
    """The blocks the graph's ops run in, in execution order (empty: no blocks known)."""
    return list(dict.fromkeys(block for block, _ in block_runs(graph) if block))


def block_segments(graph: nx.DiGraph) -> tuple[Segment, ...] | None:
    """Segments recomputing every block run, the rest kept; ``None`` when the graph names no
    blocks or no block can be recomputed (a boundary value written in place later, ...).
    A block that ends the forward is kept: its backward runs right after forward, so
    recomputing it would save nothing. So is a block with an op that must not run twice
    (``recomputable=False``: a module whose hooks run once a step, an in-place write that
    something reads): per-block checkpointing reruns a block whole."""
    runs = block_runs(graph)
    if not any(block for block, _ in runs):
        return None
    groups = [(ops, bool(block) and all(graph.nodes[n]["recomputable"] for n in ops)) for block, ops in runs]
    groups[-1] = (groups[-1][0], False)
    segments = make_segments(graph, groups)
    return segments if any(s.recompute for s in segments) else None


def recomputed_blocks(graph: nx.DiGraph, segments: tuple[Segment, ...]) -> tuple[str, ...]:
    """The blocks whose runs ``segments`` recompute, in execution order (a block-aligned
    plan such as :func:`passes.block_plan.block_plan`'s); ops outside every block are never among them."""
    return _blocks_of(graph, (s for s in segments if s.recompute))


def selective_blocks(graph: nx.DiGraph, segments: tuple[Segment, ...]) -> tuple[str, ...]:
    """The blocks of :func:`recomputed_blocks` that ``segments`` recompute selectively
    (their matmul/convolution outputs kept from forward, :func:`block_mixes`)."""
    return _blocks_of(graph, (s for s in segments if s.recompute and s.saved_inside))


def _blocks_of(graph: nx.DiGraph, segments: Iterable[Segment]) -> tuple[str, ...]:
    """The blocks ``segments`` start in, in order, once each; ops outside every block left out."""
    names = (graph.nodes[s.nodes[0]].get("block", "") for s in segments)
    return tuple(dict.fromkeys(name for name in names if name))


MIXES_UP_TO = 24  # blocks; past it, only plans with every block recomputed one way or the other


def block_mixes(graph: nx.DiGraph, every: Candidate) -> list[Candidate]:
    """Block-aligned plans between eager and ``every`` (every block recomputed): the first
    ``whole`` blocks recomputed whole, the next ``kept`` selectively (their matmul and
    convolution outputs kept from forward, :func:`passes.plan.selective`), the rest not
    recomputed. What a module tree can carry out in place (``graphckpt.enable``), and between
    per-block checkpointing and eager the cheapest way to spend memory: a selective block
    reruns only its cheap ops. Past :data:`MIXES_UP_TO` blocks only the mixes recomputing
    every block, and the selective prefixes, are listed (the rest grow as blocks squared).
    ``every`` itself and the prefixes recomputed whole (:func:`passes.flat_plans.partially_recomputed`)
    are not repeated.
    """
    count = sum(s.recompute for s in every.segments)
    if not any(graph.nodes[n]["expensive"] for n in graph):
        return []
    pairs = [(whole, kept) for whole in range(count + 1) for kept in range(1, count - whole + 1)
             if count <= MIXES_UP_TO or whole + kept == count or whole == 0]
    return [_mixed(graph, every, whole, kept) for whole, kept in pairs]


def _mixed(graph: nx.DiGraph, every: Candidate, whole: int, kept: int) -> Candidate:
    """``every`` recomputing only its first ``whole + kept`` recomputed segments (as
    :func:`passes.flat_plans.partially_recomputed` does), the last ``kept`` of them selectively."""
    recomputed = [i for i, s in enumerate(every.segments) if s.recompute][:whole + kept]
    segments = make_segments(graph, [(s.nodes, i in recomputed) for i, s in enumerate(every.segments)])
    # a block writing into its own kernels' outputs (``kernels_written``) is recomputed whole instead
    selective = {every.segments[i].nodes for i in recomputed[whole:]
                 if not any(graph.nodes[n]["kernels_written"] for n in every.segments[i].nodes)}
    segments = tuple(selective_segment(graph, s) if s.nodes in selective else s for s in segments)
    return Candidate(f"blocks ({whole} whole, {kept} selective)", segments, every.notes)
