"""What a rewritten module runs for a selective segment run by saved-tensor hooks
(:mod:`passes.hooked`): eager code whose saved copies of the segment's dropped values are
made again when backward needs them, with no checkpoint call and no dispatch mode.

A :class:`HookedSegmentModule` runs its body (the segment's ops, as the model wrote them)
with autograd on, so backward runs forward's own graph. Its body reports each value as
it is made (``mark(hooks, value, "name")`` in ``print(gm.code)``, ``keep(..)`` for a
value kept from forward), and the pack hook swaps every saved tensor sharing the storage
of a marked value for a handle (:class:`_Saved`); a value an op saves of its own output is
matched when the value is reported, right after the op. The storage is recognized by
address while it is alive (:func:`graphckpt.torch_compat.storage_alive`): an address
freed and given to another tensor is never taken for it. The marked values come in remake
groups (:func:`passes.hooked.remake_groups`): the first handle backward unpacks of a group
makes the group's values again from the segment's inputs and kept values, without
gradients (``hooked_i_remake_g``; a dropout in it draws its noise again from the generator
state it drew from in forward, :mod:`graphckpt.dropout`); each is let go once its last handle is unpacked. What a
group's remake reads is held by the group's handles, not by the call: an input or kept
value goes once the ops that saved it and the handles that may remake from it are done
(:func:`passes.hooked_lifetimes.last_needed`), and a retained graph's handles keep it for the next
backward.

**Gradients.** Only what backward saved is replaced, by a value computed by the same pure
ops from the same tensors (:func:`passes.hooked.keeps_by_hooks`), so gradients are eager's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from graphckpt.dropout import generator_state, restored_generators
from graphckpt.dropping import SavedView, autocast_now, unpack_saved
from graphckpt.state import frozen_running_stats, running_stat_norms
from graphckpt.torch_compat import profiled_range, storage_alive, storage_key, storage_key_and_ref

_NOTHING = contextlib.nullcontext()
STATES = "generator_states"
"""The last placeholder of a remake that draws dropout noise again: the generator states its
dropouts drew from in forward, by name (:meth:`_HookedCall.stash_generator`)."""


class PendingSaved(SavedView):
    """What autograd keeps for a tensor an op saved under a runtime that makes values again:
    the tensor itself until it is known to share a value's storage (:class:`SavedStorages`),
    then the value's name, its element (of a tuple) and the tensor's view of it. Subclasses
    say where the value comes from at unpack (:meth:`value`)."""

    __slots__ = ("call", "element", "name", "tensor")

    def __init__(self, call: Any, tensor: torch.Tensor) -> None:
        self.call, self.tensor, self.name = call, tensor, ""

    def drop(self, name: str, element: int | None) -> None:
        self.remember_view(self.tensor)
        self.name, self.element, self.tensor = name, element, None

    def value(self) -> torch.Tensor:
        raise NotImplementedError

    def unpack(self) -> torch.Tensor:
        return self.tensor if self.tensor is not None else self.viewed(self.value())


class _Saved(PendingSaved):
    """A hooked segment's handle: also what its group's remake reads (so that lives while a
    handle that may remake does), counted as pending until unpacked."""

    __slots__ = ("reads",)

    def drop(self, name: str, element: int | None) -> None:
        super().drop(name, element)
        self.reads = self.call.reads_of(name)
        self.call.pending[name] = self.call.pending.get(name, 0) + 1

    def value(self) -> torch.Tensor:
        return self.call.take(self.name, self.element, self.reads)


def tensors_of(value: Any) -> list[tuple[int | None, torch.Tensor]]:
    """``value``'s tensors with their position (``None`` for a lone tensor)."""
    if isinstance(value, torch.Tensor):
        return [(None, value)]
    if isinstance(value, (tuple, list)):
        return [(i, v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def detached(value: Any) -> Any:
    """``value`` with its tensors detached: the remake runs without gradients anyway."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(v.detach() if isinstance(v, torch.Tensor) else v for v in value)
    return value


class SavedStorages:
    """The storages of the values a forward reports, so that each tensor autograd saves of
    one is swapped for a handle naming the value (its ``drop(name, element)``): matched when
    packed if the value is known, else when the value is reported right after the op that
    saved it (an op saving its own output). A storage is recognized by address only while
    it is alive (:func:`graphckpt.torch_compat.storage_alive`): an address freed and given
    to another tensor is never taken for it. Shared by :class:`HookedSegmentModule`'s calls
    and :class:`graphckpt.exact.ScheduledModule`'s."""

    def __init__(self) -> None:
        self.storages: dict[int, tuple[str, int | None, torch.dtype, Any]] = {}
        self.recent: list[Any] = []  # handles packed since the last report, storage not yet known

    def handle(self, saved: Any, key: int) -> Any:
        """``saved`` (a handle holding the packed tensor), dropped now if its storage is known."""
        if not self.match(saved, key):
            self.recent.append(saved)
        return saved

    def match(self, saved: Any, key: int) -> bool:
        hit = self.storages.get(key)
        if hit is None or hit[2] != saved.tensor.dtype or not storage_alive(hit[3]):
            return False
        saved.drop(hit[0], hit[1])
        return True

    def remember(self, name: str, value: Any, keep_first: bool = False) -> None:
        """Know ``value``'s storages as ``name``'s (by element for a tuple); ``keep_first``:
        not a storage already known and alive (a view's is its root's)."""
        for element, tensor in tensors_of(value):
            key, ref = storage_key_and_ref(tensor)
            hit = self.storages.get(key)
            if not (keep_first and hit is not None and storage_alive(hit[3])):
                self.storages[key] = (name, element, tensor.dtype, ref)

    def match_recent(self) -> None:
        """A value was just reported: match what was packed since the last report."""
        for saved in self.recent:
            self.match(saved, storage_key(saved.tensor))
        self.recent.clear()

    def finish(self) -> None:
        """Forward is done: nothing more is packed."""
        self.storages.clear()
        self.recent.clear()


def run_body(module: nn.Module, call: SavedStorages, args: tuple[Any, ...]) -> Any:
    """Run ``module.body`` for ``call`` with its pack hook swapping saved tensors for handles
    (:func:`graphckpt.dropping.unpack_saved` unpacks them), in ``module.label``'s profiler
    range; the call is finished when forward is. Both hook runtimes' forward."""
    try:
        with torch.autograd.graph.saved_tensors_hooks(call.pack, unpack_saved), profiled_range(module.label):
            return module.body.forward(*args, call)  # not fx's call wrapper: ~10 us a call
    finally:
        call.finish()


class _HookedCall(SavedStorages):
    """One call of a hooked segment in a forward backward will use: while forward runs, what
    each group's remake reads (inputs, kept values; afterwards only the handles of the group
    hold it, so each goes once no handle that may remake from it is left) and the storages
    of its marked values; in backward the values made again and the handles of each still
    to be unpacked."""

    def __init__(self, module: HookedSegmentModule, inputs: tuple[Any, ...]) -> None:
        super().__init__()
        self.module = module
        self.autocast = autocast_now(inputs)
        self.reads: list[list[Any]] = [[None] * len(names) for names in module.reads]
        for name, value in zip(module.inputs, inputs, strict=True):
            self._fill(name, value)
        self.known = dict(storage_key_and_ref(t) for t in inputs if isinstance(t, torch.Tensor))  # saved as
        # they are, while alive: a kept value nothing holds goes in forward, and its address can be a marked value's
        self.pending: dict[str, int] = {}
        self.values: dict[str, Any] = {}
        self.held_pending: dict[str, int] = {}  # held value -> unpacks left that may need it
        self.generator_states: dict[str, tuple[torch.device, torch.Tensor]] = {}  # by dropout, for its redraw

    def stash_generator(self, name: str, device: torch.device) -> None:
        """Dropout ``name`` is about to draw on ``device``: keep the generator's state, from
        which its remake draws the same noise again (:func:`graphckpt.dropout.redraw`)."""
        self.generator_states[name] = (device, generator_state(device))

    def pack(self, tensor: torch.Tensor) -> Any:
        key = storage_key(tensor)
        known = self.known.get(key)
        if known is not None and storage_alive(known):
            return tensor
        return self.handle(_Saved(self, tensor), key)

    def mark(self, value: Any, name: str) -> None:
        self.remember(name, value)
        self.match_recent()

    def reads_of(self, name: str) -> Any:
        """What a handle of marked ``name`` keeps for its remake: the group's reads, or with
        held values (``remake_held``) those of every remake making ``name`` may run, by value
        (and one count more of each held value it may need, :meth:`take`)."""
        module = self.module
        if not module.held:
            return self.reads[module.group_of[name]]
        for value in module.held_closure[name]:
            self.held_pending[value] = self.held_pending.get(value, 0) + 1
        return {value: self.reads[module.group_of[value]] for value in module.closure[name]}

    def _fill(self, name: str, value: Any) -> None:
        """Give ``value`` to the remakes that read ``name``."""
        for group, position in self.module.readers.get(name, ()):
            self.reads[group][position] = value

    def keep(self, value: Any, name: str) -> None:
        if name in self.module.readers:  # a remake reads it
            self._fill(name, detached(value))  # its grad_fn may hold handles to this call: no cycle
        for _, tensor in tensors_of(value):
            key, ref = storage_key_and_ref(tensor)
            self.known[key] = ref
        self.recent.clear()

    def _made(self, name: str, reads: dict[str, list[Any]]) -> Any:
        """``name`` made again (:func:`passes.hooked.each_use_schedule`): a held value alive is
        taken as it is; otherwise its remake runs, the held values it reads made first, and a
        held value made is held in ``values``."""
        if name in self.values:
            return self.values[name]
        arguments = list(reads[name])
        for position, source in self.module.held_reads[name]:
            arguments[position] = self._made(source, reads)
        value = self.module.remake(self, name, arguments)[name]
        if name in self.module.held:
            self.values[name] = value
        return value

    def finish(self) -> None:
        """Forward is done: nothing more is packed, so no storage is remembered, and what the
        remakes read is held by their handles alone."""
        super().finish()
        self.reads = []

    def take(self, name: str, element: int | None, reads: Any) -> torch.Tensor:
        if self.module.held:  # made for this unpack from the held values, made first when not alive
            value = self._made(name, reads)
            for held in self.module.held_closure[name]:
                self.held_pending[held] -= 1
                if self.held_pending[held] <= 0:  # no unpack left may need it (a second backward holds none)
                    self.values.pop(held, None)
            return value if element is None else value[element]
        if self.module.each_use:  # made for this unpack alone, held only by what unpacked it
            value = self.module.remake(self, name, reads)[name]
            return value if element is None else value[element]
        if name not in self.values:
            self.values.update(self.module.remake(self, name, reads))
        value = self.values[name]
        self.pending[name] -= 1
        if self.pending[name] <= 0:  # its last handle: a second backward makes it again
            del self.values[name]
        return value if element is None else value[element]


class HookedSegmentModule(nn.Module):
    """One selective segment of a rewritten module run by saved-tensor hooks (see the
    module's docstring). ``body`` takes the segment's inputs and the call's hooks (``None``
    when no backward will run) and returns its outputs; each of ``remakes`` takes the inputs
    and kept values it reads (its placeholders, in order) and returns its group's values
    (``groups``, the marked values by group). With ``each_use`` every group is one value,
    made again at each unpack and held only by what unpacked it
    (:attr:`passes.segments.Segment.remake_each_use`); the values of ``held`` are groups
    too, made before a remake reading them when not alive and then held until no unpack
    left may need them (:attr:`passes.segments.Segment.remake_held`), counted against each
    group's ``closures`` (:func:`passes.hooked.remake_closures`). The graph modules are
    plain attributes, not submodules, so parameters and ``state_dict`` keys stay the model's.
    A profiler's trace names its forward ``graphckpt hooked_0`` (its ``label``) and each
    remake ``graphckpt hooked_0 remake 2`` (the group)."""

    label = "hooked"

    def __init__(self, body: fx.GraphModule, remakes: Sequence[fx.GraphModule], *, nodes: Sequence[str],
                 inputs: Sequence[str], outputs: Sequence[str], groups: Sequence[Sequence[str]],
                 kept: Sequence[str], each_use: bool = False, held: Sequence[str] = (),
                 closures: Sequence[Sequence[str]] = ()) -> None:
        super().__init__()
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "remakes", tuple(remakes))  # what codegen prints as the segment's recipes
        self.nodes, self.inputs, self.outputs = tuple(nodes), tuple(inputs), tuple(outputs)
        self.groups, self.kept = tuple(tuple(group) for group in groups), tuple(kept)
        self.group_of = {name: i for i, group in enumerate(self.groups) for name in group}
        self.reads = tuple(tuple(n.name for n in remake.graph.nodes if n.op == "placeholder" and n.name != STATES)
                           for remake in remakes)
        self.draws = tuple(any(n.op == "placeholder" and n.name == STATES for n in remake.graph.nodes)
                           for remake in remakes)  # its remake draws dropout noise again
        self.readers: dict[str, list[tuple[int, int]]] = {}  # input or kept value -> (group, position)
        for group, names in enumerate(self.reads):
            for position, name in enumerate(names):
                self.readers.setdefault(name, []).append((group, position))
        self.recomputations = 0
        self.each_use = each_use  # each group one value, made again at every unpack
        self.held = frozenset(held)  # each_use: values held once made, until no unpack left may need them
        self.held_reads = {group[0]: tuple((position, name) for position, name in enumerate(names) if name in self.held)
                           for group, names in zip(self.groups, self.reads, strict=True)}
        self.closure = {group[0]: tuple(found) for group, found in zip(self.groups, closures, strict=True)} if held else {}
        self.held_closure = {name: tuple(v for v in found if v in self.held) for name, found in self.closure.items()}
        self.remake_norms = running_stat_norms(m for remake in remakes for m in remake.modules())

    @property
    def marked(self) -> tuple[str, ...]:
        """Every value whose saved copies are dropped, group by group."""
        return tuple(name for group in self.groups for name in group)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body.forward(*args, None)
        return run_body(self, _HookedCall(self, args), args)

    def remake(self, call: _HookedCall, wanted: str, reads: Sequence[Any]) -> dict[str, Any]:
        """The values of ``wanted``'s group in ``call`` made again without gradients from what
        its remake ``reads``: ``wanted`` and those with handles still to unpack."""
        self.__dict__["recomputations"] += 1  # not nn.Module's __setattr__: a few microseconds
        group = self.group_of[wanted]
        norms = frozen_running_stats(self.remake_norms) if self.remake_norms else _NOTHING
        labelled = profiled_range(self.label, "remake", group)
        if self.draws[group]:
            devices = (device for device, _ in call.generator_states.values())
            with torch.no_grad(), call.autocast, norms, restored_generators(devices), labelled:
                made = self.remakes[group].forward(*reads, call.generator_states)
        else:
            with torch.no_grad(), call.autocast, norms, labelled:
                made = self.remakes[group].forward(*reads)
        made = made if isinstance(made, tuple) else (made,)
        return {name: value for name, value in zip(self.groups[group], made, strict=True)
                if name == wanted or call.pending.get(name, 0) > 0}

    def extra_repr(self) -> str:
        return (f"runs {len(self.nodes)} nodes ({self.nodes[0]} .. {self.nodes[-1]}) as eager code; keeps "
                f"{', '.join(self.kept)} and its inputs from forward; drops what its ops saved of "
                f"{', '.join(self.marked)} and makes " + (
                    "each again every time backward unpacks it" + (
                        f", from {len(self.held)} values held once made" if self.held else "") if self.each_use else
                    f"each group of them again when backward first needs one ({len(self.groups)} groups)"))


def mark(hooks: _HookedCall | None, value: Any, name: str) -> Any:
    """Report a marked value just made (emitted by codegen after each one); returns it."""
    if hooks is not None:
        hooks.mark(value, name)
    return value


def keep(hooks: _HookedCall | None, value: Any, name: str) -> Any:
    """Report a value kept from forward just made (emitted after each); returns it."""
    if hooks is not None:
        hooks.keep(value, name)
    return value
