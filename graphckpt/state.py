"""State updates: in-place writes into buffers whose value nothing in forward reads.

A training-mode norm layer updates its running statistics (and counts the batch in
``num_batches_tracked``) while forward runs, but none of forward's results depends on those
buffers. Captured with fx, the layer is one ``call_module`` node; captured with
``torch.export`` (or handed over by ``torch.compile``), it is an ``aten.batch_norm`` (or
``F.batch_norm``) writing buffers that are ``get_attr`` nodes (or graph inputs), plus an
``add_`` on the counter whose result nothing reads. Either way recomputing it is safe as long
as the recompute updates scratch copies (:mod:`graphckpt.runtime`), so the model's buffers
move once per step, and as long as two updates of one buffer keep their eager order (a
momentum update does not commute).

This module finds such *state*: the buffers (and inputs) forward only updates
(:func:`state_roots`), and the names of the state each node updates (:func:`state_keys`), so
:func:`graphckpt.inplace.mutation_constraints` keeps every buffer's updates in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from graphckpt.torch_compat import NormBase, OpOverload, allocated_bytes, op_schema

RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")
# ATen norms that write the running statistics they are passed (in training mode).
NORMS_WRITING_RUNNING_STATS = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                               "cudnn_batch_norm", "miopen_batch_norm", "instance_norm"}
# Python-level norms that update running statistics given in their arguments: positions of
# (running_mean, running_var) and of the flag that makes them update (name, position, default).
FUNCTIONAL_NORMS = {
    torch.nn.functional.batch_norm: ((1, 2), ("training", 5, False)),
    torch.nn.functional.instance_norm: ((1, 2), ("use_input_stats", 5, True)),
    torch.batch_norm: ((3, 4), ("training", 5, True)),
    torch.instance_norm: ((3, 4), ("use_input_stats", 5, True)),
}


def _updates_running_stats(node: fx.Node) -> bool:
    """Whether ``node`` is a norm op whose output does not depend on the running statistics
    it writes (training mode: it normalizes with the batch's own statistics)."""
    if node.op != "call_function":
        return False
    if isinstance(node.target, OpOverload):
        return op_schema(node.target).name.split("::")[-1] in NORMS_WRITING_RUNNING_STATS
    return node.target in FUNCTIONAL_NORMS


def _read_only_to_update(user: fx.Node, value: fx.Node, root: fx.Node, roots: Mapping[fx.Node, fx.Node],
                         written: Mapping[fx.Node, Sequence[fx.Node]]) -> bool:
    """Whether ``user`` reads ``value`` (which shares the storage of ``root``) only to write
    into it: every argument slot holding ``value`` is written, and the user either returns
    (a view of) that storage or is a norm whose output ignores the statistics it updates."""
    slots = []
    fx.node.map_arg((user.args, user.kwargs), lambda n: slots.append(n) if n is value else None)
    writes = [n for n in written.get(user, ()) if n is value]
    if user.op == "output" or len(writes) < len(slots):
        return False
    return roots.get(user) is root or _updates_running_stats(user)


def state_roots(nodes: Sequence[fx.Node], roots: Mapping[fx.Node, fx.Node],
                written: Mapping[fx.Node, Sequence[fx.Node]]) -> set[fx.Node]:
    """Buffers and inputs (``get_attr`` / ``placeholder`` storage roots) that forward writes
    in place and otherwise never reads: every reader of their storage (the buffer, its views,
    results of writes into it) only writes into it. ``roots`` maps each node to the node
    owning its storage; ``written`` each node to the values it writes."""
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        groups.setdefault(roots[node], []).append(node)
    state = set()
    for root, group in groups.items():
        if root.op not in ("get_attr", "placeholder"):
            continue
        readers = [(user, value) for value in group for user in value.users]
        if readers and all(_read_only_to_update(user, value, root, roots, written) for user, value in readers):
            state.add(root)
    return state


def state_key(root: fx.Node) -> str | None:
    """The name of the buffer or input ``root`` is: its attribute path, or ``input <name>``."""
    if root.op == "get_attr":
        return str(root.target)
    return f"input {root.name}" if root.op == "placeholder" else None


def norm_layer_keys(graph_module: fx.GraphModule, node: fx.Node) -> list[str]:
    """The buffers a ``call_module`` norm layer with running statistics updates
    (``"bn.running_mean"``, ...), whatever mode it runs in; empty for any other node."""
    if node.op != "call_module":
        return []
    layer = graph_module.get_submodule(node.target)
    if not isinstance(layer, NormBase) or not layer.track_running_stats:
        return []
    return [f"{node.target}.{name}" for name in RUNNING_STATS if getattr(layer, name, None) is not None]


def state_copy_bytes(graph_module: fx.GraphModule, node: fx.Node, saved: Sequence[str],
                     state_bytes: Mapping[str, int]) -> int:
    """Bytes of the running statistics ``node`` saves for backward that a recompute gives it
    scratch copies of (the cost graph's ``state_copy_bytes``): a training-mode batch norm
    layer's mean and variance (``call_module``; :func:`frozen_running_stats` copies them), or
    the ``state`` buffers among the values it saves (``saved``, value names; an ATen batch norm
    of an export capture, :func:`scratch_state` copies them; ``state_bytes``:
    :func:`state_buffer_bytes`). 0 for every other node. An instance norm saves repeated
    copies of its statistics, not them: 0.

    >>> gm = fx.symbolic_trace(nn.Sequential(nn.BatchNorm1d(8)))
    >>> state_copy_bytes(gm, next(n for n in gm.graph.nodes if n.op == "call_module"), (), {})
    64
    """
    if node.op == "call_module":
        layer = graph_module.get_submodule(str(node.target))
        if (not isinstance(layer, NormBase) or isinstance(layer, INSTANCE_NORMS) or not layer.training
                or not layer.track_running_stats):
            return 0
        return sum(allocated_bytes(stat) for name in RUNNING_STATS[:2] if (stat := getattr(layer, name, None)) is not None)
    return sum(state_bytes.get(name, 0) for name in saved)


def state_buffer_bytes(graph_module: fx.GraphModule, state: Collection[str]) -> dict[str, int]:
    """Storage bytes of each ``state`` value that is a buffer (a ``get_attr`` node naming one),
    by name; state passed as a graph input, or a plain tensor attribute, has none here."""
    buffers = dict(graph_module.named_buffers())
    return {node.name: allocated_bytes(buffers[str(node.target)]) for node in graph_module.graph.nodes
            if node.op == "get_attr" and node.name in state and str(node.target) in buffers}


INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def state_keys(graph_module: fx.GraphModule, node: fx.Node, roots: Mapping[fx.Node, fx.Node],
               written: Mapping[fx.Node, Sequence[fx.Node]]) -> set[str]:
    """Names of the buffers and inputs ``node`` writes into (a norm layer's running statistics
    included): two nodes sharing a name must keep their eager order."""
    keys = {state_key(roots[value]) for value in written.get(node, ())}
    keys.update(norm_layer_keys(graph_module, node))
    keys.discard(None)
    return keys


def running_stat_norms(modules: Iterable[nn.Module]) -> list[NormBase]:
    """The norm layers among ``modules`` that keep running statistics: those a recompute
    must run under :func:`frozen_running_stats`."""
    return [m for m in modules if isinstance(m, NormBase) and m.track_running_stats]


PROFILED_MOMENTUM = 0.1


def with_fixed_momentum(modules: Iterable[nn.Module]) -> None:
    """Give the norm layers among ``modules`` that keep a cumulative average
    (``momentum=None``) a fixed momentum: for a profile's copy of the model only. Their
    forward reads the batch count as a Python number, which fake tensors cannot give (the
    profile failed with ``DataDependentOutputException``); they run the same ops and hold the
    same memory with either."""
    for module in modules:
        if isinstance(module, NormBase) and module.momentum is None:
            module.momentum = PROFILED_MOMENTUM


def frozen_running_stats(norms: Sequence[NormBase]) -> contextlib.AbstractContextManager[None]:
    """Norm layers run exactly as in forward, but their running statistics are updated on
    scratch copies that are dropped afterwards: a recompute must not count a batch twice.

    (Turning ``track_running_stats`` off instead would change which tensors autograd saves,
    which checkpointing rejects.)
    """
    return frozen_buffers([(norm, name) for norm in norms for name in RUNNING_STATS])


@contextlib.contextmanager
def frozen_buffers(buffers: Sequence[tuple[nn.Module, str]]) -> Iterator[None]:
    """Each buffer ``(module, name)`` replaced by a scratch copy while the body runs, and put
    back after it: what the body writes into them, in place or by assigning another tensor
    (``self.seen += 1``), is dropped. A recompute runs under it."""
    originals = [getattr(module, name) for module, name in buffers]
    try:
        for (module, name), buffer in zip(buffers, originals, strict=True):
            if buffer is not None:
                setattr(module, name, buffer.clone())
        yield
    finally:
        for (module, name), buffer in zip(buffers, originals, strict=True):
            setattr(module, name, buffer)


class StateInput:
    """A state tensor a segment updates in place, handed to ``checkpoint`` by reference:
    checkpoint saves tensor inputs with their version, and the body's own update (a counter's
    ``add_``) would fail that check in backward. ``scratch`` is the copy a recompute
    updates instead (made by :class:`_Recomputing` before the recompute starts)."""

    __slots__ = ("scratch", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.scratch: Any = None


@contextlib.contextmanager
def scratch_state(state: Sequence[StateInput]) -> Iterator[None]:
    """A recompute's state updates go to copies, dropped afterwards (the same idea as
    :func:`frozen_running_stats`, for state passed in rather than held by a module)."""
    try:
        for value in state:
            value.scratch = value.tensor.clone() if isinstance(value.tensor, torch.Tensor) else value.tensor
        yield
    finally:
        for value in state:
            value.scratch = None


def unwrap_state(args: Sequence[Any], recomputing: bool) -> tuple[Any, ...]:
    """``args`` with each :class:`StateInput` replaced by its tensor, or by its scratch copy
    when ``recomputing``."""
    return tuple((a.scratch if recomputing else a.tensor) if isinstance(a, StateInput) else a for a in args)
