"""What a rewritten module runs for a plan with an exact schedule (:mod:`passes.exact`):
the graph as eager code, whose saved tensors backward takes from what the schedule holds,
and the schedule's steps, each run just before the backward of its op.

A :class:`ScheduledModule` runs its body (every op of the graph, as the model wrote it)
with autograd on, so backward runs forward's own graph. The body reports each value as it
is made (``made(hooks, value, "name")`` in ``print(gm.code)``); the pack hook swaps every
saved tensor sharing a value's storage for a handle (:class:`graphckpt.hooked.PendingSaved`, matched as in
:mod:`graphckpt.hooked`: by storage while it is alive, an op's saved output when the value
is reported right after the op). The values the schedule keeps go into the call's
``cache``; every other value goes when eager code lets it go. For each op with a
:class:`passes.schedule.ScheduleStep` a hook on the op's ``grad_fn`` runs the step just before
autograd runs that backward: it lets go what the schedule no longer holds and makes values
again without gradients (``exact_0_step_op12`` in ``print(gm.code)``: it reads and writes
``cache``), and each handle autograd unpacks takes its value from ``cache``.

**Extras.** What an op saves beyond values (max-pool's indices) autograd keeps from forward,
unless the schedule drops it (``dropped_extras``): then the tensors that op packs that match
no value become handles too, keyed ``"extra:<op>"`` and their position among the extras,
and the step that makes it again runs the op with autograd on, its inputs detached and
requiring grad where forward's did, collecting what it packs
(:func:`with_autograd_for_saved_extras`): the extras are the tensors at the positions
forward's were, held in ``cache`` under that key until the schedule lets them go.

**Gradients.** Only what backward saved is replaced, by a value computed by the same pure
ops from the same tensors (:func:`passes.schedule.check_schedule`), so gradients are eager's.
A graph backward runs through twice (``retain_graph=True``) is refused at the second
backward: the steps of the first have let go what they made.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from graphckpt.dropping import autocast_now
from graphckpt.hooked import PendingSaved, SavedStorages, detached, run_body
from graphckpt.state import frozen_running_stats, running_stat_norms
from graphckpt.torch_compat import profiled_range, storage_key
from passes.schedule import extra_key


class _Saved(PendingSaved):
    """A scheduled call's handle: the value is taken from what the schedule holds."""

    __slots__ = ()

    def value(self) -> torch.Tensor:
        value = self.call.take(self.name)
        return value if self.element is None else value[self.element]


class StepCache(dict):
    """What a scheduled call holds through backward, by name (values, inputs the steps
    read, ``"extra:<op>"`` extras), and for each op whose extra forward dropped, where its
    extras were among the tensors it packed: ``(positions, how many it packed)``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.extra_packs: dict[str, tuple[tuple[int, ...], int]] = {}


class _ScheduledCall(SavedStorages):
    """One call of a scheduled module in a forward backward will use: the storages of its
    values while forward runs, and ``cache``, what the schedule holds, through backward."""

    def __init__(self, module: ScheduledModule, inputs: Sequence[Any]) -> None:
        super().__init__()
        self.module = module
        self.autocast = autocast_now(inputs)
        self.cache = StepCache({name: value for name, value in zip(module.inputs, inputs, strict=True)
                                if name in module.read_by_steps})
        self.done: set[str] = set()  # steps run
        self.packs: list[_Saved] = []  # every handle packed since the last value reported, in order

    def pack(self, tensor: torch.Tensor) -> Any:
        saved = _Saved(self, tensor)
        self.packs.append(saved)
        return self.handle(saved, storage_key(tensor))

    def made(self, value: Any, name: str) -> None:
        """Forward made value ``name``: remember the storages of an op's own value (a tuple's
        by element; a view's or element's are its root's, already remembered; an input's are
        never dropped), keep it if the schedule does, and hook its ``grad_fn`` if a step runs
        before its backward."""
        module = self.module
        if module.storage_of.get(name) == name:
            self.remember(name, value, keep_first=True)
        self.match_recent()
        packs, self.packs = self.packs, []
        if name in module.dropped_extras:
            self.drop_extras(name, packs)
        if name in module.kept:
            self.cache[name] = detached(value)
        if name in module.steps:
            if not (isinstance(value, torch.Tensor) and value.grad_fn is not None):
                raise RuntimeError(f"graphckpt: the exact schedule runs a step before the backward of {name!r}, "
                                   "but its value has no grad_fn to hook: the plan expected a gradient to reach it "
                                   "(were parameters frozen after graphckpt.rewrite? rewrite again after such a "
                                   "change, or plan with a strategy such as 'sqrt')")
            value.grad_fn.register_prehook(lambda grads, op=name: self.run_step(op))

    def drop_extras(self, op: str, packs: list[_Saved]) -> None:
        """Op ``op``, just run, saved ``packs``: those matching no value are its extras, which
        the schedule holds (from here if it keeps them from forward), not autograd."""
        positions = tuple(i for i, saved in enumerate(packs) if saved.tensor is not None)
        if not positions:
            raise RuntimeError(f"graphckpt: the exact schedule makes the extra of {op!r} again (what its backward "
                               "saves beyond values), but in forward it saved no tensor beyond values: the cost graph "
                               "does not match this model; rewrite again (graphckpt.rewrite), or with exact=False")
        key = extra_key(op)
        if op in self.module.kept_extras:
            self.cache[key] = tuple(packs[i].tensor.detach() for i in positions)
        for element, i in enumerate(positions):
            packs[i].drop(key, element)
        self.cache.extra_packs[op] = (positions, len(packs))

    def run_step(self, op: str) -> None:
        if op in self.done:
            raise RuntimeError(f"graphckpt: backward of {op!r} runs a second time through a graph whose exact "
                               "schedule has run; backward twice through one forward (retain_graph=True) is not "
                               "supported by such a plan: rewrite with exact=False (graphckpt.rewrite(..., "
                               "budget=..., exact=False)) for a plan that supports it")
        self.done.add(op)
        norms = self.module.step_norms.get(op)  # a BatchNorm made again must not count its batch twice
        with (torch.no_grad(), self.autocast, profiled_range(self.module.label, "step", op),
              frozen_running_stats(norms) if norms else contextlib.nullcontext()):
            self.module.steps[op].forward(self.cache)

    def take(self, name: str) -> Any:
        try:
            return self.cache[name]
        except KeyError:
            raise RuntimeError(f"graphckpt: backward needs {name!r}, which the exact schedule does not hold "
                               "there (a bug: please report it with the plan)") from None


class ScheduledModule(nn.Module):
    """A plan's exact schedule at run time (see the module's docstring). ``body`` takes the
    graph's inputs and the call's hooks (``None`` when no backward will run) and returns its
    outputs; ``steps`` maps an op to the module that runs before its backward, taking the
    call's ``cache``; ``storage_of`` maps each value made in an op's storage to that op's value
    (:attr:`passes.schedule.Schedule.storages`); ``dropped_extras`` names the ops whose extras
    forward swaps for handles, ``kept_extras`` those of them it holds in ``cache`` (see the
    module's docstring). The graph modules are plain attributes, not submodules, so
    parameters and ``state_dict`` keys stay the model's."""

    label = "exact"

    def __init__(self, body: fx.GraphModule, steps: Mapping[str, fx.GraphModule], *, nodes: Sequence[str],
                 inputs: Sequence[str], outputs: Sequence[str], kept: Sequence[str],
                 storage_of: Mapping[str, str], dropped_extras: Sequence[str] = (),
                 kept_extras: Sequence[str] = ()) -> None:
        super().__init__()
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "steps", dict(steps))
        self.nodes, self.inputs, self.outputs, self.kept = tuple(nodes), tuple(inputs), tuple(outputs), frozenset(kept)
        self.storage_of = dict(storage_of)  # value -> the op value whose storage it is
        self.dropped_extras, self.kept_extras = frozenset(dropped_extras), frozenset(kept_extras)
        self.step_norms = {op: norms for op, step in self.steps.items() if (norms := running_stat_norms(step.modules()))}
        self.read_by_steps = frozenset(node.args[1] for step in self.steps.values() for node in step.graph.nodes
                                       if node.op == "call_function" and node.target is operator.getitem)

    def with_autograd(self, op: str) -> tuple[str, ...]:
        """The ops the step before the backward of ``op`` runs with autograd on, for their extras."""
        return tuple(node.args[1] for node in self.steps[op].graph.nodes
                     if node.op == "call_function" and node.target is with_autograd_for_saved_extras)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body.forward(*args, None)
        return run_body(self, _ScheduledCall(self, args), args)

    def extra_repr(self) -> str:
        made = sum(1 for step in self.steps.values() for node in step.graph.nodes
                   if node.op == "call_function" and node.target is operator.setitem)
        extras = ', '.join(sorted(self.dropped_extras))
        return (f"runs {len(self.nodes)} nodes as eager code; keeps {', '.join(sorted(self.kept)) or 'nothing'} "
                f"from forward and makes {made} values again in {len(self.steps)} steps, each just before "
                "the backward of its op" + (f"; takes the extras of {extras} from autograd in forward: the schedule "
                                           "holds them" if extras else ""))


def made(hooks: _ScheduledCall | None, value: Any, name: str) -> Any:
    """Report a value just made (emitted by codegen after each one); returns it."""
    if hooks is not None:
        hooks.made(value, name)
    return value


def needing_grad(value: torch.Tensor) -> torch.Tensor:
    """``value`` as a new leaf requiring grad (emitted in a step before an op run again for
    its extra, for each input whose forward value required grad: the op saves what it
    saved in forward only then)."""
    return value.detach().requires_grad_()


def with_autograd_for_saved_extras(cache: StepCache, op: str, function: Any, args: tuple[Any, ...],
                                   kwargs: dict[str, Any]) -> Any:
    """Run op ``op`` (``function``, or the method of that name of ``args[0]``) with autograd
    on, for what it saves beyond values (max-pool's indices, which no step can make without
    gradients): its extras, the tensors it packs at the positions forward's extras were,
    go into ``cache`` under ``"extra:<op>"``; returns its value, detached."""
    if op not in cache.extra_packs:
        raise RuntimeError(f"graphckpt: a step runs {op!r} again for its extra, but forward did not drop it: the "
                           "schedule and this module disagree (a bug: please report it with the plan)")
    positions, count = cache.extra_packs[op]
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> int:
        packed.append(tensor)
        return len(packed) - 1

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, packed.__getitem__):
        value = getattr(args[0], function)(*args[1:], **kwargs) if isinstance(function, str) else function(*args, **kwargs)
    if len(packed) != count:
        raise RuntimeError(f"graphckpt: {op!r}, run again for its extra just before a backward, saved {len(packed)} "
                           f"tensors where forward saved {count}, so its extra cannot be told apart: rewrite with "
                           "exact=False (graphckpt.rewrite(..., exact=False)), or report it with the model")
    cache[extra_key(op)] = tuple(packed[i].detach() for i in positions)
    return detached(value)
