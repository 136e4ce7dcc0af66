"""What a rewritten module runs: segments wired into autograd for recomputation.

A :class:`Segment` runs its body through non-reentrant ``torch.utils.checkpoint``: forward
keeps only the segment's inputs, backward runs the body again (same RNG state, same
autocast state) to get what it needs. While recomputing, normalization layers use batch
statistics without updating their running statistics again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from graphckpt.profile import EXPENSIVE_OPS

_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def frozen_running_stats(norms: Sequence[_NormBase]) -> Iterator[None]:
    """Norm layers run exactly as in forward, but their running statistics are updated on
    scratch copies that are dropped afterwards: a recompute must not count a batch twice.

    (Turning ``track_running_stats`` off instead would change which tensors autograd saves,
    which checkpointing rejects.)
    """
    originals = [{name: getattr(norm, name) for name in _RUNNING_STATS} for norm in norms]
    try:
        for norm, buffers in zip(norms, originals, strict=True):
            for name, buffer in buffers.items():
                if buffer is not None:
                    setattr(norm, name, buffer.clone())
        yield
    finally:
        for norm, buffers in zip(norms, originals, strict=True):
            for name, buffer in buffers.items():
                setattr(norm, name, buffer)


def _wants_grad(args: Sequence[Any], module: nn.Module) -> bool:
    """Whether backward may run through this call (so recomputation is worth arranging)."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) or any(
        p.requires_grad for p in module.parameters())


class Segment(nn.Module):
    """One recomputed segment of a rewritten module.

    The body (an fx ``GraphModule``) is held as a plain attribute, not a submodule: its
    modules belong to the rewritten module, so parameters and ``state_dict`` keys stay
    those of the original model.
    """

    def __init__(self, body: fx.GraphModule, *, nodes: Sequence[str], inputs: Sequence[str],
                 outputs: Sequence[str], kept_bytes: float, saved_inside: Sequence[str] = ()) -> None:
        super().__init__()
        object.__setattr__(self, "body", body)
        self.saved_inside = tuple(saved_inside)
        self.nodes = tuple(nodes)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.kept_bytes = kept_bytes
        self.recomputations = 0

    def norms(self) -> list[_NormBase]:
        """Normalization layers the body calls that keep running statistics."""
        return [m for m in self.body.modules() if isinstance(m, _NormBase) and m.track_running_stats]

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        if not self.saved_inside:
            return contextlib.nullcontext(), self._recomputing()
        forward, recompute = create_selective_checkpoint_contexts(_keep_expensive)
        return forward, self._recomputing(recompute)

    @contextlib.contextmanager
    def _recomputing(self, selective: contextlib.AbstractContextManager | None = None) -> Iterator[None]:
        self.recomputations += 1
        with frozen_running_stats(self.norms()), selective or contextlib.nullcontext():
            yield

    def forward(self, *args: Any) -> Any:
        if not _wants_grad(args, self.body):
            return self.body(*args)
        return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=self._contexts)

    def extra_repr(self) -> str:
        kept = f"; keeps matmul/conv outputs {', '.join(self.saved_inside)} from forward" if self.saved_inside else ""
        return (f"recomputes {len(self.nodes) - len(self.saved_inside)} nodes ({self.nodes[0]} .. {self.nodes[-1]}) "
                f"in backward; keeps {', '.join(self.inputs)}{kept}")


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing policy: keep matmul and convolution outputs from forward."""
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket.__name__ in EXPENSIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE
