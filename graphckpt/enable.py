"""Checkpointing in place: the model keeps its class, its module tree and its hooks.

    graphckpt.enable(model, (ids,), budget=0.5)   # returns model itself
    loss = model(ids).loss; loss.backward()        # the training loop is unchanged
    graphckpt.disable(model)

:func:`enable` plans over the whole model as :func:`graphckpt.rewrite` does, but only among
plans a module tree can carry out itself: recompute blocks (the repeated layers of a
``ModuleList``/``Sequential``, or the modules named in ``blocks=``), all of them or, to fit a
budget, the mix that recomputes least: some blocks whole, some selectively (their matmul and
convolution outputs kept from forward, as torch's selective checkpointing does), the rest not
at all (:func:`passes.block_plan.block_plan`). Each recomputed block's ``forward`` is then
wrapped in ``torch.utils.checkpoint`` on the instance, so

* the model is still an instance of its class (``generate``, ``save_pretrained``, Trainer);
* the block's own forward hooks run (FSDP2's ``fully_shard`` per block all-gathers its
  parameters around it, as with ``checkpoint_wrapper``);
* any batch size and sequence length runs (the model's own code runs, not a traced graph;
  the plan was chosen at the example's shapes and says so);
* ``eval()`` and ``torch.no_grad()`` run the original forward, with no checkpointing at all;
* a Hugging Face model builds no KV cache in a training call (``use_cache=False``, as
  ``gradient_checkpointing_enable()`` does, :mod:`graphckpt.kv_cache`);
* a recompute replays the random draws of forward and does not update BatchNorm's running
  statistics, or any buffer the block's forward writes (a batch counter), a second time;
* a recompute runs on the lists and dicts the block was handed as they were before its
  forward, which may write into them (HRNet's ``x[i] = branch(x[i])``: with torch's
  checkpoint alone, every gradient upstream of such a block was wrong);
* a block holding a module with hooks of its own (a forward hook collecting its output,
  ``spectral_norm``'s power iteration) or a torch module updating its own buffers
  (``parametrizations.spectral_norm``) is not recomputed: a recompute would run the hooks,
  or move the buffers, a second time (:mod:`graphckpt.module_hooks`, :mod:`graphckpt.leaf_modules`);
* a block called under another autocast state than the plan was made under warns
  (:func:`graphckpt.planned_inputs.warn_if_autocast_differs`): plan under the autocast you
  train with. Measured on CPU (zoo GPT and ResNet, bf16 around forward): planned and run
  under it, 1.00x the simulated peak; planned under it and run without, 1.11-1.35x.

Plans that cut inside a block (nested segments, values dropped or kept one by one) need the
rewritten graph: use :func:`graphckpt.rewrite` for those.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from graphckpt.api import cost_model
from graphckpt.capture import block_paths
from graphckpt.dropping import autocast_uncached
from graphckpt.kv_cache import training_calls_without_cache
from graphckpt.leaf_modules import updates_own_buffers
from graphckpt.module_hooks import hook_kinds
from graphckpt.planned_inputs import warn_if_autocast_differs
from graphckpt.segment_calls import keep_matmul_outputs
from graphckpt.state import RUNNING_STATS, frozen_buffers, running_stat_norms
from graphckpt.torch_compat import call_hooks_set_aside, tensor_version
from passes.block_plan import block_plan
from passes.blocks import recomputed_blocks, selective_blocks
from passes.budget import Budget, parse_budget
from passes.plan import Plan
from passes.segments import PlanError
from passes.simulate import eager_peak

PLAN_ATTRIBUTE = "graphckpt_plan"
CACHE_HOOK_ATTRIBUTE = "graphckpt_cache_hook"  # the handle of graphckpt.kv_cache's pre-hook


def enable(model: nn.Module, example_inputs: Any = None, *, example_kwargs: Mapping[str, Any] | None = None,
           budget: Budget | None = None, cost: str = "flops", blocks: Sequence[str] | None = None) -> nn.Module:
    """Checkpoint ``model``'s blocks in place and return ``model``: every block, or for
    ``budget`` (a fraction of eager's simulated peak, bytes, or ``"2GiB"``) the mix of
    blocks recomputed whole and selectively that fits it with the least recompute.
    ``model.graphckpt_plan`` holds the plan; :func:`disable` undoes it.

    Raises :class:`passes.segments.PlanError` when the model has no blocks and
    :class:`passes.budget.BudgetError` naming the smallest peak when the budget is too small.
    """
    if is_enabled(model):
        disable(model)
    own = _own_checkpointing(model)
    if own:
        warnings.warn(f"the model already checkpoints its layers ({own[0]}); layers would be recomputed twice: "
                      f"call {own[1]} first", stacklevel=2)
    paths = block_paths(model, blocks)
    hooked = _hooks_inside(model, paths)
    with call_hooks_set_aside(model.get_submodule(path) for path in paths):
        # a block's own hooks run outside its checkpoint: recomputing it does not rerun them
        _, graph = cost_model(model, example_inputs, example_kwargs=example_kwargs, cost=cost, blocks=blocks,
                              blocks_left_whole=hooked)
    graph.graph["hooks"] = False  # a block's forward runs under torch's (selective) checkpoint
    plan = block_plan(graph, None if budget is None else parse_budget(budget, eager_peak(graph)))
    shapes = _shapes(example_inputs, example_kwargs)
    if shapes:
        note = f"enable: planned for inputs of shapes {shapes}; other shapes run the same blocks checkpointed"
        plan = replace(plan, notes=(*plan.notes, note))
    selective = set(selective_blocks(graph, plan.segments))
    for name in recomputed_blocks(graph, plan.segments):
        checkpoint_forward(model.get_submodule(name), selective=name in selective, planned=plan)
    object.__setattr__(model, PLAN_ATTRIBUTE, plan)
    object.__setattr__(model, CACHE_HOOK_ATTRIBUTE, training_calls_without_cache(model))
    return model


def _own_checkpointing(model: nn.Module) -> tuple[str, str] | None:
    """How ``model`` checkpoints its own layers, and how to switch that off: Hugging Face's
    ``gradient_checkpointing_enable()``, timm's ``set_grad_checkpointing()``; or None."""
    renamed = hasattr(type(model), "is_activation_checkpointing")  # transformers 5's name
    if getattr(model, "is_activation_checkpointing" if renamed else "is_gradient_checkpointing", False):
        return "gradient_checkpointing_enable()", "model.gradient_checkpointing_disable()"
    if any(getattr(module, "grad_checkpointing", False) is True for module in model.modules()):
        return "timm's set_grad_checkpointing()", "model.set_grad_checkpointing(False)"
    return None


def _hooks_inside(model: nn.Module, paths: Sequence[str]) -> dict[str, list[str]]:
    """The blocks of ``paths`` holding modules with hooks of their own (the block's own run
    outside its checkpoint) or torch modules that update their own buffers as they run
    (:func:`graphckpt.leaf_modules.updates_own_buffers`: ``spectral_norm``'s parametrization),
    with those modules: a recompute of the block would run their hooks, or move their
    buffers, a second time in the step. Raises :class:`PlanError` naming them when every
    block holds some."""
    hooked = {}
    for path in paths:
        inside = [f"{path}.{name}" for name, module in model.get_submodule(path).named_modules()
                  if name and (hook_kinds(module) or updates_own_buffers(module))]
        if inside:
            hooked[path] = inside
    if paths and len(hooked) == len(paths):
        named = [name for inside in hooked.values() for name in inside]
        raise PlanError(f"no block can be recomputed whole: modules inside them have hooks or update buffers of "
                        f"their own ({', '.join(named[:3])}{', ...' if len(named) > 3 else ''}), which a recompute "
                        "would run a second time. graphckpt.rewrite(model, example_inputs) recomputes around "
                        "such modules.")
    return hooked


def disable(model: nn.Module) -> nn.Module:
    """Give every block of ``model`` the forward it had before :func:`enable`; returns ``model``."""
    for module in model.modules():
        wrapped = module.__dict__.get("forward")
        if isinstance(wrapped, CheckpointedForward):
            del module.__dict__["forward"]
            if wrapped.replaced is not None:  # an instance forward someone else had set
                module.__dict__["forward"] = wrapped.replaced
    model.__dict__.pop(PLAN_ATTRIBUTE, None)
    cache_hook = model.__dict__.pop(CACHE_HOOK_ATTRIBUTE, None)
    if cache_hook is not None:
        cache_hook.remove()
    return model


def is_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable` has checkpointed blocks of ``model``."""
    return PLAN_ATTRIBUTE in model.__dict__


def enabled_plan(model: nn.Module) -> Plan | None:
    """The plan :func:`enable` carried out on ``model``, or None."""
    return model.__dict__.get(PLAN_ATTRIBUTE)


def checkpoint_forward(module: nn.Module, *, selective: bool = False, planned: Plan | None = None) -> None:
    """Wrap ``module``'s forward, on the instance, in non-reentrant ``checkpoint`` while it
    trains with gradients; its hooks (called by ``nn.Module.__call__``) stay outside.
    ``selective``: keep its matmul/convolution outputs from forward and rerun only the rest.
    ``planned``: the plan it is part of, whose autocast state each call checks."""
    module.__dict__["forward"] = CheckpointedForward(module, selective=selective, planned=planned)


class CheckpointedForward:
    """A block's forward, recomputed in backward while the block trains with gradients, run
    as it is otherwise (``eval()``, ``no_grad``). An object, not a closure, so that a deep copy
    or a pickle of the model (EMA copies, ``torch.save``) carries it bound to the copy."""

    def __init__(self, module: nn.Module, *, selective: bool = False, planned: Plan | None = None) -> None:
        self.module = module
        self.selective = selective
        self.planned = (planned.autocast, planned.peak_bytes) if planned is not None else None
        self.replaced = module.__dict__.get("forward")  # an instance forward set before, if any
        self.original = module.forward
        self.recomputations = 0  # how often backward has rerun it
        self.buffers = [(path, *_owner(module, path)) for path, _ in module.named_buffers()]
        self.written: set[str] = set()  # paths of its buffers forward has written, seen as it runs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.module.training and torch.is_grad_enabled()):
            return self.original(*args, **kwargs)
        if torch.compiler.is_compiling():  # a compiled block (regional compilation): the
            # partitioner recomputes from the graph, so there is no recompute to count or guard
            context = {"context_fn": _selective_contexts} if self.selective else {}
            return checkpoint(self.original, *args, use_reentrant=False, preserve_rng_state=True, **context, **kwargs)
        if self.planned is not None:
            warn_if_autocast_differs(*self.planned)
        before = self._buffer_identities()
        function, checkpointed_args, checkpointed_kwargs = _recomputable_call(self.original, args, kwargs)
        with autocast_uncached([*args, *kwargs.values()]):  # its layer's weight copies go with each op
            output = checkpoint(function, *checkpointed_args, use_reentrant=False, preserve_rng_state=True,
                                context_fn=self._contexts, **checkpointed_kwargs)
        after = self._buffer_identities()
        self.written.update(path for (path, _, _), old, new in zip(self.buffers, before, after, strict=True) if old != new)
        return output

    def _buffer_identities(self) -> list[tuple[int, int] | None]:
        """Each of the block's buffers as (object, version): what changes when its forward
        writes into one or assigns another tensor in its place."""
        return [None if (buffer := getattr(owner, name)) is None else (id(buffer), tensor_version(buffer))
                for _, owner, name in self.buffers]

    def _contexts(self) -> tuple[Any, Any]:
        """Forward as it is (keeping matmul outputs, if selective); the recompute counted,
        with running statistics kept as forward left them (a recompute must not count a batch
        twice)."""
        if not self.selective:
            return contextlib.nullcontext(), self._recomputing()
        caching, cached = _selective_contexts()
        # the scratch copies of running statistics are made before the selective mode is
        # entered: it would take their clones for forward's ops and fail the recompute
        return caching, _both(self._recomputing(), cached)

    @contextlib.contextmanager
    def _recomputing(self) -> Iterator[None]:
        self.recomputations += 1
        stats = [(norm, name) for norm in running_stat_norms(self.module.modules()) for name in RUNNING_STATS]
        written = [(owner, name) for path, owner, name in self.buffers if path in self.written]
        with frozen_buffers(list(dict.fromkeys(stats + written))):
            yield


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    """``(submodule, attribute)`` holding the buffer at ``path`` under ``module``."""
    owner, _, name = path.rpartition(".")
    return module.get_submodule(owner), name


def _recomputable_call(forward: Callable[..., Any], args: tuple,
                       kwargs: dict[str, Any]) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """``(function, args, kwargs)`` for ``checkpoint``, whose recompute calls ``function`` on
    the arguments forward had: where they hold lists or dicts, which forward may write into,
    it gets copies of them as they were before forward."""
    if not _holds_containers((*args, *kwargs.values())):
        return forward, args, kwargs
    return _ForwardThenCopies(forward, args, kwargs), unshared_containers(args), unshared_containers(kwargs)


def _holds_containers(values: tuple) -> bool:
    """Whether a list or dict is among ``values`` or in a tuple among them."""
    return any(type(v) in (list, dict) or (type(v) is tuple and _holds_containers(v)) for v in values)


class _ForwardThenCopies:
    """``forward`` on the caller's own arguments the first time (what it writes into a list
    it was handed reaches the caller, as in eager), then, in each recompute, on fresh copies
    of the containers it is given."""

    def __init__(self, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
        self.forward, self.first = forward, (args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.first is not None:
            (args, kwargs), self.first = self.first, None
        else:
            args, kwargs = unshared_containers((args, kwargs))
        return self.forward(*args, **kwargs)


def unshared_containers(value: Any) -> Any:
    """``value`` with every list, tuple and dict in it built anew, their items shared.

    >>> x = [1, [2]]
    >>> y = unshared_containers(x)
    >>> y == x, y is x, y[1] is x[1]
    (True, False, False)
    """
    if type(value) in (list, tuple):
        return type(value)(unshared_containers(item) for item in value)
    if type(value) is dict:
        return {key: unshared_containers(item) for key, item in value.items()}
    return value


def _selective_contexts() -> tuple[Any, Any]:
    """torch's selective checkpointing contexts keeping every matmul/convolution output, as a
    selective segment of the plan keeps its matmul nodes' (:func:`graphckpt.segment_calls.keep_matmul_outputs`)."""
    return create_selective_checkpoint_contexts(keep_matmul_outputs)


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def _shapes(example_inputs: Any, example_kwargs: Mapping[str, Any] | None) -> list[tuple[int, ...]]:
    values = list(example_inputs if isinstance(example_inputs, tuple | list) else [example_inputs])
    values += list((example_kwargs or {}).values())
    return [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]
