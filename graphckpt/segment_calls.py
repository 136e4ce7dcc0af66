"""The calls of checkpointed segments and what a selective one keeps: the record of each
call backward will use (:class:`SegmentCall`), the stack of segment bodies running now, and
the marks and policy by which a selective segment keeps the values its plan names
(``saved_inside``) from forward: codegen emits :func:`keep_begin` / :func:`keep_end` around
each such node, and the call's policy saves the ops run inside a mark, every op of a node
kept whole (but the casts autocast makes inside it), only the matmul/convolution kernels of a
matmul or convolution node (:func:`graphckpt.op_kinds.kept_by_selective`). A nested call
keeps them from its enclosing segment's recompute, not from the first forward: each call
records the nested calls it makes, and when backward recomputes it, the nested calls made
again, in the same order, fill the storage of the ones they stand for.
:mod:`graphckpt.runtime`'s segments run inside these.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from graphckpt.op_kinds import kept_by_selective
from graphckpt.state import StateInput
from graphckpt.torch_compat import OpOverload, is_cast, op_schema


class SegmentCall:
    """One call of a segment in a forward whose graph backward will use.

    A selective segment's call keeps its matmul/conv outputs through ``caching`` and reuses
    them through ``cached`` (torch's selective checkpointing contexts, sharing one storage).
    A top-level call caches in forward; a nested one only when its enclosing segment is
    recomputed: the nested calls made then, in the same order, cache for the calls in
    ``nested`` they stand for (``filled`` once one has).
    """

    def __init__(self, saved_inside: Sequence[str], state: Sequence[StateInput] = ()) -> None:
        self.nested: list[SegmentCall] = []
        self.state = tuple(state)  # what its recompute gets scratch copies of
        self.remake: functools.partial | None = None  # makes its rematerialized inputs again
        self.filled = False
        self.recomputes = 0  # recomputes begun: a second is a second backward through this call
        self.caching: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.cached: contextlib.AbstractContextManager = contextlib.nullcontext()
        if saved_inside:
            policy = functools.partial(_keep_marked, weakref.ref(self))  # no cycle: freed with its graph
            self.caching, self.cached = create_selective_checkpoint_contexts(policy)


_RUNNING_BODIES = threading.local()  # a stack of _Running, per thread (CUDA backward has its own)


def running_stack() -> list[RunningBody]:
    if not hasattr(_RUNNING_BODIES, "stack"):
        _RUNNING_BODIES.stack = []
    return _RUNNING_BODIES.stack


def innermost_running() -> RunningBody | None:
    stack = running_stack()
    return stack[-1] if stack else None


class RunningBody:
    """A segment's body running: in forward (``cache``: keep matmul outputs now; ``refill``:
    keep them for the call this one stands for) or in a recompute (``recomputing``)."""

    def __init__(self, call: SegmentCall, *, cache: bool = False, refill: SegmentCall | None = None,
                 recomputing: bool = False) -> None:
        self.call = call
        self.recomputing = recomputing
        self.nested_seen = 0
        self.stack = contextlib.ExitStack()
        self.caching = call.caching if cache else refill.caching if refill is not None else None
        self.refill = refill
        self.keeper = refill if refill is not None else call  # whose policy a mark in this body speaks to
        self.keeping: str | None = None  # inside keep_begin(..) / keep_end(..): "whole" or "kernels"

    def next_nested(self) -> SegmentCall:
        """The call, in the forward being recomputed, of the nested segment called now."""
        if self.nested_seen >= len(self.call.nested):
            raise RuntimeError("graphckpt: a recompute called more nested segments than the forward it "
                               "repeats; the model's control flow changed between forward and backward")
        self.nested_seen += 1
        return self.call.nested[self.nested_seen - 1]

    def __enter__(self) -> None:
        running_stack().append(self)
        if self.caching is not None:
            self.stack.enter_context(self.caching)

    def __exit__(self, *exc_info: object) -> None:
        self.stack.close()
        running_stack().pop()
        if self.refill is not None and exc_info[0] is None:
            self.refill.filled = True


def refill_contexts(stands_for: SegmentCall) -> tuple[RunningBody, contextlib.AbstractContextManager]:
    """Contexts of a call made again by an enclosing recompute: it keeps matmul outputs for
    the call it stands for, and is itself never recomputed."""
    return RunningBody(SegmentCall(()), refill=stands_for), contextlib.nullcontext()



def keep_begin(how: str) -> None:
    """Mark the start of a node the running segment keeps from forward (codegen emits it
    before each ``saved_inside`` node): ``how`` is ``"whole"`` (every op's output is kept
    but the casts autocast makes of its inputs, which the recompute makes again: a kept
    ``cat`` of bf16 and float32 rotary halves under autocast cached its 24 KiB float32 copy
    of the bf16 one beside its value, and GPT-NeoX's plan at 0.5 measured 3.9% over its
    simulated peak), ``"cast"`` (a cast node kept whole: every op's output) or
    ``"kernels"`` (only its matmul/convolution kernels, as for an ``expensive`` node).
    Outside a checkpointed call (eval, no_grad) it does nothing."""
    running = innermost_running()
    if running is not None:
        running.keeping = how


def keep_end(value: Any) -> Any:
    """Mark the end of a kept node (:func:`keep_begin`); returns ``value`` unchanged so the
    body reads as ``x = keep_end(x)`` would, without changing what flows."""
    running = innermost_running()
    if running is not None:
        running.keeping = None
    return value


def _keep_marked(call: weakref.ref[SegmentCall], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """``call``'s selective policy: keep the outputs of ops run inside a mark its own body
    made (not a nested segment's: the innermost running body must be the one ``call``
    stands for), all of them for a node kept whole, the matmul/convolution kernels for a
    matmul node. The same marks run in forward and in the recompute, so both agree."""
    running = innermost_running()
    if running is None or running.keeper is not call() or running.keeping is None:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if kept_by_selective(op, args, kwargs) or (running.keeping == "cast" and not _writes(op)) or (
            running.keeping == "whole" and not _writes(op) and not is_cast(op)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _writes(op: Any) -> bool:
    """Whether ``op`` writes one of its arguments in place (a norm's batch counter ``add_``):
    its output is a tensor written again later, which a selective cache may not hold; it
    runs again in the recompute, on the scratch state the recompute gets."""
    return isinstance(op, OpOverload) and op_schema(op).is_mutable


def recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective policy that keeps nothing: what the policy machinery costs by itself."""
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_matmul_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective policy that keeps every matmul/convolution output, as a selective segment
    keeps its matmul nodes': what the policy costs on a model's own ops."""
    return CheckpointPolicy.MUST_SAVE if kept_by_selective(op, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE
