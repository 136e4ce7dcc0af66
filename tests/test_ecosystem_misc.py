"""What training loops around a rewritten module do: autocast, ``torch.autograd.grad``,
gradient accumulation, train/eval switching, saving state dicts; and the snippets of
docs/ecosystem.md, run as written."""

from __future__ import annotations

import copy
import os
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import graphckpt
from graphckpt.tools import zoo
from tests.equivalence import ATOL, RTOL, assert_trains_like, fresh_pair
from tests.torch_features import FSDP2_ON_CPU, NO_FSDP2_ON_CPU

DOCS = Path(__file__).resolve().parent.parent / "docs" / "ecosystem.md"


class DropNormNet(nn.Module):
    """Linear / BatchNorm / Dropout blocks: eval() changes what every block computes."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
                                                    nn.Dropout(0.25)) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = RTOL,
                 atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=rtol, atol=atol, msg=name)


# ---------------------------------------------------------------------------- autocast

def test_cpu_bf16_autocast_grads_equal_eager_with_nested_segments() -> None:
    """Recomputes run under the autocast state of their forward (torch checkpoint replays it):
    a recompute in fp32 would make tensors of another dtype, which checkpoint rejects, and
    bf16 grads would differ."""
    reference, model = fresh_pair(zoo.make("mlp", depth=24, width=64, batch=32)[0])
    x = torch.randn(32, 64)
    rewritten = graphckpt.rewrite(model, (x,), budget=0.25)
    assert any(segment.depth >= 2 for segment in rewritten.meta["graphckpt_plan"].segments), "expected nesting"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rewritten(x).dtype == torch.bfloat16
        assert_trains_like(reference, model, rewritten, (x,), loss_fn=zoo.scalar_loss)
    nested = [segment for name, segment in rewritten.segments if segment.enclosing is not None]
    assert nested and all(segment.recomputations >= 1 for segment in nested)


def test_cpu_bf16_autocast_under_the_compile_backend() -> None:
    torch._dynamo.reset()
    model, (x,) = zoo.make("mlp", depth=12, width=32, batch=16)
    reference = copy.deepcopy(model)
    backend = graphckpt.backend()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_trains_like(reference, model, torch.compile(model, backend=backend), (x,), loss_fn=zoo.scalar_loss)
    assert backend.compiled and backend.compiled[0].segments
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_grads_equal_eager(dtype: torch.dtype) -> None:
    reference, model = fresh_pair(zoo.make("gpt", batch=2)[0].cuda())
    idx = torch.randint(0, 64, (2, 32), device="cuda")
    rewritten = graphckpt.rewrite(model, (idx,), budget=0.3)
    with torch.autocast("cuda", dtype=dtype):
        assert_trains_like(reference, model, rewritten, (idx,), loss_fn=zoo.scalar_loss)


# ------------------------------------------------------------------ training-loop idioms

def _same_grads(grads, depth: int, width: int, batch: int) -> nn.Module:
    """Compare ``grads(module, owner, inputs)`` of eager and of the rewrite (``owner`` holds
    the parameters); returns the model the rewrite shares."""
    reference, model = fresh_pair(zoo.make("mlp", depth=depth, width=width, batch=batch)[0])
    rewritten = graphckpt.rewrite(model, (torch.randn(batch, width),), strategy="sqrt")
    x = torch.randn(batch, width)
    pairs = ((reference, reference), (rewritten, model))
    found = [grads(module, owner, x.clone().requires_grad_()) for module, owner in pairs]
    for actual, expected in zip(found[1], found[0], strict=True):
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    return model


def test_autograd_grad_through_a_rewritten_module() -> None:
    def grads(module, owner, inputs):
        return torch.autograd.grad(module(inputs).pow(2).mean(), [inputs, *owner.parameters()])

    model = _same_grads(grads, depth=10, width=16, batch=8)
    assert all(p.grad is None for p in model.parameters()), "autograd.grad must not touch .grad"


def test_double_backward_through_a_rewritten_module() -> None:
    def penalty_grads(module, owner, inputs):
        (grad,) = torch.autograd.grad(module(inputs).pow(2).mean(), inputs, create_graph=True)
        return torch.autograd.grad(grad.pow(2).sum(), list(owner.parameters()))

    _same_grads(penalty_grads, depth=6, width=8, batch=4)


def test_gradient_accumulation_over_micro_batches() -> None:
    reference, model = fresh_pair(DropNormNet(depth=4))
    rewritten = graphckpt.rewrite(model, (torch.randn(8, 16),), strategy="sqrt", segments=2)
    micro_batches = [torch.randn(8, 16) for _ in range(3)]
    for module in (reference, rewritten):
        for seed, batch in enumerate(micro_batches):
            torch.manual_seed(seed)
            (module(batch).pow(2).mean() / len(micro_batches)).backward()
    _assert_same(_grads(model), _grads(reference))
    _assert_same(dict(model.named_buffers()), dict(reference.named_buffers()))


def test_train_eval_switching() -> None:
    reference, model = fresh_pair(DropNormNet())
    x = torch.randn(8, 16)
    rewritten = graphckpt.rewrite(model, (x,), strategy="sqrt", segments=3)
    assert_trains_like(reference, model, rewritten, (x,), seed=1)
    rewritten.eval()
    reference.eval()
    assert not any(m.training for m in model.modules() if m is not model), "eval() reaches the model's layers"
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), reference(x), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(rewritten(x), rewritten(x))  # no dropout in eval
    rewritten.train()
    reference.train()
    model.zero_grad()
    reference.zero_grad()
    assert_trains_like(reference, model, rewritten, (x,), seed=2)


def test_state_dict_save_and_load_between_original_and_rewritten(tmp_path: Path) -> None:
    model, (x,) = zoo.make("resnet", batch=2, widths=(8, 16))
    rewritten = graphckpt.rewrite(model, (x,))
    assert set(rewritten.state_dict()) == set(model.state_dict())  # the order differs: see below
    zoo.scalar_loss(rewritten(x)).backward()  # running statistics move
    torch.save(rewritten.state_dict(), tmp_path / "rewritten.pt")
    fresh, _ = zoo.make("resnet", batch=2, widths=(8, 16), seed=1)
    fresh.load_state_dict(torch.load(tmp_path / "rewritten.pt"))
    torch.testing.assert_close(fresh.state_dict(), model.state_dict())

    other, _ = zoo.make("resnet", batch=2, widths=(8, 16), seed=2)
    torch.save(other.state_dict(), tmp_path / "original.pt")
    rewritten.load_state_dict(torch.load(tmp_path / "original.pt"))
    torch.testing.assert_close(model.state_dict(), other.state_dict())
    other.eval()
    rewritten.eval()
    with torch.no_grad():
        torch.testing.assert_close(rewritten(x), other(x), rtol=RTOL, atol=ATOL)


def test_parameter_order_matches_the_model() -> None:
    model, (x,) = zoo.make("resnet", batch=2, widths=(8, 16))
    rewritten = graphckpt.rewrite(model, (x,))
    assert [name for name, _ in rewritten.named_parameters()] == [name for name, _ in model.named_parameters()]


# -------------------------------------------------------------------------- the docs

def snippets() -> dict[str, str]:
    """``section title -> its python code block`` of docs/ecosystem.md."""
    found = {}
    for section in re.split(r"^### ", DOCS.read_text(), flags=re.MULTILINE)[1:]:
        title = section.splitlines()[0].strip()
        blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
        if blocks:
            found[title] = "\n".join(blocks)
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_docs_have_every_snippet() -> None:
    assert list(snippets()) == SNIPPETS


SNIPPETS = ["Hugging Face transformers", "Hugging Face Trainer", "torch.compile", "DDP and FSDP2", "Module hooks"]


@pytest.mark.parametrize("title", SNIPPETS)
def test_docs_snippet_runs(title: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each snippet runs as written: in a scratch directory, the DDP one as rank 0 of a
    world of one (the environment torchrun would set)."""
    if title.startswith("Hugging Face"):
        pytest.importorskip("transformers")
    if title == "Hugging Face Trainer":
        pytest.importorskip("accelerate")  # what transformers' Trainer needs
    if title.startswith("DDP") and not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    if title.startswith("DDP") and not FSDP2_ON_CPU:
        pytest.skip(NO_FSDP2_ON_CPU)
    monkeypatch.chdir(tmp_path)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    torch._dynamo.reset()
    try:
        exec(compile(snippets()[title], f"{DOCS}:{title}", "exec"), {"__name__": "docs_snippet"})
    finally:
        torch._dynamo.reset()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    saved = {"Hugging Face transformers": "gpt2-trained", "Hugging Face Trainer": "llama-trained"}.get(title)
    if saved:
        assert (tmp_path / saved).is_dir() and os.listdir(tmp_path / saved)
