"""Profiling each distinct op once (graphckpt.op_dedup) changes no figure and no plan."""

from __future__ import annotations

from typing import Any

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

from graphckpt import op_dedup
from graphckpt.capture import capture
from graphckpt.costs import build_cost_graph, prepare
from graphckpt.dedup_interpreter import DedupInterpreter
from graphckpt.inplace import view_parents
from graphckpt.op_keys import module_signature, reads_training
from graphckpt.profile import fake_copy, node_costs
from graphckpt.torch_compat import FakeTensor
from tests.plan_snapshot import plans_of

ZOO_NAMES = ["mlp", "resnet", "gpt", "unet", "densenet"]


def cost_graph(model: nn.Module, x: torch.Tensor, dedup: bool) -> nx.DiGraph:
    torch.manual_seed(0)
    gm = capture(model, (x,), None).graph_module
    return build_cost_graph(gm, prepare(gm, (x,), None, "flops", dedup=dedup))


def assert_same_graph(a: nx.DiGraph, b: nx.DiGraph) -> None:
    """Equal as the planner reads them: graph and node attributes, node order and each node's
    readers and reads in order (networkx hands them out in insertion order). Every plan is a
    deterministic function of these, so equal graphs get equal plans."""
    assert a.graph == b.graph
    assert list(a.nodes) == list(b.nodes) and set(a.edges) == set(b.edges)
    for name in a.nodes:
        assert a.nodes[name] == b.nodes[name], name
        assert list(a.predecessors(name)) == list(b.predecessors(name)), name
        assert list(a.successors(name)) == list(b.successors(name)), name


def zoo_cost_graphs(name: str) -> list[nx.DiGraph]:
    """Zoo model ``name``'s cost graph profiled without op dedup, then with it."""
    from graphckpt.tools import zoo

    graphs = []
    for dedup in (False, True):
        model, inputs = zoo.make(name)
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        gm = capture(model, args, None).graph_module
        graphs.append(build_cost_graph(gm, prepare(gm, args, None, "flops", dedup=dedup)))
    return graphs


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_cost_graphs_are_the_same_with_and_without_dedup(name: str) -> None:
    """Equal cost graphs, and (with ``-m slow``) every strategy's and budget's plan of them
    compared as well: the plans follow from the graphs (:func:`assert_same_graph`), and
    planning both took 8-23 s a model, most of this test's time."""
    assert_same_graph(*zoo_cost_graphs(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_plans_are_the_same_with_and_without_dedup(name: str) -> None:
    without, with_dedup = zoo_cost_graphs(name)
    assert plans_of(without) == plans_of(with_dedup)


class Block(nn.Module):
    """Attention-like: the same Linear for two projections, one read through a transpose."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm, self.q, self.k = nn.LayerNorm(width), nn.Linear(width, width), nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = self.q(h) @ self.k(h).transpose(-1, -2)
        return x + self.drop(torch.softmax(scores, -1) @ h)


class Stack(nn.Module):
    def __init__(self, blocks: int, width: int, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width, dropout) for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@settings(max_examples=6, deadline=None)
@given(blocks=st.integers(1, 4), width=st.sampled_from([4, 8]), dropout=st.sampled_from([0.0, 0.1]),
       grad=st.booleans())
def test_repeated_blocks_cost_the_same_with_and_without_dedup(blocks: int, width: int, dropout: float,
                                                              grad: bool) -> None:
    x = torch.randn(2, 3, width, requires_grad=grad)
    model = Stack(blocks, width, dropout)
    assert_same_graph(cost_graph(model, x, False), cost_graph(model, x, True))


class SharedLayer(nn.Module):
    """One Linear called three times (ALBERT's shared layer), after a Linear of its own."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first, self.layer = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for _ in range(3):
            x = torch.relu(self.layer(x))
        return x


def test_a_shared_layer_under_autocast_costs_the_same_with_and_without_dedup() -> None:
    """Autocast casts a parameter once and hands its cache's copy to every later use: the
    shared layer's second and third calls make no cast (``autocast_cache_bytes`` 0), and
    their backward adds into the same weight gradients. As ghosts of the first call they
    inherited its casts (an over-count) and what its backward lets go early (``released_early``:
    an under-count); they are profiled now. On ALBERT under bf16 six nodes differed so."""
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, deduplicated = (cost_graph(SharedLayer(), x, dedup) for dedup in (False, True))
    assert full.nodes["layer"]["autocast_cache_bytes"] > 0
    assert_same_graph(full, deduplicated)


def test_a_shared_layer_dynamo_hands_a_backend_costs_the_same_with_and_without_dedup() -> None:
    """The same under ``torch.compile``: dynamo passes the parameters to a backend as graph
    inputs, so the shared layer's later calls read the same placeholders, not ``get_attr``
    nodes. Their ghosts claimed the first call's casts and that its backward let ``x_1`` go
    early, which it does not (an under-count); they are profiled now."""
    captured = {}

    def keep_graph(graph_module: fx.GraphModule, inputs: list) -> Any:
        captured.update(graph_module=graph_module, inputs=tuple(inputs))
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(SharedLayer(), backend=keep_graph)(torch.randn(4, 16))
    gm, inputs = captured["graph_module"], captured["inputs"]
    assert any(node.op == "placeholder" and node.name.endswith("layer_parameters_weight_") for node in gm.graph.nodes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, deduplicated = (build_cost_graph(gm, prepare(gm, inputs, None, "flops", dedup=dedup))
                              for dedup in (False, True))
    assert_same_graph(full, deduplicated)


def test_repeats_are_ghosts_and_the_real_model_keeps_its_tensors() -> None:
    model, x = Stack(6, 8, 0.0), torch.randn(2, 3, 8)
    params = {name: p for name, p in model.named_parameters()}
    gm = fx.symbolic_trace(model)
    lazy = op_dedup.lazy_fake_copy(gm)
    costs = op_dedup.deduplicated_costs(gm, (x,), None, training=True, lazy=lazy)
    assert costs == node_costs(gm, (x,), fake=fake_copy(gm))
    assert len(lazy.fakes) < len(params)  # only representatives' parameters were faked
    assert {name: p for name, p in model.named_parameters()} == params
    assert all(not isinstance(p, FakeTensor) for p in gm.parameters())


def test_dedup_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(op_dedup.DEDUP_ENV, "0")
    assert not op_dedup.dedup_enabled() and op_dedup.dedup_enabled(True)
    monkeypatch.setenv(op_dedup.DEDUP_ENV, "1")
    assert op_dedup.dedup_enabled() and not op_dedup.dedup_enabled(False)


def test_module_signature_tells_configurations_apart() -> None:
    signature = module_signature
    assert signature(nn.Linear(4, 4)) == signature(nn.Linear(4, 4))
    assert signature(nn.Linear(4, 4)) != signature(nn.Linear(4, 4, bias=False))
    assert signature(nn.Dropout(0.1)) != signature(nn.Dropout(0.2))
    assert signature(nn.LayerNorm(4)) != signature(nn.LayerNorm(4).eval())
    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda *args: None)
    assert signature(hooked) is None


class _MyLinear(nn.Linear):
    """Not a torch.nn class: it might read ``training``."""


def test_reads_training_only_for_modules_that_may_behave_differently_in_eval() -> None:
    quiet = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.GELU(), nn.Conv1d(4, 4, 1), nn.Embedding(3, 4))
    assert not reads_training(quiet)
    for module in (nn.Dropout(), nn.BatchNorm1d(4), nn.RReLU(), nn.MultiheadAttention(4, 1), _MyLinear(4, 4),
                   nn.Sequential(nn.Linear(4, 4), nn.Dropout())):
        assert reads_training(module), module
    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda *_: None)
    assert reads_training(hooked)


@pytest.mark.parametrize("name", [*ZOO_NAMES, "stack"])
@pytest.mark.parametrize("dedup", [False, True])
def test_the_training_profile_finds_every_view_an_eval_profile_finds(name: str, dedup: bool) -> None:
    """A value that is a view only in eval mode (a Dropout's) is found by asking the modules
    that read ``training`` once more, in eval, during the training profile; the views are
    those a whole eval-mode profile added to the training profile's (the zoo, and a stack
    of blocks with dropout, profiled with and without dedup)."""
    from dataclasses import replace

    from graphckpt.tools import zoo

    model, inputs = zoo.make(name) if name != "stack" else (Stack(3, 8, 0.1), torch.randn(2, 3, 8))
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    gm = capture(model, args, None).graph_module
    fake = fake_copy(gm)
    train = (op_dedup.deduplicated_costs(gm, args, None, training=True, lazy=op_dedup.lazy_fake_copy(gm)) if dedup
             else node_costs(gm, args, None, training=True, fake=fake))
    evaluated = node_costs(gm, args, None, training=False, fake=fake)
    training_only = {n: replace(c, eval_alias_of=None) for n, c in train.items()}
    assert view_parents(gm, train) == view_parents(gm, evaluated) | view_parents(gm, training_only)
    if name in ("gpt", "stack"):
        assert view_parents(gm, train) != view_parents(gm, training_only)  # dropouts, views in eval


@pytest.mark.parametrize("name", [*ZOO_NAMES, "stack"])
def test_a_forward_alone_finds_the_views_and_dtypes_of_the_full_profile(name: str) -> None:
    """:func:`graphckpt.op_dedup.forward_costs`, what in-place ops are decided on before the
    graph is profiled (ResNet's ``ReLU(inplace=True)`` and ``out += identity``), sees every
    view, eval-mode view (dropout), shape and dtype the full training profile sees."""
    from graphckpt.tools import zoo

    model, inputs = zoo.make(name) if name != "stack" else (Stack(3, 8, 0.1), torch.randn(2, 3, 8))
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    gm = capture(model, args, None).graph_module
    facts, full = op_dedup.forward_costs(gm, args, None), op_dedup.profile_costs(gm, args, None)
    assert {n: (c.alias_of, c.eval_alias_of, c.shape, c.dtype) for n, c in facts.items()} == \
        {n: (c.alias_of, c.eval_alias_of, c.shape, c.dtype) for n, c in full.items()}
    assert view_parents(gm, facts) == view_parents(gm, full)


def test_op_timing_pools_repeated_calls_and_runs_the_graph_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphckpt import timing

    runs = []
    original = timing._Stopwatch.run
    monkeypatch.setattr(timing._Stopwatch, "run", lambda self, *a: runs.append(1) or original(self, *a))
    model, x = Stack(4, 8, 0.1), torch.randn(2, 3, 8)
    gm = capture(model, (x,), None).graph_module
    before = [b.clone() for b in gm.buffers()]
    times = timing.node_nanoseconds(gm, (x,), None, dedup=True)
    assert len(runs) == 2 and set(times) == {n.name for n in gm.graph.nodes}
    by_target: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and not node.target.startswith("blocks.0."):
            by_target.setdefault(node.target.split(".", 2)[2], set()).add(times[node.name])
    assert by_target and all(len(values) == 1 for values in by_target.values()), by_target
    assert all(torch.equal(a, b) for a, b in zip(before, gm.buffers(), strict=True))
    runs.clear()
    assert set(timing.node_nanoseconds(gm, (x,), None, repeats=3, dedup=False)) == set(times) and len(runs) == 4


def test_transformer_blocks_need_one_dedup_run_and_cost_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The query and key projections are keyed apart by how they are read (a transpose),
    and dropout has ghosts: one profiling run (in training mode: the views only eval makes
    are found in it), and the figures of the full profile."""
    from tests.scripts import load_script

    script = load_script("rewrite_cost")
    runs = []
    original = op_dedup._deduplicated_run
    monkeypatch.setattr(op_dedup, "_deduplicated_run", lambda *a, **k: runs.append(k["training"]) or original(*a, **k))
    model, x = script.Stack(3, script.TransformerBlock), torch.randn(2, 4, script.WIDTH)
    deduplicated = cost_graph(model, x, True)
    assert runs == [True]
    assert_same_graph(cost_graph(model, x, False), deduplicated)


@pytest.mark.parametrize("family", ["bart", "bert", "gpt2", "llama", "t5"])
def test_exported_hugging_face_models_cost_the_same_with_dedup_mostly_in_one_run(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exported Hugging Face models (op by op: rotary embeddings on transposed heads,
    grouped-query attention's copies, tied embeddings, views) cost what the full profile
    says, their views run as they are, and one dedup run does it but for T5 (its attention
    bias takes a gradient in a layout no ghost foresees: one retry). Before: the ghosts of
    tied weights lost their tie (GPT-2), and BERT, BART and LLaMA took a second run
    (an 80-layer LLaMA's costs: 6.5 s -> 2.8 s)."""
    pytest.importorskip("transformers")
    from tests.test_ecosystem_hf import batch, build

    inputs = batch()
    captured = capture(build(family), (), inputs)
    assert captured.method == "export"
    gm = captured.graph_module
    runs: list[bool] = []
    original = op_dedup._deduplicated_run
    monkeypatch.setattr(op_dedup, "_deduplicated_run", lambda *a, **k: runs.append(k["training"]) or original(*a, **k))
    views: list[str] = []
    view_ghost = DedupInterpreter._view_ghost
    monkeypatch.setattr(DedupInterpreter, "_view_ghost",
                        lambda self, node, *a: views.append(node.name) or view_ghost(self, node, *a))
    assert op_dedup.profile_costs(gm, (), inputs) == node_costs(gm, (), inputs)
    assert views and runs == ([True, True] if family == "t5" else [True])


def test_the_call_key_looks_through_views_to_how_a_value_is_used() -> None:
    """Query and key projections both go through a view and a transpose; the key's goes
    through one more before the matmul, so its gradient comes back transposed: their
    ``users_key`` differ (BERT's exported attention took a second dedup run before)."""
    from graphckpt.op_keys import users_key

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x).view(2, 3, 2, 4).transpose(1, 2)
            k = self.k(x).view(2, 3, 2, 4).transpose(1, 2)
            return q @ k.transpose(-1, -2)

    gm = fx.symbolic_trace(Attention())
    nodes = {node.name: node for node in gm.graph.nodes}
    keys = {name: users_key(nodes[name], gm.get_submodule) for name in ("q", "k")}
    assert keys["q"] != keys["k"]
    assert users_key(nodes["q"], gm.get_submodule, depth=0) == users_key(nodes["k"], gm.get_submodule, depth=0)
