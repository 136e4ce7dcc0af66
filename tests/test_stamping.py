"""Export's block stamping (:mod:`graphckpt.stamping`): a model with a long run of like
layers is exported three layers deep and the rest stamped. The stamped graph must be the
graph a whole export gives, node for node, and anything that is not a copy of its
neighbours must be exported whole."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import fx, nn

import graphckpt
from graphckpt import stamping
from graphckpt.capture import _export_whole, block_paths, capture, node_blocks, trace_export
from tests.equivalence import assert_trains_like, fresh_pair


def described(graph_module: fx.GraphModule) -> list[tuple]:
    """The graph node by node: op, target, and arguments with each node named by its place
    (a ``get_attr`` by its target): equal lists are the same computation in the same order."""
    nodes = [n for n in graph_module.graph.nodes if n.op != "get_attr"]
    place = {n: i for i, n in enumerate(nodes)}

    def name(n: fx.Node) -> object:
        return ("attribute", n.target) if n.op == "get_attr" else ("node", place[n])

    return [(n.op, str(n.target), fx.node.map_arg(n.args, name), fx.node.map_arg(n.kwargs, name)) for n in nodes]


def stamped_and_whole(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule | None, fx.GraphModule]:
    return stamping.export_stamped(model, args, kwargs, _export_whole), _export_whole(model, args, kwargs)


@pytest.mark.parametrize("family", ["bart", "bert", "gpt2", "llama", "t5"])
def test_stamped_hugging_face_exports_are_the_whole_export(family: str) -> None:
    """Six layers per stack (BART and T5: encoder and decoder), three traced: the stamped
    graph is the whole export's node for node, reading the model's own tensors under their
    own names; T5's first block, which makes the position bias, is traced, not stamped."""
    pytest.importorskip("transformers")
    from tests.test_ecosystem_hf import batch, build

    model, inputs = build(family, layers=6), batch()
    stamped, whole = stamped_and_whole(model, (), inputs)
    assert stamped is not None
    assert set(stamped.meta["graphckpt_stamped"].values()) == {3}
    assert described(stamped) == described(whole)
    state = model.state_dict()
    assert set(stamped.state_dict()) == set(state)
    assert all(stamped.state_dict()[key].data_ptr() == tensor.data_ptr() for key, tensor in state.items())


def test_a_stamped_capture_rewrites_and_trains_like_eager() -> None:
    """The whole pipeline on a stamped capture: a budgeted plan trains like eager."""
    pytest.importorskip("transformers")
    from tests.test_ecosystem_hf import batch, build

    reference, model = fresh_pair(build("llama", layers=6))
    inputs = batch()
    rewritten = graphckpt.rewrite(model, (), example_kwargs=inputs, budget=0.5)
    assert rewritten.segments
    assert_trains_like(reference, model, rewritten, (), inputs)


class Block(nn.Module):
    """Linear, BatchNorm (running statistics in the graph) and ReLU, with a residual."""

    def __init__(self, width: int, layer_idx: int, odd: bool = False) -> None:
        super().__init__()
        self.layer_idx, self.odd = layer_idx, odd
        self.linear, self.norm = nn.Linear(width, width), nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.linear(x)).relu()
        return x + (2 * y if self.odd else y)


class Stack(nn.Module):
    """An input layer, ``depth`` blocks and a head, in one ``Sequential`` (so the blocks
    are not all of its children); ``between`` scales after each block, outside them."""

    def __init__(self, depth: int, width: int = 8, between: bool = False, odd_every: int = 0) -> None:
        super().__init__()
        blocks = [Block(width, i, odd=bool(odd_every) and i % odd_every == 1) for i in range(depth)]
        self.body = nn.Sequential(nn.Linear(width, width), *blocks, nn.Linear(width, 2))
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = layer(x) * 0.5 if self.between and isinstance(layer, Block) else layer(x)
        return x


def test_a_sequential_run_with_other_children_is_stamped_and_updates_every_running_statistic() -> None:
    """Blocks 1..8 of a ``Sequential`` whose first and last children are not blocks: the
    head keeps its name, and a training step updates every block's BatchNorm statistics as
    eager does. Capturing changes no running statistic (the check against eager puts them
    back)."""
    torch.manual_seed(0)
    model, x = Stack(depth=8), torch.randn(16, 8)
    before = {name: b.clone() for name, b in model.named_buffers()}
    stamped, whole = stamped_and_whole(model, (x,), {})
    assert stamped is not None and stamped.meta["graphckpt_stamped"] == {"body": 5}
    assert described(stamped) == described(whole)
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())
    reference, model = fresh_pair(model)
    assert_trains_like(reference, model, stamped, (x,))


def test_a_model_that_is_a_sequential_of_blocks_is_stamped() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(8, i) for i in range(7)])
    stamped, whole = stamped_and_whole(model, (torch.randn(4, 8),), {})
    assert stamped is not None and stamped.meta["graphckpt_stamped"] == {"": 4}
    assert described(stamped) == described(whole)


@pytest.mark.parametrize("odd_every", [2, 3])
def test_blocks_that_alternate_are_stamped_per_phase(odd_every: int) -> None:
    """Every second (third) block doubles its output, as layers alternating sliding-window and
    global attention differ: a run with that period, one template per phase, the whole
    export's graph node for node."""
    torch.manual_seed(0)
    model, x = Stack(depth=14, odd_every=odd_every), torch.randn(16, 8)
    (run,) = stamping.stampable_runs(model)
    assert run.period == odd_every
    stamped, whole = stamped_and_whole(model, (x,), {})
    assert stamped is not None and described(stamped) == described(whole)


def test_blocks_that_differ_without_a_period_are_not_stamped() -> None:
    """One block unlike the others: no run. Blocks that differ only in their layer index: a
    run. Too few blocks to stamp three: none."""
    odd_one = Stack(depth=8)
    odd_one.body[5].odd = True
    assert stamping.stampable_runs(odd_one) == []
    assert [run.container for run in stamping.stampable_runs(Stack(depth=8))] == ["body"]
    assert stamping.stampable_runs(Stack(depth=5)) == []


def test_gemma2_alternating_attention_is_stamped_per_phase() -> None:
    """Gemma 2 alternates sliding-window and global attention layer by layer (attributes
    ``sliding_window`` and ``layer_type`` differ): period 2, the whole export's graph."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(num_hidden_layers=9, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=100,
                                       sliding_window=8, use_cache=False)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).train()
    from tests.test_ecosystem_hf import batch

    inputs = batch()
    (run,) = stamping.stampable_runs(model)
    assert run.period == 2
    stamped, whole = stamped_and_whole(model, (), inputs)
    assert stamped is not None and described(stamped) == described(whole)


class CountingBlock(Block):
    """A block whose layer index changes what it computes: attributes alike, code not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 3 if self.layer_idx == 6 else y


def test_what_stamping_cannot_copy_is_exported_whole() -> None:
    """A scale between blocks, outside them (the layout check refuses it), and a block whose
    code reads its layer index (only the check against eager sees it): ``export_stamped``
    gives up and the capture is the whole export."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    scaled = Stack(depth=8, between=True)
    counting = Stack(depth=8)
    counting.body = nn.Sequential(*[CountingBlock(8, i) for i in range(8)])
    for model in (scaled, counting):
        assert stamping.stampable_runs(model), "the blocks look alike"
        stamped, whole = stamped_and_whole(model, (x,), {})
        assert stamped is None
        assert described(trace_export(model, (x,), {})) == described(whole)


def test_capture_of_an_exported_hugging_face_model_stamps_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from tests.test_ecosystem_hf import batch, build

    model = build("gpt2", layers=7)
    captured = capture(model, (), batch())
    assert captured.method == "export" and captured.graph_module.meta["graphckpt_stamped"] == {"transformer.h": 4}
    # stamped nodes carry their own layer's module stack: the blocks strategy sees seven like layers
    per_block = Counter(node_blocks(captured.graph_module, block_paths(model)).values())
    assert len({per_block[f"transformer.h.{i}"] for i in range(7)}) == 1 and per_block["transformer.h.6"] > 0
    monkeypatch.setenv(stamping.STAMP_ENV, "0")
    assert "graphckpt_stamped" not in capture(model, (), batch()).graph_module.meta


def _deepened(name: str) -> tuple[nn.Module, tuple, dict]:
    """Corpus entry ``name`` rebuilt with 7 layers per stack (5 more blocks per stage)."""
    from tests.corpus.entries import ENTRIES

    model, args, kwargs = ENTRIES[name].build()
    settings = model.config.to_dict()
    for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                "num_decoder_layers"):
        if key in settings:
            settings[key] = 7
    if "depths" in settings:
        settings["depths"] = [depth + 5 for depth in settings["depths"]]
    settings.pop("layer_types", None)  # derived again from the layer count
    config = type(model.config)(**settings)
    torch.manual_seed(0)
    deep = type(model)(config).train()
    deep.config._attn_implementation = model.config._attn_implementation
    return deep, args, kwargs


def _hf_corpus() -> list[str]:
    try:
        from tests.corpus.entries import ENTRIES
    except ImportError:
        return []
    return [name for name, entry in ENTRIES.items() if entry.hf]


@pytest.mark.slow
@pytest.mark.parametrize("name", _hf_corpus())
def test_deepened_corpus_models_stamp_to_the_whole_export(name: str) -> None:
    """Every Hugging Face corpus architecture at 7 layers: stamped, the graph is the whole
    export's node for node; not stamped, only where its blocks are not alike (MobileNetV2's
    inverted residuals change width, ALBERT calls one shared layer, ConvNeXt's stochastic
    depth drops each block with its own probability)."""
    model, args, kwargs = _deepened(name)
    stamped, whole = stamped_and_whole(model, args, kwargs)
    if stamped is None:
        assert name in {"mobilenet_v2", "albert", "convnext"}, "stamping refused"
    else:
        assert described(stamped) == described(whole)


def test_a_stamped_capture_has_its_constant_masks_folded_in_every_layer() -> None:
    """Masks are folded before stamping (the copies inherit it): without padding, every
    attention call of a 7-layer LLaMA is causal with no mask tensor, stamped layers too."""
    pytest.importorskip("transformers")
    from graphckpt.masks import SDPA
    from tests.test_ecosystem_hf import batch, build

    inputs = {key: value for key, value in batch().items() if key != "attention_mask"}
    graph_module = trace_export(build("llama", layers=7), (), inputs)
    assert graph_module.meta["graphckpt_stamped"] == {"model.layers": 4}
    attention = [n for n in graph_module.graph.nodes if n.target is SDPA]
    assert len(attention) == 7
    assert all(len(n.args) <= 3 or n.args[3] is None for n in attention)
