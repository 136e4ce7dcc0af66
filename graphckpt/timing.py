"""Measured op times: the recompute cost when FLOPs are the wrong measure.

The FLOP counter calls pointwise ops, norms and copies free, and on a CPU the time of an op
also includes allocating its output. With ``cost="time"`` each node's forward is timed on
the example inputs instead, the way a recompute runs it (autograd recording), and the
planner minimises recomputed nanoseconds.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from graphckpt.profile import positional_inputs

REPEATS = 5


class _Stopwatch(fx.Interpreter):
    """Runs the graph, timing every node; on CUDA each node's kernels are waited for, so a
    node's time is its kernels' and not only their launch."""

    def __init__(self, module: fx.GraphModule, cuda: bool = False) -> None:
        super().__init__(module)
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.wait = torch.cuda.synchronize if cuda else (lambda: None)

    def run_node(self, node: fx.Node) -> Any:
        self.wait()
        start = time.perf_counter()
        result = super().run_node(node)
        self.wait()
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
    tensors = [*inputs, *module.parameters()]
    stopwatch = _Stopwatch(module, cuda=any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors))
    with torch.random.fork_rng(), torch.enable_grad():
        for _ in range(repeats + 1):
            stopwatch.run(*[v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                            for v in inputs])
    return {name: int(statistics.median(times[1:]) * 1e9) for name, times in stopwatch.seconds.items()}
