"""What one node's backward makes, recorded during the profile's fake backward: the ATen
calls it runs (for :func:`graphckpt.scratch.measure_kernel_scratch` to replay), the storages
they make and free, and the saved tensors it lets go on the way. From these,
``backward_extra_bytes`` (the gradients passed from one of its calls to the next, and what each
call's kernel scratch sits on: :meth:`Recorder.held_after_calls`) and ``released_early``
(:meth:`Recorder.backward_peak`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from graphckpt.scratch import layouts_of
from graphckpt.torch_compat import TorchDispatchMode, allocated_bytes, storage_key, tree_leaves

RELEASED = object()  # the token of an event: saved bytes released (negative)


class BackwardPeak(NamedTuple):
    """What :meth:`Recorder.backward_peak` finds of one node's backward."""

    bytes: int
    released_before: tuple[str, ...]  # graph values it saved and let go before the peak


class Recorder(TorchDispatchMode):
    """Records, for the node named ``owner`` (between :meth:`enter` and :meth:`leave`, the
    only time it is a dispatch mode), the ATen calls made under it that may allocate: not
    views, and only calls that return a tensor.

    It also follows the tensors those calls make until autograd drops them: a node whose
    backward is several calls (attention computed by the math kernel: matmul, dropout,
    softmax backward, ...) hands intermediate gradients from one call to the next, and
    :meth:`backward_peak` is the peak of everything its backward makes, net of the saved
    tensors it releases on the way, with the saved values of the graph it is done with
    before that peak (cross entropy's target, released by
    ``NllLossBackward`` before ``LogSoftmaxBackward`` makes its gradient).
    """

    def __init__(self) -> None:
        super().__init__()
        self.owner: str | None = None
        self.calls: dict[str, list[tuple[Any, tuple, dict]]] = {}  # (op, args, kwargs), tensors as Layouts
        self.events: dict[str, list[tuple[object, int]]] = {}  # (token, bytes made), or (token, 0): freed
        self.ends: dict[str, int] = {}  # events before the node's backward ended
        self.call_starts: dict[str, list[int]] = {}  # each recorded call's position in the node's events
        self.extras: dict[int, tuple[int, int]] = {}  # storage saved that no value owns -> (saves, bytes)
        self.releasing: dict[str, list[int]] = {}  # extras unpacked by the function running now
        self.value_saves: dict[tuple[str, int], list] = {}  # (node, storage of a graph value) -> [saves, value]
        self.releasing_values: dict[str, list[str]] = {}  # graph values unpacked for the last time, now
        self.incoming: dict[str, list[tuple[Any, int]]] = {}  # node -> (weak reference, bytes) of its gradients
        self.holding: dict[str, dict[int, list[int]]] = {}  # node -> storage -> [bytes, tensors on it], until it
        # first unpacks: by storage, not by tensor as ``events``, since a view of a result keeps it (a reshape)
        self.first_unpack: dict[str, int] = {}  # node -> what it held then, above its gradients (held_at_first_unpack)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.owner is None:
            return result
        follow = not func.is_view and any(isinstance(t, torch.Tensor) for t in tree_leaves(result))
        hold = self.owner not in self.first_unpack
        if follow or hold:
            inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if follow:
            self.calls.setdefault(self.owner, []).append((func, *layouts_of(args, kwargs)))
            self.call_starts.setdefault(self.owner, []).append(len(self.events.get(self.owner, ())))
            self._follow(self.owner, result, inputs)
        if hold:
            self._hold(self.owner, result, func.is_view, inputs)
        return result

    def _hold(self, owner: str, result: Any, view: bool, inputs: set[int]) -> None:
        """Count each tensor ``result`` has on a storage ``owner``'s backward made (not one of
        the call's ``inputs``), a new one unless ``view``, as holding it
        (:meth:`held_at_first_unpack`)."""
        holding = self.holding.setdefault(owner, {})
        for tensor in tree_leaves(result):
            if not isinstance(tensor, torch.Tensor):
                continue
            key = storage_key(tensor)
            if key not in holding:
                if view or key in inputs:
                    continue
                holding[key] = [allocated_bytes(tensor), 0]
            holding[key][1] += 1
            weakref.finalize(tensor, _let_go, holding[key])

    def _follow(self, owner: str, result: Any, inputs: set[int]) -> None:
        """Note the new storages ``result`` makes for ``owner`` (not one of the call's
        ``inputs``), and when each is freed."""
        events = self.events.setdefault(owner, [])
        for tensor in tree_leaves(result):
            if not isinstance(tensor, torch.Tensor) or storage_key(tensor) in inputs:
                continue
            token = object()
            events.append((token, allocated_bytes(tensor)))
            weakref.finalize(tensor, events.append, (token, 0))

    def saves(self, tensor: torch.Tensor) -> None:
        """``tensor`` is saved for backward and belongs to no value of the graph (a dropout
        mask, softmax's output inside attention): autograd frees it once the last backward
        function that unpacks it has run."""
        count, _ = self.extras.get(storage_key(tensor), (0, 0))
        self.extras[storage_key(tensor)] = count + 1, allocated_bytes(tensor)

    def saves_value(self, owner: str, tensor: torch.Tensor, value: str) -> None:
        """``owner``'s forward saved ``tensor``, a storage of the graph's ``value``."""
        self.value_saves.setdefault((owner, storage_key(tensor)), [0, value])[0] += 1

    def unpacked(self, tensor: torch.Tensor) -> torch.Tensor:
        """Unpack hook of the saved tensors: an extra unpacked for the last time is released
        after the function running now; so is ``owner``'s save of a graph value."""
        key = storage_key(tensor)
        if self.owner is not None and self.owner not in self.first_unpack:
            held = sum(nbytes for nbytes, tensors in self.holding.pop(self.owner, {}).values() if tensors)
            freed = sum(nbytes for reference, nbytes in self.incoming.get(self.owner, ()) if reference() is None)
            self.first_unpack[self.owner] = max(0, held - freed)
        if self.owner is not None and key in self.extras:
            count, nbytes = self.extras[key]
            self.extras[key] = count - 1, nbytes
            if count == 1:
                self.releasing.setdefault(self.owner, []).append(nbytes)
        saves = self.value_saves.get((self.owner, key)) if self.owner is not None else None
        if saves is not None:
            saves[0] -= 1
            if saves[0] == 0:
                self.releasing_values.setdefault(self.owner, []).append(saves[1])
        return tensor

    def enter(self, owner: str, gradients: Any = ()) -> None:
        """One of ``owner``'s backward functions starts, given ``gradients``: its calls are
        recorded. The recorder is a dispatch mode only from here to :meth:`leave`, not for the
        whole backward, which took every other node's calls and autograd's device queries
        through Python (a third of a 10k-node fake backward); a function that fails leaves the
        mode through the autograd engine's thread-local state guard. The first function's
        ``gradients`` are the node's own (:meth:`held_at_first_unpack`)."""
        if owner not in self.incoming:
            self.incoming[owner] = [(weakref.ref(t), allocated_bytes(t))
                                    for t in tree_leaves(gradients) if isinstance(t, torch.Tensor)]
        self.owner = owner
        self.__enter__()

    def leave(self, owner: str) -> None:
        """One of ``owner``'s backward functions has returned (releasing the extras it
        unpacked); the last one ends its backward."""
        events = self.events.setdefault(owner, [])
        events.extend((RELEASED, -nbytes) for nbytes in self.releasing.pop(owner, ()))
        events.extend(((RELEASED, value), 0) for value in self.releasing_values.pop(owner, ()))
        self.ends[owner] = len(events)
        self.owner = None
        self.__exit__(None, None, None)

    def held_at_first_unpack(self, owner: str) -> int:
        """What ``owner``'s backward holds when it first unpacks a saved tensor, above the
        gradient it was given: the results of the functions before (those that save nothing),
        less its own gradient when they let it go. A checkpoint's recompute runs at that
        unpack, while these live: math attention under bf16 casts its gradient up to float32
        and reshapes it before the matmul whose saved tensors it unpacks first (BEiT's bf16
        floor plan measured 2.3% over its simulated peak). 0 when it unpacks nothing."""
        return self.first_unpack.get(owner, 0)

    def _events_of(self, owner: str) -> list[tuple[object, int]]:
        """``owner``'s recorded events up to the end of its backward."""
        return self.events.get(owner, [])[: self.ends.get(owner, 0)]

    def backward_peak(self, owner: str, scratch_call: int | None = None) -> BackwardPeak:
        """Peak bytes ``owner``'s backward holds above what it started with: the results
        of its calls (the gradients it returns, and the intermediate ones passed from one
        call to the next), net of the saved extras it releases on the way; with the graph
        values it saved whose last use in its backward came before that peak (the simulator
        may free them there when nothing else holds them) and before the call of index
        ``scratch_call`` (in ``calls[owner]``), whose kernel scratch the simulator adds at the
        same moment: a convolution's backward reads its saved input while its scratch is
        alive, though under autocast the weight cast's backward, after it, makes the peak of
        the gradients (U-Net planned under bf16 measured 8% over without this)."""
        peak = 0
        released: list[str] = []
        before: tuple[str, ...] = ()
        events = self._events_of(owner)
        scratch_from = len(events) if scratch_call is None else self.call_starts[owner][scratch_call]
        for position, ((token, _), current) in enumerate(zip(events, _running_bytes(events), strict=True)):
            if isinstance(token, tuple) and position < scratch_from:  # (RELEASED, value): a value's save let go
                released.append(token[1])
            if current > peak:
                peak, before = current, tuple(released)
        return BackwardPeak(peak, before)

    def most_with_scratch(self, owner: str, scratches: list[int]) -> tuple[int, BackwardPeak]:
        """The most ``owner``'s backward holds, given each of its calls' kernel ``scratches``
        (:func:`graphckpt.scratch.scratch_by_call`): at the peak of what it makes, or while a
        call's scratch sits on what that call and those before it made
        (:meth:`held_after_calls`); with :meth:`backward_peak` taken at the moment of that
        scratch."""
        moments = [held + scratch for held, scratch in zip(self.held_after_calls(owner), scratches, strict=True)]
        at = max((i for i, scratch in enumerate(scratches) if scratch), key=moments.__getitem__, default=None)
        peak = self.backward_peak(owner, at)
        return max(peak.bytes, moments[at] if at is not None else 0), peak

    def allocates(self, owner: str) -> bool:
        """Whether ``owner``'s backward made any new storage (a result that is not one of its
        call's inputs): ``add``'s backward passing its gradient through makes none."""
        return any(_made(token, nbytes) for token, nbytes in self._events_of(owner))

    def held_after_calls(self, owner: str) -> list[int]:
        """Bytes ``owner``'s backward holds (counted as :meth:`backward_peak` counts them)
        while each of its calls runs, call by call: what was made before it and not freed,
        and its own results (what is freed or released after it returns is still held).
        That is what a call's kernel scratch sits on. A linear layer's bf16 ``mm`` under
        autocast runs before the float32 copy of its weight gradient is made, so its scratch
        never meets that copy (stop 67: scratch laid on the whole gradients over-simulated
        a plan's peak by 5.5% on a CPU whose bf16 ``mm`` allocates scratch)."""
        events = self._events_of(owner)
        starts = self.call_starts.get(owner, [])
        running = list(_running_bytes(events))
        held = []
        for index, start in enumerate(starts):
            end = starts[index + 1] if index + 1 < len(starts) else len(events)
            made = 0
            for token, nbytes in events[start:end]:  # its results come first, then what follows it
                if not _made(token, nbytes):
                    break
                made += nbytes
            held.append((running[start - 1] if start else 0) + made)
        return held


def _let_go(holding: list[int]) -> None:
    """A tensor on a storage :meth:`Recorder._hold` counts is gone."""
    holding[1] -= 1


def _made(token: object, nbytes: int) -> bool:
    """Whether an event is a storage made (not one freed, nor a save released)."""
    return nbytes > 0 and token is not RELEASED and not isinstance(token, tuple)


def _running_bytes(events: list[tuple[object, int]]) -> Iterator[int]:
    """The bytes held after each of ``events``: storages made and not yet freed, less the
    saved extras released (a graph value's save let go is ``released_early``'s, not counted)."""
    sizes: dict[object, int] = {}
    current = 0
    for token, nbytes in events:
        if isinstance(token, tuple):  # (RELEASED, value)
            pass
        elif nbytes == 0:  # a storage freed
            current -= sizes.pop(token, 0)
        else:  # a storage made, or (RELEASED, -bytes) a saved extra released
            if token is not RELEASED:
                sizes[token] = nbytes
            current += nbytes
        yield current
