"""A model's module hooks in its rewritten module: they run as they run in eager.

torch.fx traces a module through its ``forward``, which skips what ``__call__`` adds: the
module's forward, forward pre- and backward hooks. Left so, a rewritten module would drop
them without a word: a hook collecting activations would see nothing, and
``torch.nn.utils.spectral_norm``'s weight would stop being normalised. graphckpt keeps them:

- a submodule with such hooks is traced as one ``call_module`` node
  (:class:`graphckpt.leaf_modules.CaptureTracer`), so running the node calls the module, hooks and all;
- such a node is never recomputed (:func:`hooked_calls` are ``recomputable=False`` in the
  cost graph): its hooks run once a step, as in eager, and a hook that moves state (the
  power iteration of ``spectral_norm``) moves it once. What the module saves for backward
  is kept; the plan saves memory around it, not inside it.
- the model's own hooks are the rewritten module's (:func:`graphckpt.torch_compat.share_call_hooks`),
  and the plan is made for what ``forward`` receives after the model's forward pre-hooks.

Hooks also run while graphckpt profiles the graph at rewrite time, on the example inputs. A
hook registered after rewriting on a module the graph traced through never runs in a training
step: the first call warns naming it (:class:`HookWatch`), as it does for a hook that a
recompute would run twice.
torch.export calls modules as it traces, so what their hooks compute is in its graph, but
their Python side effects ran once, at capture (:func:`warn_hooks_traced_in`). Hooks
registered for every module (``register_module_forward_hook``) run only for the modules a
capture keeps whole (:func:`warn_global_hooks`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torch import fx, nn

from graphckpt.torch_compat import (
    call_hook_ids,
    call_hook_kinds,
    global_call_hook_kinds,
    has_side_effect,
    run_forward_pre_hooks,
)

INACTIVE_HOOK_MODULES = ("transformers.utils.output_capturing",)
"""Where the hooks a library installs on the models it builds, which do nothing unless asked,
are defined: Hugging Face's output recorders (installed at a model's first call, active
only while ``output_hidden_states`` or ``output_attentions`` is requested)."""


def _may_act(hook: Callable[..., Any]) -> bool:
    return getattr(hook, "__module__", None) not in INACTIVE_HOOK_MODULES


def hook_kinds(module: nn.Module) -> tuple[str, ...]:
    """The kinds of call hooks of ``module`` that may act in training (:data:`INACTIVE_HOOK_MODULES`
    left out): ``"forward"``, ``"forward_pre"``, ``"backward"``, ``"backward_pre"``."""
    return call_hook_kinds(module, _may_act)


def hooked_modules(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The modules of ``model`` (``""`` for the model itself) with hooks that run when the
    module is called, and the kinds of those hooks.

    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> handle = model[1].register_forward_pre_hook(lambda module, args: None)
    >>> hooked_modules(model)
    {'1': ('forward_pre',)}
    """
    return {path: kinds for path, module in model.named_modules() if (kinds := hook_kinds(module))}


def hooked_calls(graph_module: fx.GraphModule) -> dict[str, str]:
    """The ``call_module`` nodes of ``graph_module`` whose module has call hooks, by node
    name, with the module's path: each must run once a step, so none is recomputed."""
    return {node.name: node.target for node in graph_module.graph.nodes
            if node.op == "call_module" and hook_kinds(graph_module.get_submodule(node.target))}


def inputs_forward_receives(model: nn.Module, args: tuple | None,
                            kwargs: Mapping[str, Any] | None) -> tuple[tuple | None, Mapping[str, Any] | None]:
    """The example inputs as ``model.forward`` receives them when ``model`` is called with
    them: after the model's own forward pre-hooks, which an fx capture (a trace of
    ``forward``) leaves to the rewritten module's call."""
    if args is None or "forward_pre" not in hook_kinds(model):
        return args, kwargs
    return run_forward_pre_hooks(model, args, kwargs or {})


def _listing(hooked: dict[str, tuple[str, ...]]) -> str:
    shown = [f"{path or '(the model)'} ({', '.join(kinds)})" for path, kinds in list(hooked.items())[:6]]
    more = f" and {len(hooked) - 6} more" if len(hooked) > 6 else ""
    return ", ".join(shown) + more


def warn_hooks_traced_in(model: nn.Module) -> None:
    """Warn that torch.export ran ``model``'s module hooks once, while tracing: what they
    compute is in the graph, their other effects do not happen again."""
    hooked = hooked_modules(model)
    if hooked:
        warnings.warn(
            f"graphckpt captured {type(model).__name__} with torch.export, which ran the hooks of "
            f"{_listing(hooked)} once, while tracing: what they compute is part of the rewritten module, but "
            "their Python side effects (collecting outputs, logging, updating state) will not happen on its "
            "calls, and its graph calls none of the model's modules. Use graphckpt.enable(model), which keeps "
            "the model and its hooks.", stacklevel=3)


def warn_global_hooks() -> None:
    """Warn that hooks registered for every module run, in a rewritten module, only for the
    modules the capture kept whole."""
    kinds = global_call_hook_kinds()
    if kinds:
        warnings.warn(
            f"global module hooks ({', '.join(kinds)}, from torch.nn.modules.module.register_module_*_hook) "
            "run in a rewritten module only for the modules it calls whole (torch's layers, and modules "
            "with hooks of their own); the other modules are traced into its graph. Register the hooks "
            "on the modules that need them, or use graphckpt.enable(model), which keeps the model.",
            stacklevel=3)


HOOK_WATCH = "graphckpt_hook_watch"
"""The rewritten module's attribute holding its :class:`HookWatch`."""


class HookWatch:
    """The modules of a model on which a hook registered after rewriting would not run as in
    eager: those the rewritten module's graph traced through rather than called (the model
    itself too, after an export capture), where it never runs in a training step, and those
    it calls whole inside a recomputed segment, where it runs again in backward. The first
    call checks them, once, and warns (:func:`warn_once_if_hooks_added`): later calls cost
    one attribute test."""

    def __init__(self, inlined: dict[str, nn.Module], rerun: dict[str, nn.Module]) -> None:
        self.inlined, self.rerun = inlined, rerun
        self.registered = {path: call_hook_ids(module) for path, module in {**inlined, **rerun}.items()}  # at rewrite
        self.checked = False

    def added_since(self, modules: dict[str, nn.Module]) -> dict[str, tuple[str, ...]]:
        """Those of ``modules`` with hooks registered since rewriting (that may act), and their kinds."""
        return {path: kinds for path, module in modules.items()
                if call_hook_ids(module) - self.registered[path] and (kinds := hook_kinds(module))}

    @classmethod
    def of(cls, model: nn.Module, graph_module: fx.GraphModule, method: str, rerun: set[str]) -> HookWatch:
        """The watch over ``model`` rewritten from ``graph_module``: its modules outside every
        ``call_module`` node (a module called whole runs the hooks of those inside it; the
        model itself only after an export capture, since an fx capture's rewritten module
        shares its hooks), and the modules called whole at the paths ``rerun``."""
        whole = {node.target for node in graph_module.graph.nodes if node.op == "call_module"}

        def inside_whole(path: str) -> bool:
            parts = path.split(".")
            return any(".".join(parts[:end]) in whole for end in range(1, len(parts) + 1))

        modules = dict(model.named_modules())
        inlined = {path: module for path, module in modules.items()
                   if (path or method == "export") and not inside_whole(path)}
        return cls(inlined, {path: modules[path] for path in sorted(rerun) if path in modules})


def warn_once_if_hooks_added(watch: HookWatch) -> None:
    """At the first call, warn naming the modules of ``watch`` with hooks registered since
    rewriting: they do not run in training steps, or run twice."""
    if watch.checked:
        return
    watch.checked = True
    never, twice = watch.added_since(watch.inlined), watch.added_since(watch.rerun)
    if never:
        warnings.warn(
            f"graphckpt: hooks were registered on {_listing(never)} after the model was rewritten, and the "
            "rewritten module's graph runs those modules' code, not their calls: the hooks will not run in "
            "training steps (eval() runs the model's own forward, hooks included). Register hooks before "
            "graphckpt.rewrite, or use graphckpt.enable(model), which keeps the model.", stacklevel=2)
    if twice:
        warnings.warn(
            f"graphckpt: hooks were registered on {_listing(twice)} after the model was rewritten, and the plan "
            "recomputes those modules in backward: the hooks will run twice a training step. Register hooks "
            "before graphckpt.rewrite: a module with hooks is never recomputed.", stacklevel=2)


has_side_effect(warn_once_if_hooks_added)
