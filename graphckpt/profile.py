"""What each node of a captured graph costs, found by running it on fake tensors.

One fake-tensor pass (no real memory, no real compute) gives, per node: bytes of new
storage, which earlier value it aliases (views), FLOPs (``torch.utils.flop_counter``),
which values its backward saves (``saved_tensors_hooks``), shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

PARAM = "<param>"


@dataclass(frozen=True)
class NodeCost:
    """Costs of one node's value, as measured on fake tensors."""

    bytes: int
    alias_of: str | None
    flops: int
    saved: tuple[str, ...]
    saved_extra_bytes: int
    requires_grad: bool
    random: bool
    expensive: bool
    param_grad_bytes: int
    shape: str
    dtype: str


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _describe(tensors: list[torch.Tensor]) -> tuple[str, str]:
    if not tensors:
        return "", ""
    shapes = ", ".join(str(list(t.shape)) for t in tensors)
    dtypes = ", ".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors}))
    return shapes, dtypes


EXPENSIVE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
                           "mkldnn_convolution", "convolution_overrideable", "cudnn_convolution",
                           "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"})


class _OpKinds(TorchDispatchMode):
    """Notices which kinds of ATen ops run under it: random draws, matmuls/convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.random = False
        self.expensive = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.random = self.random or torch.Tag.nondeterministic_seeded in func.tags
        self.expensive = self.expensive or func.overloadpacket.__name__ in EXPENSIVE_OPS
        return func(*args, **(kwargs or {}))


class _CostInterpreter(fx.Interpreter):
    """Runs nodes on fake tensors and records a :class:`NodeCost` for each."""

    def __init__(self, module: fx.GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(module)
        self.mode = mode
        self.owner: dict[int, str] = {}
        self.keep_alive: list[Any] = []
        self.costs: dict[str, NodeCost] = {}
        for tensor in (*module.parameters(), *module.buffers()):
            self.owner[_storage_key(tensor)] = PARAM

    def run_node(self, node: fx.Node) -> Any:
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        with self.mode, saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as flops, \
                _OpKinds() as kinds:
            result = super().run_node(node)
        self.keep_alive.append((result, saved))
        self.costs[node.name] = self._cost(node, result, saved, flops.get_total_flops(), kinds)
        return result

    def _param_grad_bytes(self, node: fx.Node) -> int:
        """Bytes of parameter gradients this node's backward creates (before they are
        accumulated into ``.grad``)."""
        if node.op == "call_module":
            return _trainable_bytes(self.module.get_submodule(node.target).parameters())
        return _trainable_bytes(self.fetch_attr(n.target) for n in node.all_input_nodes if n.op == "get_attr")

    def _cost(self, node: fx.Node, result: Any, saved: list[torch.Tensor], flops: int, kinds: _OpKinds) -> NodeCost:
        tensors = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        fresh, aliased = 0, []
        for tensor in tensors:
            key = _storage_key(tensor)
            if node.op == "get_attr" and self.owner.get(key, PARAM) == PARAM:
                self.owner[key] = node.name  # views of this buffer alias the get_attr node
            elif key in self.owner:
                aliased.append(self.owner[key])
            else:
                self.owner[key] = node.name
                fresh += tensor.untyped_storage().nbytes()
        alias_of = aliased[0] if aliased and not fresh and aliased[0] != PARAM else None
        names, extra = [], 0
        for tensor in saved:
            name = self.owner.get(_storage_key(tensor))
            if name is None:
                extra += tensor.untyped_storage().nbytes()
            elif name != PARAM and name not in names:
                names.append(name)
        shape, dtype = _describe(tensors)
        return NodeCost(
            bytes=0 if node.op == "get_attr" else fresh,
            alias_of=alias_of,
            flops=int(flops),
            saved=tuple(names),
            saved_extra_bytes=extra,
            requires_grad=any(t.requires_grad for t in tensors),
            random=kinds.random,
            expensive=kinds.expensive,
            param_grad_bytes=self._param_grad_bytes(node),
            shape=shape,
            dtype=dtype,
        )


def _trainable_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors
               if isinstance(t, torch.nn.Parameter) and t.requires_grad)


def _positional_inputs(graph_module: fx.GraphModule, args: tuple,
                       kwargs: Mapping[str, Any]) -> list[Any]:
    """Example inputs in placeholder order: positional first, then by name, then defaults."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    values = list(args)
    for node in placeholders[len(values):]:
        if node.target in kwargs:
            values.append(kwargs[node.target])
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"no example value for input {node.target!r}: pass it in example_inputs")
    return values


def node_costs(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None = None,
               *, training: bool = True) -> dict[str, NodeCost]:
    """A :class:`NodeCost` for every node, from one fake-tensor run at these inputs, with
    the module in training (default) or eval mode.

    The real module is not run and its buffers are not touched (it is copied to fake
    tensors first).
    """
    from torch._dynamo.utils import deepcopy_to_fake_tensor  # slow import, only needed here

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_module = deepcopy_to_fake_tensor(graph_module, mode).train(training)
    real_inputs = _positional_inputs(graph_module, args, kwargs or {})
    inputs = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in real_inputs]
    for fake, real in zip(inputs, real_inputs, strict=True):
        if isinstance(real, torch.Tensor) and real.requires_grad:
            fake.requires_grad_(True)
    interpreter = _CostInterpreter(fake_module, mode)
    with torch.enable_grad():
        interpreter.run(*inputs)
    return interpreter.costs
