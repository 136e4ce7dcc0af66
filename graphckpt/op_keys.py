"""Keys of calls for :mod:`graphckpt.op_dedup`: two calls with one key cost the same.

A key says everything a node's fake-tensor figures can depend on: what is called (an op,
or a ``torch.nn`` module by :func:`module_signature`), its constants, and per tensor
argument its layout, autograd flags and which arguments share a storage or an owner; plus
grad mode and training. Split from :mod:`graphckpt.op_dedup` to keep each module short.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Any

import torch
from torch import fx, nn

from graphckpt.torch_compat import has_module_hooks, module_registries, storage_key, tree_leaves

_CONSTANTS = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class Unkeyable(Exception):
    """An argument the key cannot describe exactly (a tensor constant, an odd object)."""


def tensor_layout(tensor: torch.Tensor) -> tuple:
    """Everything about a tensor's memory that a measurement can depend on, data aside."""
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype,
            tensor.device, tensor.untyped_storage().nbytes())


def constant_key(value: Any) -> Hashable:
    """A non-tensor argument, with its type (``1``, ``1.0`` and ``True`` differ)."""
    if value is None or isinstance(value, _CONSTANTS):
        return type(value).__name__, value
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(constant_key(v) for v in value)
    raise Unkeyable(type(value).__name__)


def module_signature(module: nn.Module) -> Hashable | None:
    """What calling a ``torch.nn`` module can depend on besides its inputs: its class,
    public attributes (``eps``, ``p``, ``training``, ...), tensors' layouts and submodules;
    ``None`` for a module outside ``torch.nn`` or with hooks (never deduplicated)."""
    if not type(module).__module__.startswith("torch.nn.") or has_module_hooks(module):
        return None
    try:
        attributes = tuple(sorted((k, constant_key(v)) for k, v in vars(module).items() if not k.startswith("_")))
    except Unkeyable:
        return None
    tensors = own_tensors_key(module)
    children = tuple((name, module_signature(child)) for name, child in module.named_children())
    if any(signature is None for _, signature in children):
        return None
    return type(module), attributes, tensors, children


def own_tensors_key(module: nn.Module) -> Hashable:
    """A module's own parameters and buffers by name: layout, ``requires_grad``, and
    whether each is a parameter (what a call can depend on of them, data aside)."""
    _, parameters, buffers = module_registries(module)
    return tuple((name, None if t is None else (tensor_layout(t), t.requires_grad, isinstance(t, nn.Parameter)))
                 for name, t in (*parameters.items(), *buffers.items()))


def arguments_key(args: tuple, kwargs: dict, owner: Mapping[int, str], param: str) -> Hashable:
    """The arguments' part of a call key: constants, and per tensor its layout,
    ``requires_grad``, leafness, which arguments share a storage or an owner (``owner``:
    storage key -> the node that made it), and whether the owner is a parameter (``param``).
    Raises :class:`Unkeyable` for an argument it cannot describe."""
    numbering = ({}, {})  # storage key -> its number among the arguments; owner -> its number
    return _describe(args, owner, param, numbering), _describe(kwargs, owner, param, numbering)


def _describe(value: Any, owner: Mapping[int, str], param: str, numbering: tuple[dict, dict]) -> Hashable:
    """One argument's part of :func:`arguments_key` (a function of its own, not a closure:
    a recursive closure is a reference cycle, and one per node left 10k of them for the
    garbage collector after a 10k-node profile)."""
    if isinstance(value, torch.Tensor):
        storages, owners = numbering
        key = storage_key(value)
        made_by = owner.get(key)
        return ("tensor", tensor_layout(value), value.requires_grad, value.is_leaf,
                isinstance(value, nn.Parameter), storages.setdefault(key, len(storages)),
                made_by == param, owners.setdefault(made_by, len(owners)))
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_describe(v, owner, param, numbering) for v in value)
    if isinstance(value, dict):
        return "dict", tuple((k, _describe(v, owner, param, numbering)) for k, v in value.items())
    if isinstance(value, slice):
        return ("slice", *(_describe(v, owner, param, numbering) for v in (value.start, value.stop, value.step)))
    return constant_key(value)


_VIEW_CALLS = frozenset({"view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze",
                         "expand", "flatten", "unflatten", "view_as", "reshape_as", "movedim", "swapaxes",
                         "swapdims", "contiguous"})


def _view_call(node: fx.Node) -> bool:
    """Whether ``node`` re-lays out its first argument (a view, reshape or transpose), by the
    name of the op, function or method it calls."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = getattr(node.target, "overloadpacket", node.target)
    return getattr(target, "__name__", str(target)) in _VIEW_CALLS


def users_key(node: fx.Node, module_of: Callable[[str], nn.Module], depth: int = 4) -> Hashable:
    """How ``node``'s value is used: per user, what it calls (a module by class) and where
    the value sits among its arguments, and through users that only re-lay it out (views,
    transposes: up to ``depth`` of them, with their constants) how those are used. The
    gradient a node gets back depends on it (the key projection of attention is read
    through one more transpose than the query's): keying on it keeps such nodes apart from
    the start, instead of a whole profiling run spent finding out that their gradients differ."""
    uses = []
    for user in node.users:
        target = type(module_of(user.target)) if user.op == "call_module" else user.target
        places = tuple(i for i, arg in enumerate(user.args) if arg is node)
        further: Hashable = ()
        if depth and _view_call(user):
            constants = repr(fx.node.map_arg((user.args, user.kwargs), lambda _: "node"))  # a size read at run time
            further = (constants, users_key(user, module_of, depth - 1))
        uses.append((user.op, target if isinstance(target, Hashable) else str(target), places, further))
    return tuple(sorted(uses, key=repr))


def node_key(node: fx.Node, target: Hashable, args: tuple, kwargs: dict, owner: Mapping[int, str], param: str,
             training: bool, users: Hashable = ()) -> Hashable | None:
    """What ``node``'s figures can depend on (``target``: the op, or the module's
    :func:`module_signature`; ``users``: :func:`users_key`, for the profile's backward), or
    ``None`` when something cannot be keyed."""
    try:
        hash(target)
        hash(users)
        return node.op, target, arguments_key(args, kwargs, owner, param), torch.is_grad_enabled(), training, users
    except (Unkeyable, TypeError):
        return None


# torch.nn.modules files whose classes never read ``self.training`` (checked on 2.13, where
# ``training`` appears in these files only in docstrings, and in activation.py only in the
# two classes of :data:`_READS_TRAINING`).
_TRAINING_FREE_FILES = frozenset({"activation", "linear", "conv", "normalization", "sparse", "pooling", "flatten",
                                  "padding", "pixelshuffle", "upsampling", "channelshuffle", "fold", "distance",
                                  "container"})
_READS_TRAINING = frozenset({"RReLU", "MultiheadAttention"})


def _parameter_sources(node: fx.Node, leaf_inputs: Collection[str]) -> tuple[str, ...]:
    """What names the parameters ``node`` reads: the module it calls, or its ``get_attr``
    inputs and the graph inputs among ``leaf_inputs`` (sorted); empty for a call that reads
    none by name."""
    if node.op == "call_module":
        return (str(node.target),)
    return tuple(sorted(str(n.target) if n.op == "get_attr" else f"input {n.name}"
                        for n in node.all_input_nodes if n.op == "get_attr" or n.name in leaf_inputs))


def same_parameters(node: fx.Node, other: fx.Node, leaf_inputs: Collection[str] = ()) -> bool:
    """Whether ``node`` reads the very parameters ``other`` reads (the same module called
    again, ALBERT's shared layer; the same ``get_attr`` inputs; or the same graph inputs
    among ``leaf_inputs``, the placeholders holding leaf tensors that require grad, as the
    parameters dynamo passes a backend): one key, but under an autocast that caches casts
    the later call makes none (:mod:`graphckpt.op_dedup`)."""
    mine = _parameter_sources(node, leaf_inputs)
    return bool(mine) and mine == _parameter_sources(other, leaf_inputs)


def reads_training(module: nn.Module) -> bool:
    """Whether calling ``module`` may behave differently in eval mode: True unless it and
    every submodule are ``torch.nn`` classes known not to read ``training`` (Linear,
    LayerNorm, GELU, ...; not Dropout, BatchNorm, RReLU, a subclass of anything) without hooks."""
    for inner in module.modules():
        package, _, file = type(inner).__module__.rpartition(".")
        if package != "torch.nn.modules" or file not in _TRAINING_FREE_FILES \
                or type(inner).__name__ in _READS_TRAINING or has_module_hooks(inner):
            return True
    return False


def eval_output_storage(module: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The storage (:func:`~graphckpt.torch_compat.storage_key`) that ``module``, called in
    eval mode on these (fake) arguments, returns when every output lies in its arguments'
    memory (``Dropout`` returns its input), else ``None``; ``None`` without a call for a
    module that cannot behave otherwise in eval (:func:`reads_training`).

    A value that is a view only in eval still shares its input's storage for in-place
    safety (:func:`graphckpt.inplace.view_parents`): asked per module, in the training
    profile, it spares a whole eval-mode profile (1.7 s of a 10k-node transformer's 5.4 s).
    """
    if not reads_training(module):
        return None
    flags = [(inner, inner.training) for inner in module.modules()]
    try:
        for inner, _ in flags:  # not .eval(): an exported module's raises
            inner.training = False
        with torch.no_grad():
            result = module(*args, **kwargs)
    finally:
        for inner, training in flags:
            inner.training = training
    inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    outputs = [storage_key(t) for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
    return outputs[0] if outputs and all(key in inputs for key in outputs) else None
