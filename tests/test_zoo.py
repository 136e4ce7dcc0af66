"""Tests for the model zoo: build, fx-trace, numerics, backward, determinism."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from graphckpt.tools import zoo
from tests.torch_features import FX_TRACES_ZOO_GPT, NO_FX_ZOO_GPT

NAMES = ["mlp", "resnet", "gpt", "unet", "densenet"]
needs_fx_gpt = pytest.mark.skipif(not FX_TRACES_ZOO_GPT, reason=NO_FX_ZOO_GPT)
TRACED = [pytest.param(name, marks=needs_fx_gpt) if name == "gpt" else name for name in NAMES]


def test_registry_keys() -> None:
    assert list(zoo.ZOO) == NAMES
    assert zoo.names() == NAMES
    assert set(zoo.DEFAULT_BATCH) == set(NAMES)


def test_unknown_name_raises_keyerror_listing_names() -> None:
    with pytest.raises(KeyError) as info:
        zoo.make("nope")
    msg = str(info.value)
    assert "nope" in msg
    assert all(name in msg for name in NAMES)


@pytest.mark.parametrize("name", TRACED)
def test_trace_matches_eager_in_eval(name: str) -> None:
    model, inputs = zoo.make(name)
    assert isinstance(model, nn.Module)
    assert isinstance(inputs, tuple)
    assert all(isinstance(t, torch.Tensor) for t in inputs)
    gm = fx.symbolic_trace(model)
    model.eval()
    gm.eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("name", TRACED)
def test_forward_backward_trace_matches_eager_in_train(name: str) -> None:
    # Same seed before each run: dropout masks and BN batch stats must agree.
    model, inputs = zoo.make(name)
    gm = fx.symbolic_trace(copy.deepcopy(model))
    losses, grads = [], []
    for m in (model, gm):
        m.train()
        torch.manual_seed(123)
        loss = zoo.scalar_loss(m(*inputs))
        loss.backward()
        assert loss.dim() == 0 and torch.isfinite(loss)
        params = dict(m.named_parameters())
        assert all(p.grad is not None for p in params.values()), "unused param"
        losses.append(loss.detach())
        grads.append({k: p.grad for k, p in params.items()})
    torch.testing.assert_close(losses[0], losses[1])
    # GraphModule registers submodules in use order, so compare by name.
    assert grads[0].keys() == grads[1].keys()
    for k, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][k], msg=k)


@pytest.mark.parametrize("name", NAMES)
def test_make_is_deterministic(name: str) -> None:
    m1, x1 = zoo.make(name, seed=7)
    m2, x2 = zoo.make(name, seed=7)
    m3, _ = zoo.make(name, seed=8)
    for t1, t2 in zip(x1, x2, strict=True):
        assert torch.equal(t1, t2)
    sd1, sd2, sd3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert any(not torch.equal(sd1[k], sd3[k]) for k in sd1)


@pytest.mark.parametrize("name", ["resnet", "densenet"])
def test_batchnorm_running_stats(name: str) -> None:
    model, inputs = zoo.make(name)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns
    buffers = dict(model.named_buffers())
    assert any(k.endswith("running_mean") for k in buffers)
    assert any(k.endswith("num_batches_tracked") for k in buffers)
    before = bns[0].running_mean.clone()
    model.train()
    model(*inputs)
    assert not torch.equal(before, bns[0].running_mean)


def test_resnet_uses_inplace_relu() -> None:
    model, _ = zoo.make("resnet")
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    assert relus and all(r.inplace for r in relus)


@needs_fx_gpt
def test_gpt_shapes_mask_and_shorter_sequence() -> None:
    model, (tokens,) = zoo.make("gpt")
    assert tokens.dtype == torch.long
    assert tokens.shape == (zoo.DEFAULT_BATCH["gpt"], 32)
    assert model(tokens).shape == (zoo.DEFAULT_BATCH["gpt"], 32, 256)
    mask = model.blocks[0].attn.mask
    assert torch.equal(mask, torch.tril(torch.ones(32, 32)))
    # The traced graph keeps T symbolic: a shorter prompt works eager and traced.
    model.eval()
    gm = fx.symbolic_trace(model)
    short = tokens[:, :10]
    with torch.no_grad():
        out = model(short)
        assert out.shape == (tokens.shape[0], 10, 256)
        torch.testing.assert_close(gm(short), out, rtol=0, atol=0)
        # Causality: changing a later token leaves earlier logits unchanged.
        changed = tokens.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 256
        torch.testing.assert_close(model(changed)[:, :-1], model(tokens)[:, :-1])


def test_unet_has_long_skips() -> None:
    model, inputs = zoo.make("unet")
    gm = fx.symbolic_trace(model)
    cats = [n for n in gm.graph.nodes if n.target is torch.cat]
    assert len(cats) == 3
    assert model(*inputs).shape == inputs[0].shape


def test_make_kwargs_and_batch() -> None:
    model, (x,) = zoo.make("mlp", depth=3, width=16, batch=5)
    assert x.shape == (5, 16)
    assert len([m for m in model.modules() if isinstance(m, nn.Linear)]) == 3
    model, (x,) = zoo.make("gpt", batch=2, seq=8, vocab=50, layers=1, dropout=0.0)
    assert model(x).shape == (2, 8, 50)
    model, (x,) = zoo.make("densenet", layers=3, blocks=2, batch=2)
    assert model(x).shape == (2, 10)
    model, (x,) = zoo.make("resnet", widths=(8, 16), blocks_per_stage=2, batch=2)
    assert model(x).shape == (2, 10)
    model, (x,) = zoo.make("unet", levels=2, base=4, batch=1)
    assert model(x).shape == (1, 3, 32, 32)


def test_scalar_loss_containers() -> None:
    a, b = torch.ones(2, 3), torch.full((4,), 2.0)
    assert zoo.scalar_loss(a).item() == 1.0
    assert zoo.scalar_loss((a, b)).item() == 5.0
    assert zoo.scalar_loss({"a": a, "b": [b, None]}).item() == 5.0
    assert zoo.loss_fn is zoo.scalar_loss
    with pytest.raises(TypeError):
        zoo.scalar_loss(3)
