"""What a user would reach for instead of graphckpt, built as runnable variants of a model.

* :func:`sequential_anchor`: ``torch.utils.checkpoint.checkpoint_sequential`` with √n
  segments, where the model is an ``nn.Sequential`` chain or a thin wrapper around one.
* :func:`block_anchor`: per-block checkpointing as Hugging Face's
  ``gradient_checkpointing_enable()`` does it: every transformer layer (or, outside HF, every
  repeated block of the model) runs under non-reentrant ``torch.utils.checkpoint``.
* :func:`compile_anchor`: ``torch.compile`` with ``activation_memory_budget``, AOT
  autograd's min-cut partitioner recomputing to fit a fraction of its own estimate.

Each returns a :class:`Variant` to measure or a :class:`Skipped` saying why it does not
apply; none raises for a model it cannot handle.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from graphckpt.blocks import find_blocks
from graphckpt.tools.measure import infer_device, training_step
from graphckpt.torch_compat import activation_memory_budget
from passes.plan import Plan


@dataclass
class Variant:
    """One way of running a training step: a callable module and what produced it.

    ``plan_seconds`` is what building it cost a user: capture, costs, plan and codegen for
    graphckpt (the capture and costs shared by several plans are counted in each), compile
    time for torch.compile, nothing for the hand-placed anchors.
    """

    name: str
    module: Callable[..., Any]
    kind: str  # "eager" | "graphckpt" | "checkpoint_sequential" | "per-block" | "torch.compile"
    setting: str = ""
    plan: Plan | None = None
    budget: float | None = None
    plan_seconds: float | None = None
    predicted_extra_seconds: float | None = None  # graphckpt with measured op times: what its plan adds to a step
    caveat: str = ""  # why its step is not the model's step (gradients unlike eager's), if it is not


@dataclass
class Skipped:
    """A variant that could not be built, and why (shown as a note, never an error)."""

    name: str
    reason: str


# ---------------------------------------------------------------- checkpoint_sequential


def find_sequential(model: nn.Module) -> nn.Sequential | None:
    """The ``nn.Sequential`` the model is, or its only child when that is one; else None."""
    if isinstance(model, nn.Sequential):
        return model
    kids = list(model.children())
    if len(kids) == 1 and isinstance(kids[0], nn.Sequential):
        return kids[0]
    return None


def _same_forward(model: nn.Module, chain: nn.Sequential, inputs: tuple) -> bool:
    """Whether ``model(*inputs)`` is ``chain(*inputs)`` (same RNG seed, no grad)."""
    if chain is model:
        return True
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        expected = model(*inputs)
        torch.manual_seed(0)
        actual = chain(*inputs)
    return (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)
            and expected.shape == actual.shape and torch.allclose(expected, actual))


class SequentialCheckpoint(nn.Module):
    """``checkpoint_sequential(chain, segments, x)`` as a module (non-reentrant)."""

    def __init__(self, chain: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.chain = chain
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


def _plain_chain(model: nn.Module, inputs: tuple) -> nn.Sequential | Skipped:
    """The chain ``checkpoint_sequential`` can run in place of ``model``, or why there is none."""
    name = "checkpoint_sequential"
    chain = find_sequential(model)
    if chain is None:
        return Skipped(name, "the model is not an nn.Sequential chain (nor a wrapper of one)")
    if len(inputs) != 1:
        return Skipped(name, "checkpoint_sequential takes a single input")
    if not _same_forward(model, chain, inputs):
        return Skipped(name, "the model's forward does more than run its Sequential")
    return chain


def sequential_anchor(model: nn.Module, inputs: tuple, segments: int | None = None) -> Variant | Skipped:
    """torch's ``checkpoint_sequential`` with ``segments`` (default √n) segments, where the
    model is a plain chain; :class:`Skipped` saying why not otherwise."""
    chain = _plain_chain(model, inputs)
    if isinstance(chain, Skipped):
        return chain
    count = segments or max(1, round(math.sqrt(len(chain))))
    return Variant(f"checkpoint_sequential {count}", SequentialCheckpoint(chain, count),
                   "checkpoint_sequential", f"{count} segments")


# ---------------------------------------------------------------- per-block checkpointing


class CheckpointedBlock(nn.Module):
    """``block(*args)`` under non-reentrant ``torch.utils.checkpoint``: its activations are
    dropped after forward and recomputed in backward (RNG state replayed, as HF does)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.block(*args, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face ``PreTrainedModel`` in ``model`` that supports checkpointing, if any."""
    for module in model.modules():
        if getattr(module, "supports_gradient_checkpointing", False) and hasattr(module, "gradient_checkpointing_enable"):
            return module
    return None


def block_anchor(model: nn.Module, inputs: tuple) -> Variant | Skipped:
    """Per-block checkpointing on a copy of ``model``: HF's ``gradient_checkpointing_enable``
    (non-reentrant) for Hugging Face models; else every repeated block (:func:`find_blocks`)
    wrapped in :class:`CheckpointedBlock`; for a chain of single layers, one
    ``checkpoint_sequential`` segment per parametrised layer.

    Unlike graphckpt, ``torch.utils.checkpoint`` re-runs BatchNorm in training mode, so
    running statistics are updated twice per step; the copy keeps that away from ``model``.
    """
    name = "per-block"
    clone = copy.deepcopy(model)
    hf = _hf_model(clone)
    if hf is not None:
        enable = getattr(hf, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return Variant(name, clone, name, "HF gradient_checkpointing_enable")
    blocks = list(find_blocks(clone))
    if blocks:
        for container, child in blocks:
            container.register_module(child, CheckpointedBlock(container.get_submodule(child)))
        return Variant(name, clone, name, f"{len(blocks)} blocks")
    chain = _plain_chain(clone, inputs)
    if isinstance(chain, Skipped):
        return Skipped(name, "no repeated blocks found and " + chain.reason)
    layers = sum(1 for layer in chain if any(True for _ in layer.parameters()))
    return Variant(name, SequentialCheckpoint(chain, max(layers, 1)), name, f"{layers} layers")


# ---------------------------------------------------------------- torch.compile


_fresh_ids = itertools.count()


def _fresh_forward(model: nn.Module) -> Callable[..., Any]:
    """``model(*args)`` in a function with a code object of its own, so dynamo caches each
    compiled anchor separately (its compile-time budget is not part of dynamo's guards)."""
    def forward(*args: Any) -> Any:
        return model(*args)

    forward.__code__ = forward.__code__.replace(co_name=f"graphckpt_anchor_{next(_fresh_ids)}")
    return forward


def compile_anchor(model: nn.Module, inputs: tuple, budget: float, loss_fn: Callable[[Any], torch.Tensor],
                   backend: str = "aot_eager") -> Variant | Skipped:
    """``torch.compile(backend=backend)`` under ``activation_memory_budget=budget``, compiled
    (forward and backward) right here, while the budget is in force."""
    name = f"torch.compile {backend} {budget:g}"
    try:
        start = time.perf_counter()
        compiled = torch.compile(_fresh_forward(model), backend=backend)
        with activation_memory_budget(budget):
            training_step(compiled, inputs, loss_fn)()
        seconds = time.perf_counter() - start
    except Exception as error:  # any compile failure: note it and measure the rest
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Skipped(name, f"torch.compile failed: {type(error).__name__}: {first[:160]}")
    gap = gradient_gap(model, compiled, inputs, loss_fn)
    caveat = (f"its gradients are not the model's: up to {gap:.1e} off eager's (relative), the same seed; "
              "a known cause: the budget partitioner recomputes random ops such as dropout with fresh "
              "randomness in backward (pytorch/pytorch#190758)") if gap > GRADIENT_TOLERANCE else ""
    return Variant(name, compiled, "torch.compile", f"{backend}, budget {budget:g}", budget=budget,
                   plan_seconds=seconds, caveat=caveat)


GRADIENT_TOLERANCE = 1e-4  # relative: far above the order in which kernels add, far below a wrong dropout mask


def _gradients(model: nn.Module, forward: Callable[..., Any], inputs: tuple,
               loss_fn: Callable[[Any], torch.Tensor], seed: int) -> list[torch.Tensor | None]:
    """The gradients one step of ``forward`` leaves on ``model``'s parameters, from ``seed``
    (the global RNG restored after, the gradients cleared)."""
    device = infer_device(model, inputs)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        training_step(forward, inputs, loss_fn)()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def gradient_gap(model: nn.Module, forward: Callable[..., Any], inputs: tuple,
                 loss_fn: Callable[[Any], torch.Tensor], seed: int = 0) -> float:
    """How far ``forward``'s gradients on ``model``'s parameters are from the model's own
    after one step from the same seed: the largest ``‖g - g_eager‖ / ‖g_eager‖`` over
    parameters (0 when they agree; 1 when ``forward`` leaves no gradient where eager does).
    A variant that draws other dropout masks in backward than in forward trains something
    other than the model, and its step time is no benchmark for one that does not."""
    expected = _gradients(model, model, inputs, loss_fn, seed)
    found = _gradients(model, forward, inputs, loss_fn, seed)
    gaps = [0.0 if e is None and f is None else 1.0 if e is None or f is None
            else float((f - e).norm() / e.norm().clamp_min(1e-30)) for e, f in zip(expected, found, strict=True)]
    return max(gaps, default=0.0)
