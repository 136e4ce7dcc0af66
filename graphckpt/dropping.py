"""What a rewritten module runs for a dropped value: one op as eager code, with the copies of
its dropped inputs it saves for backward replaced by a recipe that makes them again.

A plan dropping values (:mod:`passes.drops`) makes each op that saves a dropped value a
recomputed segment of one op that recomputes nothing but the value's chain
(:func:`passes.remat.runs_by_hooks`). Such a segment needs none of ``torch.utils.checkpoint``:
a :class:`DropModule` runs the op under ``torch.autograd.graph.saved_tensors_hooks`` whose
pack hook swaps each saved tensor sharing a dropped input's storage (the input itself, or a
view of it such as a ``Linear``'s flattened input) for a small handle. Forward's value is then
held by nothing once forward is done with it. When backward unpacks a handle, the call's
rematerialized inputs are made again from their sources without gradients (``drop_i_remat``
in ``print(gm.code)``), once for all the handles of the call, and the handle returns the
same view of the new copy.

**Gradients.** The copies only fill what the op saved: the gradient still flows along the
graph forward built, from the op to the dropped value's producer, as for a rematerialized
input of a checkpointed segment (:mod:`passes.remat`). The chain is pure (validated by the
plan), so the copy equals forward's value; autocast is replayed as forward ran it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from graphckpt.state import frozen_running_stats, running_stat_norms
from graphckpt.torch_compat import profiled_range, storage_key

_NOTHING = contextlib.nullcontext()  # reusable: enters and exits as often as asked


class _Remade:
    """The rematerialized inputs of one call, made again once per backward: by the first
    handle unpacked, held until the last one is (then dropped again; a second backward makes
    them once more)."""

    __slots__ = ("autocast", "module", "pending", "sources", "values")

    def __init__(self, module: DropModule, sources: tuple[Any, ...]) -> None:
        self.module, self.sources = module, sources
        self.autocast = autocast_now(sources)
        self.values: tuple[torch.Tensor, ...] | None = None
        self.pending = 0  # handles packed and not yet unpacked

    def take(self, index: int) -> torch.Tensor:
        if self.values is None:
            with self.autocast:
                self.values = self.module.remake(self.sources)
        value = self.values[index]
        self.pending -= 1
        if self.pending <= 0:
            self.values = None
        return value


class SavedView:
    """What autograd keeps in place of a saved tensor whose value is made again later: the
    saved tensor's size, stride and offset, so that the value made again is seen as the
    saved tensor saw it (a view, or the value itself). Subclasses say where the value
    comes from (:meth:`unpack`); :func:`unpack_saved` is the unpack hook of all of them."""

    __slots__ = ("offset", "size", "stride")

    def remember_view(self, saved: torch.Tensor) -> None:
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()

    def viewed(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the saved tensor saw it."""
        if (value.size(), value.stride(), value.storage_offset()) == (self.size, self.stride, self.offset):
            return value
        return value.as_strided(self.size, self.stride, self.offset)

    def unpack(self) -> torch.Tensor:
        raise NotImplementedError


def unpack_saved(packed: Any) -> Any:
    """The unpack hook of every runtime that swaps saved tensors for :class:`SavedView` handles."""
    return packed.unpack() if isinstance(packed, SavedView) else packed


class _Handle(SavedView):
    """What autograd keeps in place of a saved tensor that shares a dropped input's storage:
    which input, and the saved tensor's view of it."""

    __slots__ = ("index", "remade")

    def __init__(self, remade: _Remade, index: int, saved: torch.Tensor) -> None:
        self.remade, self.index = remade, index
        self.remember_view(saved)

    def unpack(self) -> torch.Tensor:
        return self.viewed(self.remade.take(self.index))


def _device_type(values: Sequence[Any]) -> str:
    """The device type of the first tensor of ``values`` (``"cpu"`` when there is none):
    whose autocast state applies to them."""
    return next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")


def autocast_now(values: Sequence[Any]) -> contextlib.AbstractContextManager:
    """A context that runs a remake (values made again without gradients, in backward:
    a drop's, a hooked segment's, an exact schedule's step) under the autocast state in
    force now, for the device of ``values`` (a no-op when autocast is off there), with
    autocast's cache of parameter casts off. A remake saves nothing, so the cache only kept
    each weight's 16-bit copy to the remake's end, beside what it made: an exact schedule of
    two self-attention layers under bf16 on CPU measured 1.15x its simulated peak, 1.00x
    uncached. The casts are the same, so are the results."""
    device = _device_type(values)
    if not torch.is_autocast_enabled(device):
        return _NOTHING
    return torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)


@contextlib.contextmanager
def autocast_uncached(values: Sequence[Any]) -> Iterator[None]:
    """Autocast's cache of parameter casts off, while autocast is on for the device of
    ``values`` (else nothing changes): what a checkpoint call runs under. Autocast keeps the
    low-precision copy of every parameter it casts until its region ends, saved for backward
    or not, so a recomputed segment, which saves none, held its layers' weight copies through
    the rest of forward (the zoo MLP under bf16 on CPU: 3.4 MB at the end of forward where
    the plan simulated 1.1; 0.98 MB uncached). Off, each copy goes once its op is done;
    checkpoint replays the same flag in the recompute. The casts are the same, so are the
    results. Only the flag is set and restored: a body that leaves or enters an autocast
    region (a dynamo graph's ``_exit_autocast``) keeps the state it leaves."""
    device = _device_type(values)
    cached = torch.is_autocast_cache_enabled()
    if not cached or not torch.is_autocast_enabled(device):
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)


class DropModule(nn.Module):
    """One op of a rewritten module whose saved copies of some inputs are dropped after
    forward and made again when backward needs them (see the module's docstring).

    Called with the op's inputs, then the sources of the dropped ones that are not inputs.
    ``remat`` computes the dropped inputs (at positions ``remat_inputs``) from the arguments
    at ``remat_sources``; the body and ``remat`` are plain attributes, not submodules, so
    parameters and ``state_dict`` keys stay those of the original model. A profiler's trace
    names its forward ``graphckpt drop_0`` (its ``label``) and its remakes ``graphckpt drop_0 remake``.
    """

    label = "drop"

    def __init__(self, body: fx.GraphModule, remat: fx.GraphModule, *, nodes: Sequence[str],
                 inputs: Sequence[str], outputs: Sequence[str], remat_inputs: Sequence[int],
                 remat_sources: Sequence[int], remat_names: Sequence[str]) -> None:
        super().__init__()
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "remat", remat)
        self.nodes, self.inputs, self.outputs = tuple(nodes), tuple(inputs), tuple(outputs)
        self.remat_inputs, self.remat_sources = tuple(remat_inputs), tuple(remat_sources)
        self.remat_names = tuple(remat_names)
        self.remakes = 0  # how many times backward made the dropped inputs again
        self.remat_norms = running_stat_norms(remat.modules())

    def forward(self, *args: Any) -> Any:
        inputs = args[:len(self.inputs)]
        if not torch.is_grad_enabled():
            return self.body.forward(*inputs)
        remade = _Remade(self, tuple(args[i] for i in self.remat_sources))
        dropped = {storage_key(inputs[i]): (position, inputs[i].dtype)
                   for position, i in enumerate(self.remat_inputs) if isinstance(inputs[i], torch.Tensor)}

        def pack(saved: torch.Tensor) -> Any:
            hit = dropped.get(storage_key(saved))
            if hit is None or saved.dtype != hit[1]:
                return saved
            remade.pending += 1
            return _Handle(remade, hit[0], saved)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack_saved), profiled_range(self.label):
                return self.body.forward(*inputs)  # not fx's call wrapper: ~10 us a call
        finally:
            dropped.clear()  # the hooks may outlive the call: hold no storage of forward's

    def remake(self, sources: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        """The dropped inputs made again from ``sources``, without gradients."""
        self.__dict__["remakes"] += 1  # not nn.Module's __setattr__: a few microseconds a call
        norms = frozen_running_stats(self.remat_norms) if self.remat_norms else _NOTHING
        with torch.no_grad(), norms, profiled_range(self.label, "remake"):
            made = self.remat.forward(*sources)
        return made if isinstance(made, tuple) else (made,)

    def extra_repr(self) -> str:
        remade = ", ".join(self.inputs[i] for i in self.remat_inputs)
        return (f"runs {', '.join(self.nodes)} as eager code; drops {remade} after forward and makes it "
                f"again from {', '.join(self.remat_names)} when backward needs it")
