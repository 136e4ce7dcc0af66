"""Measured op times: the recompute cost when FLOPs are the wrong measure.

The FLOP counter calls pointwise ops, norms and copies free, and on a CPU the time of an op
also includes allocating its output. With ``cost="time"`` each node's forward is timed on
the example inputs instead, the way a recompute runs it (autograd recording), and the
planner minimises recomputed nanoseconds.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from graphckpt.profile import positional_inputs
from graphckpt.torch_compat import tree_leaves

REPEATS = 5


def model_device(module: torch.nn.Module | None, args: Any = (), kwargs: Mapping[str, Any] | None = None) -> torch.device:
    """Where a model runs: the first non-CPU device among the tensors of ``args`` and
    ``kwargs`` (through tuples, lists and dicts) and ``module``'s parameters and buffers,
    else the CPU.

    >>> model_device(torch.nn.Linear(2, 2), (torch.zeros(2),))
    device(type='cpu')
    """
    tensors = [*tree_leaves((args, dict(kwargs or {})))]
    if module is not None:
        tensors += [*module.parameters(), *module.buffers()]
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu"),
                torch.device("cpu"))


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on ``device`` (a no-op off CUDA): what a timer on a GPU
    must do before it reads the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Stopwatch(fx.Interpreter):
    """Runs the graph, timing every node; on CUDA each node's kernels are waited for, so a
    node's time is its kernels' and not only their launch."""

    def __init__(self, module: fx.GraphModule, device: torch.device) -> None:
        super().__init__(module)
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.device = device

    def run_node(self, node: fx.Node) -> Any:
        synchronize(self.device)
        start = time.perf_counter()
        result = super().run_node(node)
        synchronize(self.device)
        self.seconds[node.name].append(time.perf_counter() - start)
        return result


def node_nanoseconds(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None = None,
                     repeats: int = REPEATS) -> dict[str, int]:
    """Median nanoseconds of each node's forward over ``repeats`` runs after a warm-up.

    The runs leave no trace: they use a copy of the module (running statistics untouched),
    copies of the inputs (in-place ops may write into them) and a forked RNG.
    """
    module = copy.deepcopy(graph_module).train(graph_module.training)
    inputs = positional_inputs(graph_module, args, kwargs or {})
    stopwatch = _Stopwatch(module, model_device(module, inputs))
    with torch.random.fork_rng(), torch.enable_grad():
        for _ in range(repeats + 1):
            stopwatch.run(*[v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                            for v in inputs])
    return {name: int(statistics.median(times[1:]) * 1e9) for name, times in stopwatch.seconds.items()}


OVERHEAD_OPS = 16  # pointwise ops in the probe that prices a selective segment's per-op cost
OVERHEAD_ROUNDS = 41


@functools.cache
def checkpoint_overheads(device: str = "cpu") -> tuple[int, int]:
    """Nanoseconds that checkpointing itself adds to a training step on ``device``: one
    checkpoint call (its recompute started and stopped, inputs and RNG state kept), and each
    op run under a selective segment's policy, forward and recompute together.

    Measured once per process and device on a probe of tiny pointwise ops, where the work is
    nothing and the overhead is everything: the median of interleaved rounds of the probe
    run plainly, checkpointed, and checkpointed selectively, forward and backward each.
    """
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from graphckpt.runtime import recompute_everything

    x = torch.ones(8, device=device, requires_grad=True)
    where = x.device

    def probe(value: torch.Tensor) -> torch.Tensor:
        for _ in range(OVERHEAD_OPS):
            value = value * 1.0
        return value

    def selective() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(recompute_everything)

    steps: dict[str, Callable[[], torch.Tensor]] = {
        "plain": lambda: probe(x),
        "checkpoint": lambda: checkpoint(probe, x, use_reentrant=False),
        "selective": lambda: checkpoint(probe, x, use_reentrant=False, context_fn=selective),
    }
    times: dict[str, list[float]] = defaultdict(list)
    for round_index in range(OVERHEAD_ROUNDS):
        for name, step in steps.items():
            synchronize(where)
            start = time.perf_counter()
            step().sum().backward()
            synchronize(where)
            if round_index:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    call = max(0.0, median["checkpoint"] - median["plain"])
    per_op = max(0.0, median["selective"] - median["checkpoint"]) / OVERHEAD_OPS
    return int(call * 1e9), int(per_op * 1e9)
