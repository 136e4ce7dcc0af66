"""Measured op times: the recompute cost when FLOPs are the wrong measure.

The FLOP counter calls pointwise ops, norms and copies free, and on a CPU the time of an op
also includes allocating its output. With ``cost="time"`` each node's forward is timed on
the example inputs instead, the way a recompute runs it (autograd recording), and the
planner minimises recomputed nanoseconds.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import torch
from torch import fx

from graphckpt.dedup_interpreter import CALLS
from graphckpt.op_dedup import dedup_enabled
from graphckpt.op_keys import module_signature, node_key
from graphckpt.profile import PARAM, positional_inputs
from graphckpt.torch_compat import module_registries, module_tree_copy, storage_key, tree_leaves
from graphckpt.written import mutated_arguments

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
    node's time is its kernels' and not only their launch.

    With ``keyed``, each call node gets its :func:`graphckpt.op_keys.node_key` and the
    times of one key are pooled: a call repeated in ``repeats`` or more nodes is timed once
    per node in one run, a rarer one (that writes nothing in place) is run again on the spot
    until its key has ``repeats`` samples."""

    def __init__(self, module: fx.GraphModule, device: torch.device, *, keyed: bool = False,
                 repeats: int = REPEATS) -> None:
        super().__init__(module)
        self.seconds: dict[Hashable, list[float]] = defaultdict(list)  # per node name, or per key when keyed
        self.device = device
        self.keyed = keyed
        self.repeats = repeats
        self.keys: dict[str, Hashable] = {}  # node -> what its times are pooled under
        self.counts: Counter[Hashable] = Counter()
        self.owner: dict[int, str] = {storage_key(t): PARAM for t in (*module.parameters(), *module.buffers())}

    def _key(self, node: fx.Node) -> Hashable:
        """The node's pooling key: its call key, or its name when it has none (or is not a call)."""
        if not self.keyed or node.op not in CALLS:
            return node.name
        target = node.target
        if node.op == "call_module":
            target = module_signature(self.module.get_submodule(node.target))
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        key = node_key(node, target, args, kwargs, self.owner, PARAM, self.module.training)
        return node.name if key is None else key

    def count_keys(self) -> None:
        """Key every node (after a run: the owners of its inputs are known) and count each key's nodes."""
        self.counts = Counter(self.keys.values())

    def run_node(self, node: fx.Node) -> Any:
        if self.keyed and node.name not in self.keys:
            self.keys[node.name] = self._key(node)
        key = self.keys.get(node.name, node.name)
        runs = 1
        if self.counts and self.counts[key] < self.repeats and node.op in CALLS \
                and not mutated_arguments(self.module, node):
            runs = -(-self.repeats // self.counts[key])
        for _ in range(runs):
            synchronize(self.device)
            start = time.perf_counter()
            result = super().run_node(node)
            synchronize(self.device)
            self.seconds[key].append(time.perf_counter() - start)
        if self.keyed and not self.counts:  # who made each storage, for the keys (a freed storage's address is reused)
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for tensor in tree_leaves(result):
                if isinstance(tensor, torch.Tensor) and storage_key(tensor) not in inputs:
                    self.owner[storage_key(tensor)] = node.name
        return result


def timing_copy(graph_module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``graph_module`` for timing runs: its own buffers (running statistics
    written by the runs), the parameters shared (nothing writes them without a backward),
    not a deep copy (seconds at 10k modules)."""
    module = module_tree_copy(graph_module)
    for inner in module.modules():
        _, _, buffers = module_registries(inner)
        for name, buffer in buffers.items():
            if buffer is not None:
                buffers[name] = buffer.clone()
    return module


def _timing_run(graph_module: fx.GraphModule, args: tuple,
                kwargs: Mapping[str, Any] | None) -> tuple[fx.GraphModule, list[Any]]:
    """The module timing runs call (a :func:`timing_copy` in the original's training mode)
    and the positional inputs they are given, copied afresh for each run (:func:`_fresh`)."""
    module = timing_copy(graph_module)
    for inner in module.modules():  # not .train(): an exported module's raises
        inner.training = graph_module.training
    return module, positional_inputs(graph_module, args, kwargs or {})


def _fresh(inputs: list[Any]) -> list[Any]:
    """Copies of the inputs for one timed run (in-place ops may write into them)."""
    return [v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v for v in inputs]


def node_nanoseconds(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None = None,
                     repeats: int = REPEATS, *, dedup: bool | None = None) -> dict[str, int]:
    """Median nanoseconds of each node's forward over ``repeats`` runs after a warm-up.

    With dedup (on unless ``dedup=False`` or ``GRAPHCKPT_DEDUP=0``, as for the profile)
    the nodes of one call key share the median of their pooled times, and one timed run
    replaces ``repeats`` (:class:`_Stopwatch`): a 10k-node stack of repeated blocks runs
    twice, not six times. The runs leave no trace: they use a copy of the module (running
    statistics untouched), copies of the inputs (in-place ops may write into them) and a
    forked RNG.
    """
    module, inputs = _timing_run(graph_module, args, kwargs)
    keyed = dedup_enabled(dedup)
    stopwatch = _Stopwatch(module, model_device(module, inputs), keyed=keyed, repeats=repeats)
    with torch.random.fork_rng(), torch.enable_grad():
        for run in range(2 if keyed else repeats + 1):
            if run == 1:
                stopwatch.seconds.clear()  # the first run warms up
                stopwatch.count_keys()
            stopwatch.run(*_fresh(inputs))
    return {node.name: int(statistics.median(stopwatch.seconds[stopwatch.keys.get(node.name, node.name)]) * 1e9)
            for node in module.graph.nodes}


OVERHEAD_OPS = 16  # pointwise ops in the probe that prices a selective segment's per-op cost
OVERHEAD_ROUNDS = 41


class Overheads(NamedTuple):
    """What checkpointing itself adds to a training step, in nanoseconds
    (:func:`checkpoint_overheads`)."""

    call: int  # one checkpoint call
    selective_op: int  # each op run under a selective segment's policy
    dropped_value: int  # each value an op run by hooks drops (graphckpt.dropping), beyond its remake
    hooked_op: int  # each op of a segment run by saved-tensor hooks (graphckpt.hooked): packs and reports


@functools.cache
def checkpoint_overheads(device: str = "cpu") -> Overheads:
    """Nanoseconds that checkpointing itself adds to a training step on ``device``: one
    checkpoint call (inputs and RNG state kept, its recompute started in backward and
    stopped early), each op run under a selective segment's policy, forward and recompute
    together, each value dropped by hooks (:class:`graphckpt.dropping.DropModule`: the
    hooks, the handle, the no-grad call making it again, less that op's own work), and each
    op of a segment run by saved-tensor hooks (:class:`graphckpt.hooked.HookedSegmentModule`:
    the pack and unpack of what it saves and the report of its value, which a plan of
    hooked segments on HF LLaMA (d=256, 460 hooked ops) paid as 6-15 ms of forward that a
    price per dropped value alone (55 values, 0.8 ms) did not see).

    Measured once per process and device on probes of tiny ops, where the work is nothing
    and the overhead is everything: the median of interleaved rounds of each probe run
    plainly and checkpointed, forward and backward each. The call's probe is one op that
    saves its input, so backward really starts its recompute, which stops at once: that
    start and the early stop's exception are most of a call's cost (about 0.11 ms on a
    2-core CPU; a probe whose ops save nothing never recomputes and prices a call at a
    seventh of that). The selective probe's ops save their inputs too, so its recompute
    reruns them under the policy as a real segment's does.
    """
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from graphckpt.segment_calls import recompute_everything

    x = torch.ones(8, device=device, requires_grad=True)
    where = x.device

    def one_saving_op(value: torch.Tensor) -> torch.Tensor:
        return value.sin()

    def saving_ops(value: torch.Tensor) -> torch.Tensor:
        for _ in range(OVERHEAD_OPS):
            value = value.sin()
        return value

    def selective() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(recompute_everything)

    dropping, hooked = _dropping_probe(), _hooked_probe()

    def made_again_plainly() -> torch.Tensor:  # the dropped probe's work, its remake included
        with torch.no_grad():
            x.sin()
        return x.sin().cos()

    steps: dict[str, Callable[[], torch.Tensor]] = {
        "plain": lambda: one_saving_op(x),
        "checkpoint": lambda: checkpoint(one_saving_op, x, use_reentrant=False),
        "ops": lambda: checkpoint(saving_ops, x, use_reentrant=False),
        "selective ops": lambda: checkpoint(saving_ops, x, use_reentrant=False, context_fn=selective),
        "made again": made_again_plainly,
        "dropped": lambda: dropping(x.sin(), x),
        "plain ops": lambda: saving_ops(x),
        "hooked ops": lambda: hooked(x),
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
    per_op = max(0.0, median["selective ops"] - median["ops"]) / OVERHEAD_OPS
    dropped = max(0.0, median["dropped"] - median["made again"])
    per_hooked_op = max(0.0, median["hooked ops"] - median["plain ops"]) / OVERHEAD_OPS
    return Overheads(int(call * 1e9), int(per_op * 1e9), int(dropped * 1e9), int(per_hooked_op * 1e9))


def _hooked_probe() -> torch.nn.Module:
    """A :class:`graphckpt.hooked.HookedSegmentModule` running :data:`OVERHEAD_OPS` ``sin``
    ops (each saves its input) and keeping every value, as a hooked segment's body reports
    each value backward saves (``keep(hooks, sin_3, "sin_3")``): its pack hook sees each
    saved tensor, its unpack each one again, and nothing is made again."""
    from graphckpt.hooked import HookedSegmentModule, keep

    graph = fx.Graph()
    value, hooks = graph.placeholder("value"), graph.placeholder("hooks")
    names = []
    for index in range(OVERHEAD_OPS):
        names.append(f"sin_{index}")
        value = graph.call_function(keep, (hooks, graph.call_function(torch.sin, (value,)), names[-1]))
    graph.output(value)
    body = fx.GraphModule(torch.nn.Module(), graph)
    return HookedSegmentModule(body, (), nodes=tuple(names), inputs=("value",), outputs=(names[-1],), groups=(),
                               kept=tuple(names))


def _dropping_probe() -> torch.nn.Module:
    """A :class:`graphckpt.dropping.DropModule` running ``cos`` (which saves its input) on a
    value it drops and makes again with ``sin`` from the value's source."""
    from graphckpt.dropping import DropModule

    body, remat = fx.symbolic_trace(lambda value: value.cos()), fx.symbolic_trace(lambda source: source.sin())
    return DropModule(body, remat, nodes=("cos",), inputs=("value",), outputs=("cos",), remat_inputs=(0,),
                      remat_sources=(1,), remat_names=("source",))


SELECTIVE_ROUNDS = 3


def selective_overhead_per_op(graph_module: fx.GraphModule, args: tuple,
                              kwargs: Mapping[str, Any] | None = None) -> int:
    """Nanoseconds a selective segment's policy adds to each op of this model, forward and
    recompute together: the whole forward timed plainly and under torch's selective
    checkpoint mode (matmul/convolution outputs kept, as a selective segment keeps them),
    the difference spread over the graph's ops and doubled for the recompute, which runs
    the same ops under the same kind of mode.

    :func:`checkpoint_overheads` prices the mode on tiny one-argument ops; a model's ops
    take more arguments, return more outputs and dispatch more ATen calls per node, and the
    mode's Python work grows with all three: on HF LLaMA a plan of selective segments ran
    its forward 33 ms slower than eager's, where the probe's price said 6 ms for forward
    and recompute together. Runs leave no trace, as :func:`node_nanoseconds`'s do.
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from graphckpt.segment_calls import keep_matmul_outputs

    module, inputs = _timing_run(graph_module, args, kwargs)
    device = model_device(module, inputs)
    ops = sum(node.op in ("call_function", "call_method", "call_module") for node in module.graph.nodes)
    seconds: dict[str, list[float]] = {"plain": [], "selective": []}
    with torch.random.fork_rng(), torch.enable_grad():
        for round_index in range(SELECTIVE_ROUNDS + 1):
            for name, times in seconds.items():
                fresh = _fresh(inputs)
                mode = (create_selective_checkpoint_contexts(keep_matmul_outputs)[0] if name == "selective"
                        else contextlib.nullcontext())
                synchronize(device)
                start = time.perf_counter()
                with mode:
                    fx.Interpreter(module).run(*fresh)
                synchronize(device)
                if round_index:  # the first round warms up
                    times.append(time.perf_counter() - start)
    extra = min(seconds["selective"]) - min(seconds["plain"])
    return int(max(0.0, extra) * 2 / max(ops, 1) * 1e9)
