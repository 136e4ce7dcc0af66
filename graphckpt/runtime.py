"""What a rewritten module runs: segments wired into autograd for recomputation.

A :class:`SegmentModule` runs its body through non-reentrant ``torch.utils.checkpoint``: forward
keeps only the segment's inputs, backward runs the body again (same RNG state, same
autocast state) until it has what it needs. While recomputing, state updates go to scratch
copies, so the model's state moves once per step: normalization layers the body calls
update copies of their running statistics (:func:`frozen_running_stats`), and buffers the
body is passed and updates in place (running statistics of an export-captured
``aten.batch_norm``, a batch counter's ``add_``: :mod:`graphckpt.state`) are replaced by
copies (:func:`scratch_state`).

Selective segments keep the values their plan names (``saved_inside``) from forward instead
of recomputing them (torch's selective checkpointing contexts): each call is recorded, and
its policy kept to, as :mod:`graphckpt.segment_calls` says.

Rematerialized inputs (:mod:`passes.remat`) go to checkpoint by reference (:class:`_Dropped`):
forward runs on the real tensor, then drops it; the recompute first makes a detached copy from
the sources under ``no_grad`` (``segment_i_remat`` in ``print(gm.code)``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from graphckpt.dropping import autocast_uncached
from graphckpt.segment_calls import RunningBody, SegmentCall, innermost_running, refill_contexts
from graphckpt.state import StateInput, frozen_running_stats, running_stat_norms, scratch_state, unwrap_state
from graphckpt.torch_compat import NormBase, clear_selective_cache, profiled_range, selective_cache_missed


class _Dropped:
    """A rematerialized input handed to ``checkpoint`` by reference, so checkpoint does not
    keep it: ``tensor`` is the forward value while forward runs the body and ``None`` after,
    and a recompute makes a copy from the segment's sources (:meth:`SegmentModule._inputs`)."""

    __slots__ = ("copy", "requires_grad", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.copy: Any = None  # made when a recompute starts, taken by the body
        self.requires_grad = isinstance(tensor, torch.Tensor) and tensor.requires_grad


def _wants_grad(args: Sequence[Any]) -> bool:
    """Whether an input brings gradients into this call."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


class SegmentModule(nn.Module):
    """One recomputed segment of a rewritten module.

    The body (an fx ``GraphModule``) is held as a plain attribute, not a submodule: its
    modules belong to the rewritten module, so parameters and ``state_dict`` keys stay
    those of the original model. ``label`` (its name in ``print(gm.code)``) names its
    forward and its recomputes in a profiler's trace: ``graphckpt segment_1``,
    ``graphckpt segment_1 recompute``.
    """

    label = "segment"

    def __init__(self, body: fx.GraphModule, *, nodes: Sequence[str], inputs: Sequence[str],
                 outputs: Sequence[str], kept_bytes: float, saved_inside: Sequence[str] = (),
                 reruns: Sequence[str], replays_rng: bool = True, state_inputs: Sequence[int] = (),
                 kept_whole: Sequence[str] = (), remat: fx.GraphModule | None = None,
                 remat_inputs: Sequence[int] = (), remat_sources: Sequence[int] = (),
                 remat_names: Sequence[str] = ()) -> None:
        super().__init__()
        object.__setattr__(self, "body", body)
        # Rematerialized inputs (passes.remat): ``remat`` computes the inputs at positions
        # ``remat_inputs`` from the call's arguments at ``remat_sources`` (inputs, then the
        # extra sources the call is given after them), without gradients.
        object.__setattr__(self, "remat", remat)
        self.remat_inputs, self.remat_sources = tuple(remat_inputs), tuple(remat_sources)
        self.remat_names = tuple(remat_names)  # the sources' value names, for extra_repr
        self.kept_whole = tuple(kept_whole)  # of saved_inside: values kept whole, not matmul/conv outputs
        object.__setattr__(self, "enclosing", None)  # the segment whose body calls this one, if nested
        self.saved_inside = tuple(saved_inside)
        self.nodes = tuple(nodes)
        self.reruns = tuple(reruns)  # what its recompute runs (it stops once backward has what it saved)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.kept_bytes = kept_bytes
        self.recomputations = 0
        self.replays_rng = replays_rng  # keep the RNG state for recompute (5 KiB a segment on CPU)
        self.state_inputs = tuple(state_inputs)  # inputs it updates in place (buffers): copied in a recompute
        # Found once, not on every call: the body's modules do not change after codegen.
        called = list(self.called_modules())
        self.called_parameters = tuple(p for m in called for p in m.parameters(recurse=False))
        self.norm_layers = running_stat_norms(called)
        self.remat_norms = running_stat_norms(remat.modules() if remat is not None else ())

    def called_modules(self) -> Iterator[nn.Module]:
        """The modules the body calls, those of nested segments included."""
        for module in self.body.modules():
            if isinstance(module, SegmentModule):
                yield from module.called_modules()
            else:
                yield module

    def norms(self) -> list[NormBase]:
        """Normalization layers the body (or a nested segment) calls that keep running statistics."""
        return self.norm_layers

    def _trains_parameters(self) -> bool:
        return any(p.requires_grad for p in self.called_parameters)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled() or not (_wants_grad(args) or self._trains_parameters()):
            return self.body(*args[:len(self.inputs)])  # the rest are sources of rematerialized inputs
        if self.state_inputs or self.remat_inputs:
            args = tuple(StateInput(a) if i in self.state_inputs else _Dropped(a) if i in self.remat_inputs else a
                         for i, a in enumerate(args))
        running = innermost_running()
        if running is not None and running.recomputing:
            # Run again inside the enclosing segment's recompute: this call's own graph is
            # never backpropagated; it stands for the call made in the original forward.
            contexts = functools.partial(refill_contexts, running.next_nested())
        else:
            call = SegmentCall(self.saved_inside, [a for a in args if isinstance(a, StateInput)])
            if self.remat_inputs:
                call.remake = functools.partial(self._remake, args)
            if running is not None:
                running.call.nested.append(call)
            contexts = functools.partial(_call_contexts, self, call)
        # Early stop (the default) is what the plan's simulation assumes: a recompute ends
        # once backward has every tensor it saved. It ends by raising through the body, so
        # the body's generated forward is called directly: fx's call wrapper would format
        # a traceback for that exception on every recompute (~0.2 ms each).
        body = self._run_body if self.state_inputs or self.remat_inputs else self.body.forward
        with set_checkpoint_early_stop(True), profiled_range(self.label), autocast_uncached(args):
            outputs = checkpoint(body, *args, use_reentrant=False, preserve_rng_state=self.replays_rng,
                                 context_fn=contexts)
        for dropped in args:
            if isinstance(dropped, _Dropped):
                dropped.tensor = None  # forward is done with it: freed after its last use there
        return outputs

    def _run_body(self, *args: Any) -> Any:
        """The body, given scratch copies of the state it updates when this is its recompute
        (a call made again by an enclosing recompute is already passed that one's copies)
        and its rematerialized inputs."""
        running = innermost_running()
        recomputing = isinstance(running, _Recomputing) and running.segment is self
        return self.body.forward(*unwrap_state(self._inputs(args), recomputing))

    def _inputs(self, args: Sequence[Any]) -> list[Any]:
        """The body's inputs: a rematerialized one is forward's tensor while forward runs, and
        in a recompute a copy computed again from its sources without gradients, detached and
        with forward's ``requires_grad`` (so the body saves the same tensors). The gradient the
        segment computes for it flows along forward's graph to its producer, never through
        the copy (:mod:`passes.remat`)."""
        inputs = list(args[:len(self.inputs)])
        dropped = [inputs[i] for i in self.remat_inputs]
        if not dropped:
            return inputs
        if any(d.tensor is None and d.copy is None for d in dropped):
            self._remake(args)
        for position, box in zip(self.remat_inputs, dropped, strict=True):
            inputs[position] = box.tensor if box.tensor is not None else box.copy
            box.copy = None  # the body holds it now: freed once backward has used what it saved
        return inputs

    def _remake(self, args: Sequence[Any]) -> None:
        """Make the copies of the rematerialized inputs of a call with ``args`` from their
        sources, without gradients. :class:`_Recomputing` calls it before the selective
        policy's cache is entered: ops run inside it would shift the cache's count of each op."""
        with torch.no_grad(), frozen_running_stats(self.remat_norms):
            made = self.remat(*(args[i] for i in self.remat_sources))
        made = made if isinstance(made, tuple) else (made,)
        for position, value in zip(self.remat_inputs, made, strict=True):
            box = args[position]
            box.copy = value.detach().requires_grad_(box.requires_grad)

    def extra_repr(self) -> str:
        kernels = [name for name in self.saved_inside if name not in self.kept_whole]
        kept = f"; keeps matmul/conv outputs {', '.join(kernels)} from forward" if kernels else ""
        kept += f"; keeps values {', '.join(self.kept_whole)} from forward" if self.kept_whole else ""
        if self.remat_inputs:
            remade = ", ".join(self.inputs[i] for i in self.remat_inputs)
            kept += f"; drops {remade} after forward and rematerializes it from {', '.join(self.remat_names)}"
        if not self.reruns and not self.saved_inside and not self.remat_inputs:  # passes.graph_facts.leaves_nothing
            return (f"runs {len(self.nodes)} nodes as eager code would: none saves anything for backward, so the "
                    "call keeps nothing (its inputs go at their last use) and backward reruns nothing")
        span = f"{self.reruns[0]} .. {self.reruns[-1]}" if self.reruns else "nothing"
        return (f"recomputes {len(self.reruns)} of {len(self.nodes)} nodes ({span}) "
                f"in backward; keeps {', '.join(self.kept_names())}{kept}")

    def kept_names(self) -> list[str]:
        """The values its checkpoint keeps from forward: its inputs but the rematerialized
        ones, and the sources those are made from."""
        own = [name for i, name in enumerate(self.inputs) if i not in self.remat_inputs]
        return own + [name for name in self.remat_names if name not in own]


def _call_contexts(segment: SegmentModule, call: SegmentCall) -> tuple[RunningBody, _Recomputing]:
    """Forward and recompute contexts of a call backward will use."""
    return RunningBody(call, cache=segment.enclosing is None), _Recomputing(segment, call)


class _Recomputing(RunningBody):
    """What surrounds every recompute of a segment: counted, running statistics frozen, kept
    matmul outputs reused. Re-enterable, since a double backward recomputes twice.

    A nested segment whose enclosing recompute stopped before reaching it (checkpoint's early
    stop) has nothing kept and recomputes everything."""

    def __init__(self, segment: SegmentModule, call: SegmentCall) -> None:
        super().__init__(call, recomputing=True)
        self.segment = segment

    def __enter__(self) -> None:
        self.segment.recomputations += 1
        self.call.recomputes += 1
        self.nested_seen = 0
        super().__enter__()
        self.stack.enter_context(profiled_range(self.segment.label, "recompute"))
        self.stack.enter_context(frozen_running_stats(self.segment.norms()))
        self.stack.enter_context(scratch_state(self.call.state))
        if self.call.remake is not None:  # before the selective cache: see SegmentModule._remake
            self.call.remake()
        if self.segment.saved_inside and (self.segment.enclosing is None or self.call.filled):
            self.stack.enter_context(self.call.cached)

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        # Outputs kept for ops the recompute never reached (checkpoint stops once it has
        # what backward needs) would otherwise live until the segment's backward ends.
        clear_selective_cache(self.call.cached)
        if self.call.recomputes > 1 and selective_cache_missed(exc_info[1]):
            raise RuntimeError(SECOND_BACKWARD.format(label=self.segment.label)) from exc_info[1]


SECOND_BACKWARD = (
    "graphckpt: backward ran through segment {label} a second time (loss.backward(retain_graph=True) and "
    "again, or a second torch.autograd.grad), but it is a selective segment: torch's selective checkpointing "
    "hands the matmul outputs it kept to one backward only. For a loop that backpropagates twice through one "
    "forward, rewrite with strategy='sqrt', 'mincut' or 'articulation', whose segments recompute everything.")


