"""``nn.Module``'s hook registries: which hooks a module has, running its forward pre-hooks
as its ``__call__`` does, and handing its hooks to another module. Part of
:mod:`graphckpt.torch_compat`, which re-exports every name here.

The registries are ``nn.Module`` attributes (``_forward_hooks``, ``_forward_pre_hooks``, ...)
and the module-global ones of ``torch.nn.modules.module``. Checked on 2.5, 2.6, 2.13.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch.nn.modules.module as module_internals
from torch import nn

_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
"""The registries ``nn.Module.__call__`` runs, and ``forward`` alone does not."""
_HOOK_STATE = (*_CALL_HOOKS, "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook")
"""Everything ``__call__`` reads to run them: the registries and their flags."""
_GLOBAL_CALL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")


def call_hook_kinds(module: nn.Module, counted: Callable[[Callable[..., Any]], bool] = bool) -> tuple[str, ...]:
    """The kinds of hooks ``module`` has that run only when it is called, not when its
    ``forward`` is: ``"forward"``, ``"forward_pre"``, ``"backward"``, ``"backward_pre"``;
    only hooks ``counted`` accepts count.

    >>> layer = nn.Linear(2, 2)
    >>> handle = layer.register_forward_hook(lambda module, args, output: None)
    >>> call_hook_kinds(layer)
    ('forward',)
    """
    return tuple(name[1:-len("_hooks")] for name in _CALL_HOOKS
                 if any(counted(hook) for hook in getattr(module, name, {}).values()))


def call_hook_ids(module: nn.Module) -> frozenset[int]:
    """The ids of ``module``'s call hooks (their handles' ``id``): those registered later are new ids."""
    return frozenset(key for name in _CALL_HOOKS for key in getattr(module, name, {}))


def global_call_hook_kinds() -> tuple[str, ...]:
    """The kinds of module hooks registered for every module
    (``torch.nn.modules.module.register_module_forward_hook`` and its siblings)."""
    return tuple(name[len("_global_"):-len("_hooks")] for name in _GLOBAL_CALL_HOOKS
                 if getattr(module_internals, name, None))


def run_forward_pre_hooks(module: nn.Module, args: tuple,
                          kwargs: Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The ``(args, kwargs)`` that ``module``'s ``forward`` receives when it is called with
    ``args`` and ``kwargs``: its own forward pre-hooks run in order, as ``__call__`` runs them."""
    kwargs = dict(kwargs)
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return tuple(args), dict(kwargs)


def share_call_hooks(source: nn.Module, target: nn.Module,
                     keep: Callable[[nn.Module, str, Any], None] = setattr) -> None:
    """Let ``target``'s ``__call__`` run ``source``'s hooks: the same registries, so a hook
    added to or removed from one (its handle's ``remove()``) is so for both. ``keep`` sets
    each registry on ``target`` (``keep_on_copies`` for a GraphModule's copies to keep them)."""
    for name in _HOOK_STATE:
        if hasattr(source, name):
            keep(target, name, getattr(source, name))


def has_module_hooks(module: nn.Module) -> bool:
    """Whether a forward hook (``module``'s own, or a global one) can change what calling
    ``module`` does: such a call is never profiled once for several nodes."""
    forward = {"forward", "forward_pre"}
    return bool(forward & {*call_hook_kinds(module), *global_call_hook_kinds()})


@contextlib.contextmanager
def call_hooks_set_aside(modules: Iterable[nn.Module]) -> Iterator[None]:
    """While active, ``modules`` have no call hooks of their own (their registries are
    empty); afterwards the same registries are back, with whatever was added meanwhile."""
    kept = [(module, {name: getattr(module, name) for name in _CALL_HOOKS}) for module in modules]
    for module, _ in kept:
        for name in _CALL_HOOKS:
            setattr(module, name, OrderedDict())
    try:
        yield
    finally:
        for module, registries in kept:
            for name, registry in registries.items():
                registry.update(getattr(module, name))
                setattr(module, name, registry)
