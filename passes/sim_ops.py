"""One op's forward and backward on the simulator's live memory (:class:`passes.sim_memory.LiveMemory`):
what it allocates, holds, saves and releases, and the gradients its backward makes. The
replay of a whole plan, segment by segment, is :mod:`passes.simulate`; this is the step it
repeats for every op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from passes.sim_memory import (
    AUTOCAST_CACHE,
    EXTRA,
    GRAD,
    PARAM_ACCUMULATOR,
    PARAM_GRAD,
    SELECTIVE_EXTRA,
    STATE_COPY,
    LiveMemory,
    slot,
)


def run_forward(memory: LiveMemory, nodes: Sequence[int], save: bool,
                 within: set[int] | None = None, keep: Iterable[int] = (), selective: bool = True,
                 consumed: Iterable[int] = (), moded: bool = False) -> None:
    """Compute ``nodes`` (ids); with ``save`` each op also holds what its backward needs.

    ``within`` limits the readers that keep a value alive to that set (a recompute only
    feeds its own segment); ``keep`` values get one more hold (kept from forward), and with
    ``selective`` they are a selective segment's kept values, holding what selective
    checkpointing caches beside them (``selective=False``: a rematerialization chain, which
    caches nothing and leaves alone what others cache). ``consumed`` values lose that hold
    when their node is reached: a recompute takes a kept value out of selective
    checkpointing's cache there, and it lives on only as long as its readers or backward need it.
    ``moded``: the ops run under selective checkpointing's dispatch mode (a selective
    segment's forward or recompute), with their ``selective_forward_extra_bytes``.
    """
    index = memory.index
    owns, nbytes, readers, saved = index.owns, index.nbytes, index.readers, index.saved
    reads, selective_extra = index.activation_reads, index.selective_extra
    forward_extra = index.selective_forward_extra if moded else index.forward_extra
    saved_extra, cached = index.saved_extra, index.autocast_cache
    caching = save and not memory.fresh and bool(index.autocast_cached)  # forward's own code, autocast's cache on
    kept = frozenset(keep)  # a selective segment's matmul outputs: tested per node, so a set
    taken = frozenset(consumed)
    keys = None if memory.fresh else index.value_keys  # no recompute open: forward's storages, looked up
    for node in nodes:
        key = memory.key(node) if keys is None else keys[node]
        if selective and selective_extra[node] and node not in kept:
            # A recompute reaching a node whose inner matmul outputs selective checkpointing
            # cached takes them out of the cache as the node's kernels run: they are the
            # node's own intermediates (``forward_extra_bytes``, ``saved_extra_bytes``) from
            # here, not bytes beside them (BART's nested plan at the floor, bf16: 98,304 B
            # over its measured peak, stop 68). Nothing is cached for it otherwise.
            memory.free(slot(node, SELECTIVE_EXTRA))
        if owns[node]:
            memory.allocate(key, nbytes[node])
        here = readers[node] if within is None else [r for r in readers[node] if r in within]
        memory.hold(node, len(here) + (node in kept), key)
        if save:
            for value in saved[node]:
                memory.hold(value, 1, None if keys is None else keys[value])
            if saved_extra[node]:
                memory.allocate(slot(node, EXTRA), saved_extra[node])
        if caching and cached[node]:
            memory.allocate(slot(node, AUTOCAST_CACHE), cached[node])
        # Its temporaries, held for a moment; run without saving, what it saves beyond values
        # too (made inside the op all the same, let go when it returns), and with autocast's
        # cache off, its casts.
        # Served from selective checkpointing's cache (``consumed``), its kernels do not run.
        extra = index.cached_rerun_extra[node] if node in taken else forward_extra[node]
        moment = extra + (0 if save else saved_extra[node]) + (0 if caching else cached[node])
        if moment:
            memory.touch(moment)
        for value in reads[node]:
            if within is None or value in within:
                memory.release(value, 1, None if keys is None else keys[value])
        memory.release(node, 1 if node in taken else 0, key)
        if selective and selective_extra[node] and node in kept:
            # A selective segment keeps the matmul outputs inside a kept node until its
            # recompute reruns the node (freed above, then).
            memory.allocate(slot(node, SELECTIVE_EXTRA), selective_extra[node])


def run_backward(memory: LiveMemory, nodes: Sequence[int], grads: set[int]) -> None:
    """Backward of ``nodes`` (ids) in reverse: gradients in, gradients out, saved values released.

    Each node's backward as autograd's engine runs it: the function makes every gradient it
    returns, the ones to be added into existing buffers too, and its parameters' (with its
    ``backward_extra_bytes`` of scratch for a moment); it returns and lets its saved values
    go; then the engine adds what it returned into the buffers (:func:`_gradients_of`,
    :func:`_added_into_buffers`).
    """
    index = memory.index
    keys = None if memory.fresh else index.value_keys  # as in :func:`run_forward`
    for node in reversed(nodes):
        memory.backward_begins(node)
        early = index.released_early[node] if node in grads else ()  # let go by its first functions
        returned = _gradients_of(memory, node, grads) if node in grads else None
        grads.discard(node)
        for value in index.saved[node]:
            if value not in early:
                memory.release(value, 1, None if keys is None else keys[value])
        if index.saved_extra[node]:  # (never allocated otherwise)
            memory.free(slot(node, EXTRA))
        if index.state_copy[node]:  # a recompute's copies of the running statistics it saved (none in forward)
            memory.free(slot(node, STATE_COPY))
        if returned:
            _added_into_buffers(memory, node, returned)


def _gradients_of(memory: LiveMemory, node: int, grads: set[int]) -> Returned | None:
    """``node``'s backward function: its inputs' new gradient buffers made, those to be added
    into existing ones made beside them, its parameters' gradients, its scratch for a
    moment with all of them; then its own gradient let go. Returns what the engine adds
    into buffers once it has returned (:func:`_added_into_buffers`), if anything."""
    index = memory.index
    views = index.grad_views[node]  # it hands on views of its gradient: none made to add
    added, made_to_add = [], 0
    for value, size in index.grad_reads[node]:
        if value in grads:
            added.append((value, size))
            made_to_add += 0 if views else size
        elif views:
            memory.share_gradient(value, node)
            grads.add(value)
        else:
            memory.allocate(slot(value, GRAD), size)
            grads.add(value)
    own, summed = index.param_grad[node], 0
    for param, nbytes in index.shared[node]:  # summed in one buffer until its last reader's backward:
        if slot(param, PARAM_ACCUMULATOR) not in memory.live:  # the first gradient becomes it;
            memory.allocate(slot(param, PARAM_ACCUMULATOR), nbytes)
            own -= nbytes
        else:  # a later one is made beside it, and their sum (out of place) replaces it
            summed += nbytes
    cast = index.cast_up[node]  # what it makes 16-bit here, cast up once it has returned
    if own > 0:
        memory.allocate(slot(node, PARAM_GRAD), own - cast.narrowed_by)
    for value in index.released_early[node]:
        memory.release(value)
    if index.backward_extra[node] or made_to_add:  # (a no-op otherwise: most nodes, on the replay's hot path)
        memory.touch(max(0, index.backward_extra[node] + made_to_add - cast.scratch_less))
    view_of = memory.gradient_buffer(node) if views else None
    memory.free_gradient(node)
    if added or own > 0 or index.shared[node]:
        return Returned(tuple(added), made_to_add, own, summed, view_of, cast.moment)
    return None


class Returned(NamedTuple):
    """What a backward function returned that the engine adds into buffers after it
    (:func:`_added_into_buffers`)."""

    added: tuple[tuple[int, int], ...]  # (input, gradient bytes) whose gradient is added into its buffer
    made_to_add: int  # bytes of those gradients the function made (none where they are views of its own)
    own: int  # bytes of its parameters' gradients, alive until autograd adds them into ``.grad``
    summed: int  # bytes of them summed out of place into a shared weight's buffer
    view_of: int | None  # the buffer whose views it handed on (its gradient's), if it did
    cast_up: int = 0  # bytes held on top while autograd casts its parameters' gradients up from 16-bit ones


def _added_into_buffers(memory: LiveMemory, node: int, returned: Returned) -> None:
    """After ``node``'s backward function returned and let its saved values go, everything it
    returned alive until then: each gradient it made for an existing buffer added into it,
    in place, or out of place into a new buffer where another value's gradient still views
    the old one, the gradient added is a view of it, or the old one is a slice of a larger
    buffer (``cat``'s), as autograd sums in place only into a dense tensor it holds the only
    reference to (the sum made while the old buffer and the gradient added are alive, as the
    exact solver's training graph has it); and its parameters' gradients summed out of place
    with shared weights' buffers, each of which goes with its last reader's backward; and the
    gradients of parameters it read through autocast's casts, made 16-bit, cast up
    (``param_grad_cast_bytes``)."""
    old = 0  # bytes of the buffer the last sum made out of place read, when that let it go
    for value, size in returned.added:
        buffer = memory.gradient_buffer(value)
        if memory.shares_gradient(value) or buffer == returned.view_of or memory.live.get(buffer, 0) > size:
            memory.allocate(slot(value, GRAD), size)  # beside the old, which its view then lets go
            before = memory.current
            memory.free_gradient(value)
            old = before - memory.current
    # What it returned is alive until added in: with the last sum, and the buffer that sum read
    # (a shared weight's sum comes after the buffers' sums, that buffer gone)
    memory.touch(returned.made_to_add + returned.summed + (0 if returned.summed else old))
    if returned.cast_up:  # then each cast up from the 16-bit one it made, which lives until then
        memory.touch(returned.cast_up)
    if returned.own > 0:
        memory.free(slot(node, PARAM_GRAD))
    for param, _ in memory.index.shared[node]:
        memory.pending_readers[param] -= 1
        if memory.pending_readers[param] == 0:
            memory.free(slot(param, PARAM_ACCUMULATOR))
