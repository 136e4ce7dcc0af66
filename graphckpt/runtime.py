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


def _wants_grad(args: Sequence[Any]) -> bool:
    """Whether an input brings gradients into this call."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


class Segment(nn.Module):
    """One recomputed segment of a rewritten module.

    The body (an fx ``GraphModule``) is held as a plain attribute, not a submodule: its
    modules belong to the rewritten module, so parameters and ``state_dict`` keys stay
    those of the original model.
    """

    def __init__(self, body: fx.GraphModule, *, nodes: Sequence[str], inputs: Sequence[str],
                 outputs: Sequence[str], kept_bytes: float, saved_inside: Sequence[str] = (),
                 replays_rng: bool = True) -> None:
        super().__init__()
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "enclosing", None)  # the segment whose body calls this one, if nested
        self.recomputing = 0
        self.saved_inside = tuple(saved_inside)
        self.nodes = tuple(nodes)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.kept_bytes = kept_bytes
        self.recomputations = 0
        self.replays_rng = replays_rng  # keep the RNG state for recompute (5 KiB a segment on CPU)
        # Found once, not on every call: the body's modules do not change after codegen.
        called = list(self.called_modules())
        self.called_parameters = tuple(p for m in called for p in m.parameters(recurse=False))
        self.norm_layers = [m for m in called if isinstance(m, _NormBase) and m.track_running_stats]

    def called_modules(self) -> Iterator[nn.Module]:
        """The modules the body calls, those of nested segments included."""
        for module in self.body.modules():
            if isinstance(module, Segment):
                yield from module.called_modules()
            else:
                yield module

    def norms(self) -> list[_NormBase]:
        """Normalization layers the body (or a nested segment) calls that keep running statistics."""
        return self.norm_layers

    def _trains_parameters(self) -> bool:
        return any(p.requires_grad for p in self.called_parameters)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        # Nested in a segment's first forward, nothing is kept: matmul outputs are kept from
        # the enclosing segment's recompute, not held through the whole step.
        enclosing_recomputes = self.enclosing is None or self.enclosing.recomputing
        if not self.saved_inside or not enclosing_recomputes:
            return contextlib.nullcontext(), self._recomputing()
        forward, recompute = create_selective_checkpoint_contexts(_keep_expensive)
        return forward, self._recomputing(recompute)

    def _recomputing(self, selective: contextlib.AbstractContextManager | None = None) -> _Recomputing:
        return _Recomputing(self, selective)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled() or not (_wants_grad(args) or self._trains_parameters()):
            return self.body(*args)
        return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=self.replays_rng,
                          context_fn=self._contexts)

    def extra_repr(self) -> str:
        kept = f"; keeps matmul/conv outputs {', '.join(self.saved_inside)} from forward" if self.saved_inside else ""
        return (f"recomputes {len(self.nodes) - len(self.saved_inside)} nodes ({self.nodes[0]} .. {self.nodes[-1]}) "
                f"in backward; keeps {', '.join(self.inputs)}{kept}")


class _Recomputing:
    """What surrounds every recompute of a segment: counted, running statistics frozen, the
    selective policy on. Re-enterable, since a double backward recomputes twice."""

    def __init__(self, segment: Segment, selective: contextlib.AbstractContextManager | None) -> None:
        self.segment = segment
        self.selective = selective
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        self.segment.recomputations += 1
        self.segment.recomputing += 1
        self.stack.enter_context(frozen_running_stats(self.segment.norms()))
        if self.selective is not None:
            self.stack.enter_context(self.selective)

    def __exit__(self, *exc_info: object) -> None:
        self.segment.recomputing -= 1
        self.stack.close()


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing policy: keep matmul and convolution outputs from forward."""
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket.__name__ in EXPENSIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE
