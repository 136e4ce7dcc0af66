"""One deduplicated profiling run: the interpreter that profiles the first call of each
:func:`graphckpt.op_keys.node_key` (its *representative*) and runs every later one as a ghost
(:mod:`graphckpt.ghosts`), then checks each ghost's gradients against its representative's
(:mod:`graphckpt.gradient_watch`). Whether to deduplicate, the retries and the fallback to the
full profile are :mod:`graphckpt.op_dedup`'s; split from it so the driver reads apart from the
per-node decisions it drives.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn

from graphckpt.ghosts import Ghost, GhostCall, Template, ViewTemplate, first_slots
from graphckpt.gradient_watch import GradientWatch
from graphckpt.lazy_fake import LazyFake, empty_like_layout, strided_bytes
from graphckpt.node_cost import with_plain_forward
from graphckpt.node_gradients import gradients_made, param_grad_bytes, param_grads
from graphckpt.op_keys import module_signature, node_key, same_parameters, tensor_layout, users_key
from graphckpt.op_kinds import caching_devices
from graphckpt.profile import PARAM, AddedScratch, _CostInterpreter
from graphckpt.scratch import KERNEL_EXTRA
from graphckpt.scratch import call_key as kernel_call_key
from graphckpt.torch_compat import (
    FakeTensor,
    module_registries,
    storage_key,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
)
from graphckpt.written import mutated_arguments

CALLS = ("call_function", "call_method", "call_module")
_MISSING = object()


class DedupMismatch(Exception):
    """A ghost's gradients differed from its representative's: profile again with those
    representatives' keys not shared (``representatives``), or without dedup."""

    def __init__(self, message: str, representatives: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.representatives = representatives


class DedupInterpreter(_CostInterpreter):
    """:class:`graphckpt.profile._CostInterpreter` that runs each distinct call once."""

    def __init__(self, lazy: LazyFake, *, backward: bool = True, banned: frozenset[Hashable] = frozenset()) -> None:
        super().__init__(lazy.module, lazy.mode, backward=backward)
        self.lazy = lazy
        self.templates: dict[Hashable, Any] = dict.fromkeys(banned)  # None: profile every node of the key
        self.keys: dict[str, Hashable] = {}  # representative -> its key
        self.signatures: dict[int, Hashable | None] = {}
        self.ghosts: dict[str, str] = {}  # ghost -> its representative
        self.gradients = GradientWatch()
        self.last_claimed: list[Any] = []
        self.last_recorded = False  # the node just profiled has backward calls of its own on record
        self.nodes = {node.name: node for node in lazy.module.graph.nodes}
        self.submodule = lazy.module.get_submodule
        self.caching = caching_devices()  # autocast caches parameter casts: see _casts_cached
        self.leaf_inputs: set[str] = set()  # placeholders holding leaf tensors requiring grad (cast once, too)

    def _claim_grad_fns(self, result: Any, name: str | None) -> list[Any]:
        self.last_claimed = super()._claim_grad_fns(result, name)
        self.last_recorded = name is not None and bool(self.last_claimed)
        return self.last_claimed

    # ------------------------------------------------------------ fake tensors, lazily

    def _fake_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The fake of a model tensor, made once; a parameter's until a ``get_attr`` node
        owns it (a weight tied to another module's stays owned by the first node read)."""
        fake = self.lazy.fakes.get(id(tensor))
        if fake is None:
            fake = self.mode.from_tensor(tensor)  # a parameter's is one already (its meta copy's _is_param)
            if isinstance(tensor, nn.Parameter) and not isinstance(fake, nn.Parameter):
                fake = nn.Parameter(fake, tensor.requires_grad)
            self.lazy.fakes[id(tensor)] = fake
        self.owner.setdefault(storage_key(fake), PARAM)
        if id(tensor) in self.param_names:
            self.param_names[id(fake)] = self.param_names[id(tensor)]
        return fake

    def _make_fake(self, node: fx.Node) -> None:
        """Swap the real tensors a profiled ``call_module`` or ``get_attr`` node reads for fakes."""
        if node.op == "call_module":
            modules = list(self.module.get_submodule(node.target).modules())
        elif node.op == "get_attr":
            path, _, _ = str(node.target).rpartition(".")
            modules = [self.module.get_submodule(path)]
        else:
            return
        for module in modules:
            for registry in module_registries(module)[1:]:
                for name, tensor in registry.items():
                    if tensor is not None and not isinstance(tensor, FakeTensor):
                        registry[name] = self._fake_of(tensor)

    # ------------------------------------------------------------ keys

    def call_key(self, node: fx.Node, args: tuple, kwargs: dict) -> Hashable | None:
        """:func:`graphckpt.op_keys.node_key` of ``node`` (a module by its signature, once)."""
        if node.op == "call_module":
            module = self.submodule(node.target)
            if id(module) not in self.signatures:
                self.signatures[id(module)] = module_signature(module)
            target: Hashable = self.signatures[id(module)]
            if target is None:
                return None
        else:
            target = node.target
        users = users_key(node, self.submodule) if self.backward and torch.is_grad_enabled() else ()
        return node_key(node, target, args, kwargs, self.owner, PARAM, self.module.training, users)

    # ------------------------------------------------------------ running

    def run_node(self, node: fx.Node) -> Any:
        if node.op not in CALLS or mutated_arguments(self.module, node):
            self._make_fake(node)
            result = super().run_node(node)
            if node.op == "placeholder" and isinstance(result, torch.Tensor) and result.is_leaf and result.requires_grad:
                self.leaf_inputs.add(node.name)
            return result
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        key = self.call_key(node, args, kwargs)
        template = _MISSING if key is None else self.templates.get(key, _MISSING)
        if isinstance(template, Template) and not self._casts_cached(node, template.name):
            return self._ghost(node, template, args, kwargs)
        if isinstance(template, ViewTemplate):
            result = self._view_ghost(node, template, args, kwargs)
            if result is not _MISSING:
                return result
        self.last_claimed, self.last_recorded = [], False
        self._make_fake(node)
        result = super().run_node(node)
        if key is not None and template is _MISSING:
            self.templates[key] = self._view_template(node, args, kwargs) or self._template(node, args, kwargs, result)
            self.keys[node.name] = key
        return result

    def _template(self, node: fx.Node, args: tuple, kwargs: dict, result: Any) -> Template | None:
        """The representative's template, or ``None`` when its later copies must run too:
        outputs that are views or not tensors, saved values it cannot name by input. A
        random op (dropout) has ghosts too: on fake tensors nothing is drawn, and the mask
        it saves is its own, as a ghost's would be."""
        inputs = _tensors((args, kwargs))
        outputs, spec = tree_flatten(result)
        cost = self.costs[node.name]
        if not outputs or not all(isinstance(t, torch.Tensor) for t in outputs) or cost.alias_of or cost.grad_views:
            return None
        keys = [storage_key(t) for t in outputs]
        if len(set(keys)) != len(keys) or any(self.owner.get(k) != node.name for k in keys) or any(
                t.storage_offset() or t.untyped_storage().nbytes() != strided_bytes(t) for t in outputs):
            return None
        owners = self._owners(inputs)
        saved = tuple(None if name == node.name else owners.index(name) if name in owners else -1 for name in cost.saved)
        eval_alias = owners.index(cost.eval_alias_of) if cost.eval_alias_of in owners else None
        if -1 in saved or (cost.eval_alias_of is not None and eval_alias is None) or (
                any(t.requires_grad for t in outputs) and not any(t.requires_grad for t in inputs)):
            return None
        if self.backward and torch.is_grad_enabled():
            self.gradients.watch(node.name, outputs, inputs, self.last_claimed)
        return Template(node.name, cost, spec, tuple(tensor_layout(t) for t in outputs),
                        tuple(t.requires_grad for t in outputs), saved, eval_alias)

    def _owners(self, inputs: list[torch.Tensor]) -> list[str | None]:
        """The node owning each input's storage: what a template names its inputs by."""
        return [self.owner.get(storage_key(t)) for t in inputs]

    def _view_template(self, node: fx.Node, args: tuple, kwargs: dict) -> ViewTemplate | None:
        """A :class:`ViewTemplate` for a function call that made no memory, saved nothing
        and drew nothing; ``None`` for any other call."""
        cost = self.costs[node.name]
        if node.op == "call_module" or cost.bytes or cost.saved or cost.saved_extra_bytes or cost.random \
                or cost.forward_extra_bytes:
            return None
        owners = self._owners(_tensors((args, kwargs)))
        if cost.alias_of is not None and cost.alias_of not in owners:
            return None
        return ViewTemplate(node.name, cost, None if cost.alias_of is None else owners.index(cost.alias_of),
                            self.last_recorded)

    def _view_ghost(self, node: fx.Node, template: ViewTemplate, args: tuple, kwargs: dict) -> Any:
        """``node``'s op run as it is (it makes no memory), with its representative's
        figures; ``_MISSING`` when its outputs do not lie where the representative's did
        (then it is profiled like any other node)."""
        with self.mode:
            result = fx.Interpreter.run_node(self, node)
        inputs = _tensors((args, kwargs))
        outputs = _tensors(result)
        alias = None if template.alias is None else self.owner.get(storage_key(inputs[template.alias]))
        if any(storage_key(t) not in self.owner for t in outputs) or (
                outputs and self.owner[storage_key(outputs[0])] != (alias or PARAM)):
            return _MISSING
        self.costs[node.name] = replace(template.cost, alias_of=alias, param_grad_bytes=param_grad_bytes(self.module, node),
                                        param_grads=param_grads(self.module, node, self.param_names))
        self.keep_alive.append((result, []))
        if self.backward:
            self.pass_through.watch(node.name, self._claim_grad_fns(result, node.name if template.recorded else None))
        return result

    def _casts_cached(self, node: fx.Node, representative: str) -> bool:
        """Whether ``node`` calls ``representative``'s very parameters again (ALBERT's shared
        layer) under an autocast that caches their casts: it makes no cast of its own, and its
        backward adds into the same weight gradients, so it is profiled, not ghosted (a ghost
        inherited the casts, and what the first call's backward lets go early). Parameters
        dynamo passes a backend as graph inputs count (:attr:`leaf_inputs`)."""
        return bool(self.caching) and same_parameters(node, self.nodes[representative], self.leaf_inputs)

    def _ghost(self, node: fx.Node, template: Template, args: tuple, kwargs: dict) -> Any:
        inputs = _tensors((args, kwargs))
        with self.mode:
            if self.backward and torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
                first = first_slots(inputs)
                slots = tuple(first[i] if t.grad_fn is not None else None for i, t in enumerate(inputs))
                call = GhostCall(self.mode, self.gradients.emitted_by(node.name), template, slots)
                outputs = Ghost.apply(call, *inputs)
            else:
                outputs = tuple(empty_like_layout(self.mode, layout) for layout in template.outputs)
        if tuple(t.requires_grad for t in outputs) != template.requires_grad:
            raise DedupMismatch(f"{node.name}: requires_grad differs from {template.name}'s")
        for tensor in outputs:
            self.owner[storage_key(tensor)] = node.name
        saved = tuple(node.name if slot is None else self.owner[storage_key(inputs[slot])] for slot in template.saved)
        eval_alias = None if template.eval_alias is None else self.owner[storage_key(inputs[template.eval_alias])]
        self.costs[node.name] = replace(template.cost, saved=tuple(dict.fromkeys(saved)), eval_alias_of=eval_alias,
                                        param_grad_bytes=param_grad_bytes(self.module, node),
                                        param_grads=param_grads(self.module, node, self.param_names))
        result = tree_unflatten(list(outputs), template.spec)
        self.keep_alive.append((result, []))
        self.ghosts[node.name] = template.name
        if self.backward:
            self._claim_grad_fns(result, None)
            self.gradients.watch(node.name, list(outputs), inputs)
        return result

    def add_forward_scratch(self) -> dict[str, AddedScratch]:
        """As the full profile's, and each ghost gets its representative's."""
        added = super().add_forward_scratch()
        for ghost, representative in self.ghosts.items():
            if representative in added:
                cost, scratch = self.costs[ghost], added[representative]
                cost = replace(cost, forward_extra_bytes=cost.forward_extra_bytes + scratch.forward,
                               cached_rerun_extra_bytes=(cost.cached_rerun_extra_bytes or 0) + scratch.rerun)
                self.costs[ghost] = cost if scratch.plain is None else with_plain_forward(cost, scratch.plain)
                added[ghost] = added[representative]
        return added

    # ------------------------------------------------------------ checking the backward

    def backward_extra_bytes(self, outputs: Any, inputs: list[torch.Tensor]) -> None:
        """As the full profile's, then each ghost's from its representative's, once every
        ghost's gradients are checked to be its representative's."""
        if not self.run_backward(outputs, inputs):
            if self.ghosts:
                raise DedupMismatch("no backward ran")
            return
        self.assign_pass_through()
        self.assign_backward_extra()
        differing = self.gradients.differing(self.ghosts)
        if differing:
            raise DedupMismatch(f"ghosts of {sorted(differing)[:3]} got other gradients", differing)
        recorded: dict[str, tuple[int, bool]] = {}  # representative -> (most its backward holds, allocates)
        for ghost, representative in self.ghosts.items():
            calls = self.recorder.calls.get(representative)
            if not calls:
                continue
            if representative not in recorded:
                scratches = [KERNEL_EXTRA.get(kernel_call_key(*call), 0) for call in calls]
                recorded[representative] = (self.recorder.most_with_scratch(representative, scratches)[0],
                                            self.recorder.allocates(representative))
            most, allocates = recorded[representative]
            self.costs[ghost] = replace(self.costs[ghost],
                                        backward_extra_bytes=max(0, most - gradients_made(self.costs, self.nodes[ghost])),
                                        released_early=self._ghost_released(ghost, representative),
                                        backward_allocates=allocates,
                                        unpack_held_bytes=self.costs[representative].unpack_held_bytes)

    def assign_pass_through(self) -> None:
        """As the full profile's, and each ghost passes its gradient through where its
        representative does (its own backward, :class:`graphckpt.ghosts.Ghost`'s, makes fakes)."""
        super().assign_pass_through()
        for ghost, representative in self.ghosts.items():
            if self.costs[representative].grad_views and not self.costs[ghost].grad_views:
                self.costs[ghost] = replace(self.costs[ghost], grad_views=True)

    def _ghost_released(self, ghost: str, representative: str) -> tuple[str, ...]:
        """The representative's ``released_early``, named by the ghost's own saved values
        (none where the two save a different number of values)."""
        mine, theirs = self.costs[ghost].saved, self.costs[representative].saved
        if len(mine) != len(theirs):
            return ()
        as_mine = dict(zip(theirs, mine, strict=True))
        return tuple(as_mine[value] for value in self.costs[representative].released_early if value in as_mine)


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors among a call's arguments or results, in order."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
