"""The one door to torch's private internals: every private torch name graphckpt uses.

graphckpt needs a few things torch offers only privately: fake tensors and dispatch modes
(to cost a graph without running it), the profiler's allocation events and memory timeline
(to measure peaks on CPU), a storage's identity, the registries behind ``nn.Module``'s
attributes, an fx graph's code generator, a ``SymInt``'s example value. Each is reached
here (the profiler's in :mod:`graphckpt.torch_compat.profiler`, selective checkpointing's and
torch.compile's budget in :mod:`graphckpt.torch_compat.checkpointing`, re-exported here), and only
here (``tests/test_torch_compat.py`` fails naming the file and line of any other module that
touches a private torch name), so a torch release that moves one breaks
this package alone, and the fix is a shim here.

Torch versions tested: 2.13 in CI (``.ci/run``); 2.5 and 2.6 by hand (the whole default
suite, when this module was written: 2.5 without transformers, whose releases now need torch
2.6). pyproject's ``torch>=2.5`` says the same. 2.4 lacks the public selective-checkpoint API
(``CheckpointPolicy``, ``create_selective_checkpoint_contexts``) that the runtime builds on.
The comment beside each name says where it lives and the versions it was checked on; the
shims for older releases say what they work around.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import fx, nn

# torch._ops.OpOverload: an ATen op with its overload chosen (``aten.add.Tensor``), what
# export and dynamo graphs call. Checked on 2.5, 2.6, 2.13.
from torch._ops import OpOverload

# torch._subclasses.fake_tensor: tensors with shapes, dtypes and storages but no data.
# Checked on 2.5, 2.6, 2.13.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

# torch.multiprocessing.reductions.StorageWeakRef: a weak reference to a storage, which says
# when the storage is freed (a public module, but undocumented). Checked on 2.13.
from torch.multiprocessing.reductions import StorageWeakRef

# torch.nn.modules.batchnorm._NormBase: the base of BatchNorm*d and InstanceNorm*d, the
# layers keeping running statistics. Checked on 2.5, 2.6, 2.13.
from torch.nn.modules.batchnorm import _NormBase as NormBase

# torch.utils._python_dispatch: the base class of a dispatch mode (``__torch_dispatch__``
# sees every ATen call made under it). Checked on 2.5, 2.6, 2.13.
from torch.utils._python_dispatch import TorchDispatchMode

# torch.utils._pytree: flatten / map nested containers of tensors. Checked on 2.5, 2.6, 2.13.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from graphckpt.torch_compat.checkpointing import (
    activation_memory_budget,
    clear_selective_cache,
    selective_cache_missed,
)
from graphckpt.torch_compat.mode_switches import ModeSwitch, mode_switches
from graphckpt.torch_compat.module_hooks import (
    call_hook_ids,
    call_hook_kinds,
    call_hooks_set_aside,
    global_call_hook_kinds,
    has_module_hooks,
    run_forward_pre_hooks,
    share_call_hooks,
)
from graphckpt.torch_compat.profiler import (
    RANGE_PREFIX,
    allocations_under,
    memory_timeline_allocations,
    profiled_event_tree,
    profiled_range,
    profiler_enabled,
    quiet_profile,
    stderr_without,
)
from graphckpt.torch_compat.real_dtypes import RealOutputDtypes, real_output_dtypes

__all__ = [
    "RANGE_PREFIX", "FakeTensor", "FakeTensorMode", "ModeSwitch", "NormBase", "OpOverload", "RealOutputDtypes",
    "TorchDispatchMode", "activation_memory_budget", "allocated_bytes", "allocation_size", "allocations_under",
    "argument_names", "call_hook_ids", "call_hook_kinds", "call_hooks_set_aside", "clear_selective_cache",
    "copy_graph_codegen", "draws_random_numbers", "dropout_and_saved", "export_training_graph", "fake_empty",
    "fake_module_copy", "flop_counter", "global_call_hook_kinds", "has_module_hooks", "has_side_effect",
    "is_accumulate_grad", "is_cast", "keep_on_copies", "memory_timeline_allocations", "mode_switches",
    "module_registries", "module_tree_copy", "non_persistent_buffers", "op_schema", "profiled_event_tree",
    "profiled_range", "profiler_enabled", "quiet_profile", "real_output_dtypes", "run_forward_pre_hooks",
    "selective_cache_missed", "share_call_hooks", "stderr_without", "storage_alive", "storage_key",
    "storage_key_and_ref", "symbolic_hint", "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten",
]


Module = TypeVar("Module", bound=nn.Module)


# ---------------------------------------------------------------- tensors and ops


def fake_empty(mode: FakeTensorMode, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """A fake tensor of ``mode`` on ``device`` with this layout and a storage of its own,
    made directly (a meta tensor wrapped), not by dispatching ``empty_strided`` through the
    mode: about 6x cheaper, which matters for the thousands of outputs and gradients
    :mod:`graphckpt.op_dedup`'s ghosts make.

    ``FakeTensor(mode, elem, device)`` and ``unset_fake_temporarily`` (so that the meta
    tensor is not itself made fake when ``mode`` is active). Checked on 2.13.
    """
    with unset_fake_temporarily():
        return FakeTensor(mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)


def draws_random_numbers(func: OpOverload, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether this call of an ATen op draws from the random number generator (dropout,
    ``rand``...): ``torch.Tag.nondeterministic_seeded`` among the op's tags, unless the call
    says it draws nothing: ``dropout_p=0`` (fused attention without dropout, what Hugging Face
    models pass in training when their attention dropout is 0) or ``train=False``. Without
    ``args`` it answers for the op. The schema's defaults stand in for arguments not passed
    (``Argument.has_default_value``/``default_value``). Checked on 2.13.

    >>> draws_random_numbers(torch.ops.aten.native_dropout.default, (torch.ones(2), 0.5, False))
    False
    """
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    if not args and not kwargs:
        return True
    schema = op_schema(func).arguments
    bound = {argument.name: argument.default_value for argument in schema if argument.has_default_value()}
    bound.update(zip((argument.name for argument in schema), args, strict=False))
    bound.update(kwargs or {})
    return bound.get("train") is not False and bound.get("dropout_p") != 0


def dropout_and_saved(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``F.dropout(x, p, training=True)`` computes, drawing the same numbers, and the
    tensor its backward saves: ATen's ``dropout`` runs the fused ``native_dropout`` on a GPU
    (its mask saved) and elsewhere ``x * noise`` with ``noise`` the Bernoulli draws scaled by
    ``1/(1-p)`` (saved; on another backend's device too, whose fused kernel would draw other
    numbers). ATen's ``_dropout_impl`` and ``is_fused_kernel_acceptable``; checked on 2.13
    against ``F.dropout``, bit for bit (tests/test_dropout_redraw.py)."""
    if x.device.type in ("cuda", "xpu", "lazy"):
        return torch.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    return x * noise, noise


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter, which each in-place write moves (``tensor._version``,
    private; checked on 2.5, 2.6, 2.13)."""
    return tensor._version


def storage_key(tensor: torch.Tensor) -> int:
    """Identifies a tensor's storage (fake tensors included), shared by all its views.

    ``untyped_storage()._cdata``: the address of the C++ storage object. Checked on 2.5, 2.6, 2.13.
    """
    return tensor.untyped_storage()._cdata


CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator hands out whole blocks of this many bytes


def allocated_bytes(tensor: torch.Tensor) -> int:
    """Bytes an allocator hands out for ``tensor``'s storage: its size, on a GPU rounded up
    to the caching allocator's 512-byte blocks, as ``torch.cuda.max_memory_allocated``
    counts them (a bias gradient of 64 floats takes 512 bytes there, not 256).

    >>> allocated_bytes(torch.zeros(3))
    12
    """
    return allocation_size(tensor.untyped_storage().nbytes(), tensor.device)


def allocation_size(nbytes: int, device: torch.device) -> int:
    """What an allocation of ``nbytes`` on ``device`` takes (:func:`allocated_bytes`)."""
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if device.type == "cuda" else nbytes


def storage_key_and_ref(tensor: torch.Tensor) -> tuple[int, Any]:
    """:func:`storage_key` of ``tensor`` and a weak reference to its storage
    (:func:`storage_alive`), holding none of it: a hooked segment asks both of every value it
    reports (:mod:`graphckpt.hooked`), so the storage is looked up once.

    ``torch.multiprocessing.reductions.StorageWeakRef`` (imported by ``import torch`` itself).
    Checked on 2.13.
    """
    storage = tensor.untyped_storage()
    return storage._cdata, StorageWeakRef(storage)


def storage_alive(reference: Any) -> bool:
    """Whether the storage behind a :func:`storage_key_and_ref` reference still exists: while
    it does, no other storage has its address (:func:`storage_key`)."""
    return not reference.expired()


def symbolic_hint(value: torch.SymInt | torch.SymFloat | torch.SymBool) -> int | float | bool:
    """The example value behind a symbolic size dynamo passes for a dynamic dimension.

    ``SymNode.hint`` (``require_hint()`` computes one an unbacked size lacks). Checked on 2.5, 2.6, 2.13.
    """
    node = value.node
    if node.hint is None and isinstance(value, torch.SymInt):
        return node.require_hint()
    return node.hint


def fake_module_copy(module: Module, mode: FakeTensorMode) -> Module:
    """A deep copy of ``module`` whose parameters and buffers are fake tensors of ``mode``.

    ``torch._dynamo.utils.deepcopy_to_fake_tensor`` (imported here, when first needed: it
    imports dynamo, which takes a second). Checked on 2.5, 2.6, 2.13.
    """
    from torch._dynamo.utils import deepcopy_to_fake_tensor

    return deepcopy_to_fake_tensor(module, mode)


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The schema of an ATen op: its name and which arguments it writes (``(a!)``).

    ``OpOverload._schema``. Checked on 2.5, 2.6, 2.13.
    """
    return op._schema


def argument_names(op: Any) -> list[str]:
    """The names of an ATen op's arguments, in schema order (empty for anything else), to
    read a call's arguments by name. Through :func:`op_schema`."""
    return [argument.name for argument in op_schema(op).arguments] if isinstance(op, OpOverload) else []


def is_accumulate_grad(function: Any) -> bool:
    """Whether an autograd graph node is a leaf's ``AccumulateGrad`` (the only kind with a
    ``variable`` attribute, the leaf it accumulates into). Checked on 2.5, 2.6, 2.13."""
    return hasattr(function, "variable")


def casts_up_a_parameter_gradient(function: Any) -> bool:
    """Whether an autograd graph node is the backward of autocast's cast of a parameter
    (``ToCopyBackward0`` feeding a leaf's ``AccumulateGrad``): it casts the 16-bit gradient
    up to the parameter's width after the op's own backward has returned. Checked on 2.13."""
    return function.name() == "ToCopyBackward0" and any(
        next_function is not None and is_accumulate_grad(next_function) for next_function, _ in function.next_functions)


def is_cast(func: Any) -> bool:
    """Whether an ATen call is ``aten._to_copy``: what a cast (``.to(dtype)``, and each of
    autocast's) dispatches to. Checked on 2.13."""
    return func is torch.ops.aten._to_copy.default


# ---------------------------------------------------------------- modules and graphs


def module_registries(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The live dicts behind ``module``'s direct submodules, parameters and buffers, in
    registration order (which ``parameters()`` and ``state_dict()`` follow): codegen reorders
    them so a rewritten module lists tensors in the model's order.

    ``nn.Module._modules``, ``._parameters``, ``._buffers``. Checked on 2.5, 2.6, 2.13.
    """
    return module._modules, module._parameters, module._buffers


def module_tree_copy(module: Module) -> Module:
    """A copy of ``module`` and its submodules, sharing their tensors and everything else
    (a GraphModule its graph): registries are new dicts, so a tensor or the training flag
    can be swapped in the copy only. Far cheaper than ``copy.deepcopy`` on 10k modules.

    The copy is made from the instance dictionary, not ``copy.copy``: a GraphModule's
    ``__copy__`` builds a new GraphModule (recompiling its code, slow at 10k nodes) that
    registers plain tensor attributes (export's ``lifted_tensor_0``) as buffers, which the
    registries copied from the original would then drop.

    Writes ``nn.Module._modules``, ``._parameters``, ``._buffers``. Checked on 2.13.
    """
    new = object.__new__(type(module))  # not GraphModule.__new__, which makes a class without forward
    new.__dict__.update(module.__dict__)
    new.__dict__["_parameters"] = dict(module._parameters)
    new.__dict__["_buffers"] = dict(module._buffers)
    new.__dict__["_modules"] = {name: None if child is None else module_tree_copy(child)
                                for name, child in module._modules.items()}
    return new


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers left out of ``state_dict`` (``persistent=False``).

    ``nn.Module._non_persistent_buffers_set``. Checked on 2.5, 2.6, 2.13.
    """
    return set(module._non_persistent_buffers_set)


def copy_graph_codegen(source: fx.Graph, target: fx.Graph) -> None:
    """Give ``target`` a copy of ``source``'s code generator, so the rewritten forward takes
    and returns what the captured one does (export's pytree in/out specs included).

    ``fx.Graph._codegen`` (read; ``set_codegen`` is public). Checked on 2.5, 2.6, 2.13.
    """
    target.set_codegen(copy.deepcopy(source._codegen))


def keep_on_copies(graph_module: fx.GraphModule, name: str, value: Any) -> None:
    """Set ``graph_module.<name>`` to ``value``, also on its ``copy.deepcopy`` copies (a
    GraphModule's copy keeps only the attributes its graph reads).

    ``GraphModule.meta[torch.fx.graph_module._USER_PRESERVED_ATTRIBUTES_KEY]``, set on a copy
    after its init. Checked on 2.13; a torch without it sets the attribute alone.
    """
    setattr(graph_module, name, value)
    key = getattr(torch.fx.graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", None)
    if key is not None:
        graph_module.meta.setdefault(key, {})[name] = value


def has_side_effect(function: Callable[..., Any]) -> Callable[..., Any]:
    """Register ``function`` with fx as having side effects, so dead-code elimination keeps
    its calls though they return nothing (a call check emitted into a rewritten graph).

    ``torch.fx.node.has_side_effect``; a torch without the registry never drops such calls,
    and ``function`` is returned as it is. Checked on 2.13.
    """
    return getattr(fx.node, "has_side_effect", lambda same: same)(function)


def rename_node(node: fx.Node, candidate: str) -> None:
    """Give ``node`` a fresh name made from ``candidate`` (fx adds a suffix where it is
    taken), through fx's private ``Node._rename``; an fx without it keeps the old name."""
    rename = getattr(node, "_rename", None)
    if rename is not None:
        rename(candidate)


# ---------------------------------------------------------------- shims for older releases


def export_training_graph(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> fx.GraphModule:
    """``torch.export`` (non-strict) of ``model`` at the example inputs, unlifted back to a
    module, in the training IR: ATen ops as the model calls them, in-place updates kept
    (``aten.batch_norm`` writing its running statistics, ``add_`` on the batch counter).

    ``torch.export.export`` from torch 2.6; on 2.5 that returns functionalized ATen
    (``_native_batch_norm_legit_functional`` and ``copy_`` back into the buffers at the
    end), so there it is ``torch.export.export_for_training`` (public, 2.5 only as the
    way to this IR). Checked on 2.5, 2.6, 2.13.
    """
    export = torch.export.export
    if torch.__version__ < "2.6" and hasattr(torch.export, "export_for_training"):
        export = torch.export.export_for_training
    return export(model, args, kwargs, strict=False).module()


@contextlib.contextmanager
def flop_counter() -> Iterator[FlopCounterMode]:
    """``torch.utils.flop_counter.FlopCounterMode`` (no display) that leaves nothing behind.

    Its module tracker registers multi-grad hooks on the tensors of every module called
    under it; torch 2.6 and later remove them when the mode exits, torch 2.5 leaves them,
    and a later ``autograd.grad`` through those tensors then fails ("A leaf node was passed
    to _will_engine_execute_node"). On 2.5 the hooks are collected here and removed on exit.
    ``torch.utils.module_tracker.register_multi_grad_hook`` and ``ModuleTracker._hooks``
    (2.6+). Checked on 2.5, 2.6, 2.13.
    """
    from torch.utils import module_tracker

    counter = FlopCounterMode(display=False)
    if hasattr(module_tracker.ModuleTracker(), "_hooks"):
        with counter:
            yield counter
        return
    handles: list[Any] = []
    register = module_tracker.register_multi_grad_hook

    def registering(*args: Any, **kwargs: Any) -> Any:
        handles.append(register(*args, **kwargs))
        return handles[-1]

    module_tracker.register_multi_grad_hook = registering
    try:
        with counter:
            yield counter
    finally:
        module_tracker.register_multi_grad_hook = register
        for handle in handles:
            handle.remove()
