"""Per-block checkpointing found from the module tree (``strategy="blocks"``), and per-block
as a candidate of every budget search."""

from __future__ import annotations

import copy
import re

import pytest

import graphckpt
from graphckpt.api import cost_model, plan_cost_graph
from graphckpt.capture import CaptureError, block_paths
from graphckpt.tools import zoo
from passes.blocks import block_names, block_runs
from passes.budget_search import BLOCKS_MARGIN, blocks_within_margin
from passes.kept_values import add_keeps, ranked_keeps
from passes.plan import plan_of_segments
from passes.recompute import cost_key
from tests.corpus import ENTRIES
from tests.corpus import harness as h
from tests.equivalence import assert_trains_like


def test_block_paths_are_the_repeated_layers() -> None:
    model, _ = zoo.make("gpt")
    assert block_paths(model) == tuple(f"blocks.{i}" for i in range(4))
    assert block_paths(model, ["blocks"]) == tuple(f"blocks.{i}" for i in range(4))
    assert block_paths(model, ["blocks.1", "head"]) == ("blocks.1", "head")


def test_an_unknown_block_name_is_refused_with_the_models_modules() -> None:
    model, _ = zoo.make("gpt")
    with pytest.raises(CaptureError, match=r"not modules of GPT.*tok_emb"):
        block_paths(model, ["layers"])


@pytest.mark.parametrize("name", ["gpt", "resnet", "densenet"])
def test_each_block_runs_once_and_in_order(name: str) -> None:
    """The ops of one block are consecutive in the execution order, so each block is one
    segment, as under ``torch.utils.checkpoint`` around the module."""
    model, inputs = zoo.make(name)
    graph = cost_model(model, inputs)[1]
    named = [block for block, _ in block_runs(graph) if block]
    assert named == block_names(graph) == list(block_paths(model))


def test_blocks_plan_recomputes_exactly_the_named_modules() -> None:
    model, inputs = zoo.make("gpt")
    reference = copy.deepcopy(model)
    rewritten = graphckpt.rewrite(model, inputs, strategy="blocks", blocks=["blocks.0", "blocks.2"])
    plan = rewritten.meta["graphckpt_plan"]
    graph = cost_model(model, inputs, blocks=["blocks.0", "blocks.2"])[1]
    recomputed = [{graph.nodes[n]["block"] for n in s.nodes} for s in plan.segments if s.recompute]
    assert recomputed == [{"blocks.0"}, {"blocks.2"}]
    assert_trains_like(reference, model, rewritten, inputs)


def test_without_blocks_the_plan_says_it_used_sqrt() -> None:
    model, inputs = zoo.make("mlp")
    plan = graphckpt.plan(model, inputs, strategy="blocks")
    assert plan.strategy == "sqrt" and "no repeated blocks" in plan.notes[0]


def test_hf_gpt2_blocks_measures_what_gradient_checkpointing_enable_measures() -> None:
    """The plan stands for ``gradient_checkpointing_enable()``: measured peak within 3% of
    Hugging Face's per-block checkpointing on the same machine, and simulated within 3% of
    its own measured peak (2.63 MiB eager, 1.56 per-block, 1.56 blocks on a 2-core CPU)."""
    prepared = h.prepare(ENTRIES["gpt2"])
    per_block, how = h.per_block(prepared)
    assert how == "HF gradient_checkpointing_enable"
    plan = plan_cost_graph(prepared.cost_graph, "blocks")
    assert plan.strategy == "blocks"
    measured = h.measure(prepared, h.rewritten(prepared, plan))
    assert measured <= 1.03 * per_block, (measured, per_block)
    assert abs(plan.peak_bytes - measured) <= 0.03 * measured, (plan.peak_bytes, measured)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_a_budget_at_per_blocks_peak_recomputes_no_more_than_per_block(name: str) -> None:
    """Per-block is a candidate of every budget search: at its peak, the chosen plan is
    never rated worse than per-block by the planner's own cost model."""
    model, inputs = zoo.make(name)
    graph = cost_model(model, inputs)[1]
    per_block = plan_cost_graph(graph, "blocks")
    chosen = plan_cost_graph(graph, budget=per_block.peak_bytes)
    assert chosen.peak_bytes <= per_block.peak_bytes
    assert cost_key(graph, chosen.segments) <= cost_key(graph, per_block.segments)


@pytest.mark.parametrize("name", ["gpt", "resnet"])
@pytest.mark.parametrize("above", [1.0, 1.01, 1.1])
def test_near_per_blocks_peak_a_plan_wins_over_per_block_only_by_the_margin(name: str, above: float) -> None:
    """Where per-block fits, another plan is chosen only when it is rated at least
    BLOCKS_MARGIN cheaper: a smaller predicted gain is within what the cost model gets wrong."""
    model, inputs = zoo.make(name)
    graph = cost_model(model, inputs)[1]
    per_block = plan_cost_graph(graph, "blocks")
    chosen = plan_cost_graph(graph, budget=int(per_block.peak_bytes * above))
    same = [s.nodes for s in chosen.segments] == [s.nodes for s in per_block.segments]
    assert same or chosen.cost_key[0] < (1 - BLOCKS_MARGIN) * per_block.cost_key[0]
    if "per-block checkpointing" in chosen.notes[0]:
        assert same


def test_a_plan_rated_within_the_margin_gives_way_to_per_block() -> None:
    """Per-block's segments keeping one cheap value are rated a hair cheaper than per-block:
    not enough to trust; the same segments keeping many values are, by more than the margin."""
    model, inputs = zoo.make("gpt")
    graph = cost_model(model, inputs)[1]
    per_block = plan_cost_graph(graph, "blocks")
    keeps = ranked_keeps(graph, per_block.segments)
    cheapest = min(keeps, key=lambda keep: (graph.nodes[keep[1]]["flops"] == 0, graph.nodes[keep[1]]["flops"]))
    hair = plan_of_segments(graph, "test", add_keeps(graph, per_block.segments, [cheapest]))
    many = plan_of_segments(graph, "test", add_keeps(graph, per_block.segments, keeps))
    assert (1 - BLOCKS_MARGIN) * per_block.cost_key[0] <= hair.cost_key[0] < per_block.cost_key[0]
    assert many.cost_key[0] < (1 - BLOCKS_MARGIN) * per_block.cost_key[0]
    budget = 2 * per_block.peak_bytes
    instead = blocks_within_margin(graph, hair, budget)
    assert instead is not None and [s.nodes for s in instead.segments] == [s.nodes for s in per_block.segments]
    assert blocks_within_margin(graph, many, budget) is None
    assert blocks_within_margin(graph, hair, per_block.peak_bytes - 1) is None  # per-block does not fit


def test_block_plans_recompute_whole_blocks_and_as_few_as_a_budget_needs() -> None:
    from passes.block_plan import block_plan
    from passes.blocks import recomputed_blocks
    from passes.budget import BudgetError
    from passes.simulate import eager_peak

    model, inputs = zoo.make("gpt", layers=6, batch=4)
    _, graph = cost_model(model, inputs)
    every = block_plan(graph)
    assert recomputed_blocks(graph, every.segments) == tuple(f"blocks.{i}" for i in range(6))
    eager = eager_peak(graph)
    halfway = (every.peak_bytes + eager) // 2
    fewer = block_plan(graph, halfway)
    recomputed = recomputed_blocks(graph, fewer.segments)
    assert fewer.peak_bytes <= halfway and recomputed
    # Fewer blocks, or all of them selectively (their matmul outputs kept): since the simulator
    # lets a kept value go where the recompute takes it, six selective blocks fit here.
    assert len(recomputed) < 6 or all(s.saved_inside for s in fewer.segments if s.recompute)
    assert cost_key(graph, fewer.segments) < cost_key(graph, every.segments)
    assert not recomputed_blocks(graph, block_plan(graph, eager).segments)
    with pytest.raises(BudgetError) as refused:
        block_plan(graph, every.peak_bytes - 1)
    assert refused.value.smallest_peak_bytes == every.peak_bytes


def test_block_mixes_recompute_blocks_whole_then_selectively_and_price_between_eager_and_every_block() -> None:
    from passes.blocks import block_mixes, recomputed_blocks, selective_blocks
    from passes.heuristics import blocks_candidate
    from passes.plan import simulated

    model, inputs = zoo.make("gpt", layers=4, batch=2)
    _, graph = cost_model(model, inputs)
    every = blocks_candidate(graph)
    mixes = block_mixes(graph, every)
    assert len(mixes) == 4 * 5 // 2  # (whole, selective) with 1 <= selective <= 4 - whole
    names = tuple(f"blocks.{i}" for i in range(4))
    for mix in mixes:
        whole, kept = (int(count) for count in re.findall(r"\d+", mix.strategy))
        assert recomputed_blocks(graph, mix.segments) == names[:whole + kept]
        assert selective_blocks(graph, mix.segments) == names[whole:whole + kept]
        assert cost_key(graph, mix.segments) < cost_key(graph, every.segments)
        assert simulated(graph, mix).peak_bytes >= simulated(graph, every).peak_bytes
