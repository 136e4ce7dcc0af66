"""A ``torch.compile`` backend that checkpoints every graph dynamo hands it.

    compiled = torch.compile(model, backend=graphckpt.backend())           # strategy="auto"
    compiled = torch.compile(model, backend=graphckpt.backend(budget=0.5))  # half of eager's peak

Dynamo splits the forward into graphs (one per stretch between graph breaks). Each one is
costed (:func:`graphckpt.costs.prepare` / :func:`~graphckpt.costs.build_cost_graph`),
planned (:mod:`passes`) and rewritten (:func:`graphckpt.codegen.generate`) exactly like a
model given to :func:`graphckpt.rewrite`, and then runs eagerly: its recomputed segments
are ordinary non-reentrant ``torch.utils.checkpoint`` calls, so autograd needs no
``aot_autograd`` in between. Dynamo passes the parameters of the modules it inlines as graph
inputs, so a rewritten graph keeps them as segment inputs (they are alive anyway).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from graphckpt.api import check_options, plan_cost_graph
from graphckpt.codegen import RewrittenModule, generate
from graphckpt.costs import build_cost_graph, prepare
from graphckpt.scratch import Layout
from graphckpt.torch_compat import FakeTensor, allocated_bytes, symbolic_hint
from passes.budget import Budget, BudgetError
from passes.plan import Plan
from passes.strategies import choose_plan

__all__ = ["GraphckptBackend", "backend"]


def _concrete(value: Any) -> Any:
    """A real stand-in for one dynamo example input, for costing only.

    Dynamo usually passes real tensors, but a ``SymInt`` for each dynamic size (its hint is
    the example value) and, under some wrappers, fake tensors: those become real tensors of
    the same layout (their values never matter: the profiler makes fakes of its own).
    """
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return symbolic_hint(value)
    if isinstance(value, FakeTensor):
        shape = tuple(_concrete(s) for s in value.shape)
        stride = tuple(_concrete(s) for s in value.stride())
        return Layout(shape, stride, value.dtype, value.device).real().requires_grad_(value.requires_grad)
    return value


def _needs_checkpointing(graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether this graph will be differentiated: grad mode is on (dynamo guards on it) and
    some input (a parameter dynamo lifted, or an activation) or parameter of the graph
    module (older dynamo, or a traced module) requires grad."""
    tensors = [*example_inputs, *graph_module.parameters()]
    return torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in tensors)


def lifted_parameters(graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, int]:
    """The graph inputs that are parameters, each with the bytes of its gradient (0 when frozen).

    Dynamo passes the parameters of the modules it inlines as graph inputs. Costed as
    ``input`` values, the simulator would keep each parameter's gradient alive to the end of
    backward (an input's gradient goes back to the caller), so a graph of big weights looks
    as if checkpointing saved nothing; the cost graph makes them ``param`` values instead
    (:func:`graphckpt.costs.build_cost_graph`'s ``lifted_params``).
    """
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    return {node.name: allocated_bytes(value) if value.requires_grad else 0
            for node, value in zip(placeholders, example_inputs, strict=False) if isinstance(value, nn.Parameter)}


def choose(cost_graph: nx.DiGraph, strategy: str, budget: Budget | None) -> Plan:
    """The plan for one graph: ``strategy`` (see :data:`passes.strategies.STRATEGIES`), or the
    least recompute within ``budget`` (a fraction of this graph's eager peak, bytes, or a
    size string) when one is given.

    A budget no plan of this graph reaches (a graph break can leave a graph too small to
    split) gets the plan of least peak the refusal found, the nearest to the budget, and a
    warning; ``auto``'s plan where the refusal names none.
    """
    try:
        return plan_cost_graph(cost_graph, strategy, budget=budget)
    except BudgetError as error:
        smallest = error.smallest_plan
        instead = ("the plan of least peak found" if smallest is not None else
                   "the 'auto' plan (lowest peak of the heuristics)")
        warnings.warn(f"graphckpt.backend: {error} Graph breaks split the budget per graph; using {instead} "
                      "for this graph instead.", stacklevel=2)
        return smallest if smallest is not None else choose_plan(cost_graph, "auto")


@dataclass
class GraphckptBackend:
    """A dynamo backend (``torch.compile(model, backend=GraphckptBackend())``).

    ``compiled`` holds the rewritten module of every graph it checkpointed, in the order
    dynamo compiled them; ``skipped`` says, per graph left as it was, why (no gradient
    needed, too few ops to split, or an error while planning, also given as a warning).
    """

    strategy: str = "auto"
    budget: Budget | None = None
    compiled: list[RewrittenModule] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_options(self.strategy, budget=self.budget)  # bad options fail here, not inside dynamo

    def __call__(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Rewrite one dynamo graph; return what dynamo should call instead."""
        name = f"graph {len(self.compiled) + len(self.skipped)}"
        if not _needs_checkpointing(graph_module, example_inputs):
            self.skipped.append(f"{name}: no gradient needed (grad mode off or no input requires grad)")
            return graph_module.forward
        try:
            rewritten = self.rewrite(graph_module, example_inputs)
        except Exception as error:  # a graph we cannot plan still runs, just without checkpointing
            reason = f"{name}: {type(error).__name__}: {error}"
            self.skipped.append(reason)
            warnings.warn(f"graphckpt.backend: {reason}; running this graph without checkpointing. "
                          "Report it with the graph (print(graph_module.code)).", stacklevel=2)
            return graph_module.forward
        if not (rewritten.segments or rewritten.hooked):
            self.skipped.append(f"{name}: the plan recomputes nothing (too few ops to split)")
            return graph_module.forward
        self.compiled.append(rewritten)
        return rewritten

    def rewrite(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> RewrittenModule:
        """Cost, plan and rewrite one dynamo graph at its example inputs."""
        args = tuple(_concrete(v) for v in example_inputs)
        profile = prepare(graph_module, args)
        cost_graph = build_cost_graph(graph_module, profile, lifted_params=lifted_parameters(graph_module, example_inputs))
        plan = choose(cost_graph, self.strategy, self.budget)
        with torch.no_grad():
            return generate(graph_module, graph_module, plan, "torch.compile (dynamo)")


def backend(strategy: str = "auto", budget: Budget | None = None) -> GraphckptBackend:
    """A ``torch.compile`` backend checkpointing each graph with ``strategy`` (or the least
    recompute within ``budget``, a fraction of that graph's eager peak, bytes, or ``"2GiB"``).

    ``torch.compile(model, backend=graphckpt.backend())``: graph breaks are fine (each graph
    is planned on its own); graphs that need no gradient run unchanged.
    """
    return GraphckptBackend(strategy=strategy, budget=budget)
