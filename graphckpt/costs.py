"""Turn a captured fx graph into the cost graph the passes read.

The node-attribute contract is :mod:`passes.costgraph`; this module only fills it in from
the torch side. With example inputs the costs are real (fake-tensor bytes and FLOPs);
without them every op costs one unit, so node-counting strategies still work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx
import torch
from torch import fx

from graphckpt.dropout import dropout_call
from graphckpt.inplace import (
    isolate_inplace,
    mutation_constraints,
    view_parents,
    writes_activations,
    written_storage_roots,
)
from graphckpt.leaf_modules import stateful_calls
from graphckpt.module_hooks import hooked_calls
from graphckpt.node_cost import NodeCost
from graphckpt.op_dedup import forward_costs, profile_costs
from graphckpt.planned_inputs import autocast_state
from graphckpt.progress import paused_gc
from graphckpt.state import state_buffer_bytes, state_copy_bytes
from graphckpt.timing import checkpoint_overheads, model_device, node_nanoseconds, selective_overhead_per_op
from graphckpt.torch_compat import OpOverload, allocation_size
from passes.costgraph import add_value, check_cost_graph

_KIND = {"placeholder": "input", "get_attr": "param", "output": "output"}


def node_label(node: fx.Node) -> str:
    """A short human name for what a node does (``layers.0``, ``relu``, ``add``)."""
    if node.op in ("call_module", "get_attr", "placeholder"):
        return str(node.target)
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        target = node.target
        return str(target) if isinstance(target, OpOverload) else getattr(target, "__name__", str(target))
    return node.op


def _unit_cost(node: fx.Node) -> NodeCost:
    is_op = node.op not in _KIND
    return NodeCost(bytes=int(is_op), alias_of=None, flops=int(is_op), saved=(),
                    saved_extra_bytes=0, requires_grad=True, random=False, expensive=False, param_grad_bytes=0,
                    shape="", dtype="")


@dataclass(frozen=True)
class Profile:
    """Training-mode costs of every node, and which node's storage each view shares."""

    costs: Mapping[str, NodeCost]
    parents: Mapping[fx.Node, fx.Node]
    measured: bool = True  # False: unit costs, nothing was run
    cost_unit: str = "FLOPs"  # what NodeCost.flops counts: "FLOPs", or "ns" of measured time
    rng_state_bytes: int = 0  # what a checkpoint keeps to replay random draws, in the model's memory
    scalar_bytes: int = 0  # what a float32 scalar takes in the model's memory (the loss's, its seed gradient's)
    checkpoint_call_cost: int = 0  # in cost_unit: one checkpoint call's own cost (measured for "ns")
    selective_op_cost: int = 0  # in cost_unit: each op of a selective segment, beyond its work
    dropped_value_cost: int = 0  # in cost_unit: each value an op run by hooks drops, beyond its remake
    hooked_op_cost: int = 0  # in cost_unit: each op of a segment run by saved-tensor hooks, its packs and report
    autocast: str = ""  # the autocast state it was profiled under ("cpu:bfloat16"; "" for none)
    written_in_place: frozenset[str] = frozenset()  # values the model's own code writes in place (inplace.py)


COSTS = ("flops", "time")


@paused_gc()  # 50k-node stack: 22 s -> 18 s; and no collection inside an op timing
def prepare(graph_module: fx.GraphModule, args: tuple | None,
            kwargs: Mapping[str, Any] | None = None, cost: str = "flops", *, dedup: bool | None = None) -> Profile:
    """Make in-place ops safe (:func:`graphckpt.inplace.isolate_inplace`) and profile the
    final graph; unit costs when there are no example inputs. With ``cost="time"`` the
    recompute cost of each node is its measured forward time instead of its FLOPs.
    ``dedup`` (default: on unless ``GRAPHCKPT_DEDUP=0``) profiles each distinct call once
    (:mod:`graphckpt.op_dedup`); the figures are the same either way. A value that is a
    view only in eval mode (a Dropout's) is found by the training profile itself
    (``NodeCost.eval_alias_of``)."""
    if args is None:
        return Profile({n.name: _unit_cost(n) for n in graph_module.graph.nodes},
                       view_parents(graph_module, {}), measured=False)
    written: frozenset[str] = frozenset()
    if writes_activations(graph_module):  # decided on a forward's views and dtypes, then profiled once
        facts = forward_costs(graph_module, args, kwargs, dedup=dedup)
        parents = view_parents(graph_module, facts)
        written = written_storage_roots(graph_module, parents)
        isolate_inplace(graph_module, parents, facts)
    costs = profile_costs(graph_module, args, kwargs, dedup=dedup)
    parents = view_parents(graph_module, costs)
    rng = rng_state_bytes(graph_module, args, kwargs)
    device = model_device(graph_module, args, kwargs)
    scalar = allocation_size(4, device)
    if cost == "time":
        nanoseconds = node_nanoseconds(graph_module, args, kwargs)
        costs = {name: replace(c, flops=nanoseconds.get(name, 0)) for name, c in costs.items()}
        overheads = checkpoint_overheads(str(device))
        per_op = max(overheads.selective_op, selective_overhead_per_op(graph_module, args, kwargs))
        return Profile(costs, parents, cost_unit="ns", rng_state_bytes=rng, scalar_bytes=scalar,
                       autocast=autocast_state(), checkpoint_call_cost=overheads.call, selective_op_cost=per_op,
                       dropped_value_cost=overheads.dropped_value, hooked_op_cost=overheads.hooked_op,
                       written_in_place=written)
    return Profile(costs, parents, rng_state_bytes=rng, scalar_bytes=scalar, autocast=autocast_state(),
                   written_in_place=written)


def rng_state_bytes(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None) -> int:
    """Bytes of generator state ``torch.utils.checkpoint`` keeps per segment that replays
    random draws, in the memory the model runs in: the CPU generator's state for a CPU
    model; nothing on a GPU (``torch.cuda.get_rng_state`` is a host tensor)."""
    on_cpu = model_device(graph_module, args, kwargs).type == "cpu"
    return torch.get_rng_state().nbytes if on_cpu else 0


def returned_loss(graph_module: fx.GraphModule, profile: Profile) -> str | None:
    """The output that is the model's own loss: its one scalar output that takes part in
    backward (a Hugging Face model given labels returns ``loss`` beside ``logits``), trained
    on alone; ``None`` when there is none, or several, or nothing was measured."""
    if not profile.measured:
        return None
    (output,) = [n for n in graph_module.graph.nodes if n.op == "output"]
    scalars = {n.name for n in output.all_input_nodes
               if profile.costs[n.name].shape == "[]" and profile.costs[n.name].requires_grad}
    return scalars.pop() if len(scalars) == 1 else None


def _as_lifted(node: fx.Node, cost: NodeCost, lifted_params: Mapping[str, int]) -> NodeCost:
    """``cost`` with the graph inputs that are parameters costed as parameters: no bytes of
    their own (always there, never activation memory), and their gradients' bytes counted
    in the node itself and in each node reading it (made by its backward, freed as autograd
    adds them into ``.grad``), as for the ``get_attr`` parameters of a capture."""
    if node.name in lifted_params:
        cost = replace(cost, bytes=0, alias_of=None)
    grads = sum(lifted_params.get(name, 0) for name in (node.name, *(n.name for n in node.all_input_nodes)))
    return replace(cost, param_grad_bytes=cost.param_grad_bytes + grads) if grads else cost


@paused_gc()
def build_cost_graph(graph_module: fx.GraphModule, profile: Profile, *,
                     blocks: Mapping[str, str] | None = None,
                     lifted_params: Mapping[str, int] | None = None) -> nx.DiGraph:
    """The :mod:`passes.costgraph` graph of ``graph_module`` with the profiled node costs.

    ``blocks`` names the repeated module each node runs in
    (:func:`graphckpt.capture.node_blocks`). ``lifted_params`` names the graph inputs that
    are parameters (``torch.compile`` passes the parameters of the modules dynamo inlines as
    inputs), each with the bytes of its gradient (0 when frozen): they become ``param``
    values (:func:`_as_lifted`). The graph is complete when it is checked and returned;
    nothing changes it afterwards (the passes cache facts per graph).
    """
    costs = profile.costs
    blocks = blocks or {}
    lifted = lifted_params or {}
    not_recomputable, not_cuttable, ordered, state = mutation_constraints(graph_module, profile.parents)
    # hooks run once a step; so do torch modules that update their own buffers
    not_recomputable = not_recomputable | set(hooked_calls(graph_module)) | set(stateful_calls(graph_module))
    state_bytes = state_buffer_bytes(graph_module, state)
    graph = nx.DiGraph(name=type(graph_module).__name__, measured=profile.measured, cost_unit=profile.cost_unit,
                       rng_state_bytes=profile.rng_state_bytes, scalar_bytes=profile.scalar_bytes,
                       loss=returned_loss(graph_module, profile), autocast=profile.autocast,
                       checkpoint_call_cost=profile.checkpoint_call_cost, selective_op_cost=profile.selective_op_cost,
                       dropped_value_cost=profile.dropped_value_cost, hooked_op_cost=profile.hooked_op_cost)
    for order, node in enumerate(graph_module.graph.nodes):
        cost = costs.get(node.name) or _unit_cost(node)
        if lifted:
            cost = _as_lifted(node, cost, lifted)
        add_value(
            graph, node.name,
            kind="param" if node.name in lifted else _KIND.get(node.op, "op"),
            order=order,
            bytes=cost.bytes,
            reads=[n.name for n in node.all_input_nodes],
            label=node_label(node),
            alias_of=cost.alias_of,
            flops=cost.flops,
            recomputable=node.name not in not_recomputable and not cost.writes_argument,
            cuttable=node.name not in not_cuttable,
            saved=cost.saved,
            saves_from=cost.saves_from,
            saved_extra_bytes=cost.saved_extra_bytes,
            requires_grad=cost.requires_grad,
            random=cost.random,
            redrawable=cost.random and profile.measured and dropout_call(graph_module, node) is not None,
            ordered=node.name in ordered,
            state=node.name in state,
            expensive=cost.expensive,
            kernels_written=cost.kernels_written or (cost.expensive and node.name in profile.written_in_place),
            block=blocks.get(node.name, "") if node.op not in _KIND else "",
            param_grad_bytes=cost.param_grad_bytes,
            param_grad_cast_bytes=cost.param_grad_cast_bytes,
            param_grad_narrow_bytes=cost.param_grad_narrow_bytes,
            param_grads=cost.param_grads,
            backward_extra_bytes=cost.backward_extra_bytes,
            released_early=cost.released_early,
            backward_allocates=cost.backward_allocates,
            unpack_held_bytes=cost.unpack_held_bytes,
            forward_extra_bytes=cost.forward_extra_bytes,
            cached_rerun_extra_bytes=cost.cached_rerun_extra_bytes,
            selective_forward_extra_bytes=cost.selective_forward_extra_bytes,
            autocast_cache_bytes=cost.autocast_cache_bytes,
            state_copy_bytes=state_copy_bytes(graph_module, node, cost.saved, state_bytes),
            grad_views=cost.grad_views,
            grad_bytes=cost.grad_bytes,
            selective_extra_bytes=cost.selective_extra_bytes,
            shape=cost.shape,
            dtype=cost.dtype,
        )
    graph.graph["loss_widening"] = loss_widening(graph)
    check_cost_graph(graph)
    return graph


def loss_widening(graph: nx.DiGraph) -> int:
    """2 when a value the model returns is a 16-bit float (under autocast, or a model cast to
    bf16/fp16; priced on the safe side where its loss stays in 16 bits): a loss
    computed outside the model is taken to run in float32 on a copy of it
    (``passes.costgraph``'s ``loss_widening``); else 1."""
    returned = [value for name, kind in graph.nodes(data="kind") if kind == "output" for value in graph.predecessors(name)]
    return 2 if any(graph.nodes[value].get("dtype") in ("bfloat16", "float16") for value in returned) else 1
