"""What each node of a captured graph costs, found by running it on fake tensors.

One fake-tensor pass (no real memory, no real compute) gives, per node: bytes of new
storage, which earlier value it aliases (views), FLOPs (``torch.utils.flop_counter``),
which values its backward saves (``saved_tensors_hooks``), shapes and dtypes, and the
temporaries its forward makes and frees inside itself (``forward_extra_bytes``: the storages
its ATen calls create, followed until the last tensor on each is dropped).

Memory a kernel allocates *inside* itself, which fake tensors cannot show, comes from
:mod:`graphckpt.scratch`: every backward call's (``backward_extra_bytes``), and the forward
calls' :func:`graphckpt.op_kinds.replayed_for_scratch` names (in ``forward_extra_bytes``, on
what the node held while the call ran: :meth:`_CostInterpreter.add_forward_scratch`). An
attention the math kernel runs, which takes another branch under a dispatch mode such as the
profile's, has its temporaries measured in a real run outside one
(``selective_forward_extra_bytes`` keeps the mode's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import fx
from torch.autograd.graph import saved_tensors_hooks

from graphckpt.backward_record import Recorder
from graphckpt.node_cost import NodeCost, describe_tensors, selective_extra, with_forward_scratch, with_plain_forward
from graphckpt.node_gradients import gradients_made, param_grad_bytes, param_grads
from graphckpt.op_keys import eval_output_storage
from graphckpt.op_kinds import ATTENTION_CALLS, GRADIENT_VIEW_OPS, OpKinds
from graphckpt.pass_through import PassThroughWatch, returns_an_input
from graphckpt.scratch import layouts_of, plain_forward_temporaries, scratch_by_call
from graphckpt.state import with_fixed_momentum
from graphckpt.torch_compat import (
    FakeTensorMode,
    RealOutputDtypes,
    allocated_bytes,
    allocation_size,
    casts_up_a_parameter_gradient,
    fake_module_copy,
    flop_counter,
    is_accumulate_grad,
    storage_alive,
    storage_key,
    tree_leaves,
)
from passes.costgraph import saves_from

PARAM = "<param>"


class AddedScratch(NamedTuple):
    """What :meth:`_CostInterpreter.add_forward_scratch` added to one node: bytes on its
    ``forward_extra_bytes`` and on its ``cached_rerun_extra_bytes``; and, for a node whose
    op runs otherwise outside a dispatch mode, its temporaries measured there (``plain``:
    :func:`graphckpt.node_cost.with_plain_forward`)."""

    forward: int
    rerun: int
    plain: int | None = None


class _CostInterpreter(fx.Interpreter):
    """Runs nodes on fake tensors and records a :class:`NodeCost` for each."""

    def __init__(self, module: fx.GraphModule, mode: FakeTensorMode, *, backward: bool = True) -> None:
        super().__init__(module)
        self.mode = mode
        self.backward = backward
        self.recorder = Recorder()
        self.pass_through = PassThroughWatch()
        self.grad_fns: set[Any] = set()  # autograd functions claimed by a node
        self.owner: dict[int, str] = {}
        self.keep_alive: list[Any] = []
        self.costs: dict[str, NodeCost] = {}
        self.scratch_calls: dict[str, list[tuple]] = {}  # node -> its forward's calls replayed for kernel scratch
        self.scratch_heights: dict[str, list[int]] = {}  # node -> what each of them ran on (OpKinds.scratch_heights)
        self.plain_runs: dict[str, tuple] = {}  # node -> (target, args, kwargs as layouts): run for real, no mode
        self.rerun_scratch_heights: dict[str, list[int]] = {}  # the same in a rerun the selective cache serves
        self.scratch_kernel: dict[str, list[bool]] = {}  # node -> of each, whether it is a matmul's, which a rerun
        # served from selective checkpointing's cache does not call (OpKinds.scratch_kernel)
        for tensor in (*module.parameters(), *module.buffers()):
            self.owner[storage_key(tensor)] = PARAM
        self.param_names = {id(p): name for name, p in module.named_parameters()}  # a tied one: its first name

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The graph run once, with autocast's cache of parameter casts emptied before and
        after: a run before this one (a retry, the forward-only profile) left the casts of
        these parameters cached, and this run would neither make nor count them; and the
        user's autocast region should not keep fake tensors."""
        torch.clear_autocast_cache()
        try:
            return super().run(*args, **kwargs)
        finally:
            torch.clear_autocast_cache()

    def run_node(self, node: fx.Node) -> Any:
        saved: list[torch.Tensor] = []
        made_here: list[bool] = []  # per saved tensor: its storage is new, made by this node

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            made_here.append(storage_key(tensor) not in self.owner)
            return tensor

        with self.mode, saved_tensors_hooks(pack, self.recorder.unpacked), flop_counter() as flops, \
                RealOutputDtypes(), OpKinds() as kinds:
            result = super().run_node(node)
        self.keep_alive.append((result, saved))
        cost = self._cost(node, result, saved, flops.get_total_flops(), kinds)
        identity = node.op.startswith("call_") and cost.alias_of is not None and returns_an_input(
            result, *self.fetch_args_kwargs_from_env(node))
        self.costs[node.name] = replace(cost, saves_from=saves_from(made_here), eval_alias_of=self._eval_alias(node),
                                        forward_extra_bytes=kinds.forward_extra_bytes(),
                                        cached_rerun_extra_bytes=kinds.forward_extra_bytes(served_from_cache=True),
                                        grad_views=cost.grad_views or identity)
        if kinds.scratch_calls:
            self.scratch_calls[node.name] = kinds.scratch_calls
            self.scratch_heights[node.name] = kinds.scratch_heights()
            self.rerun_scratch_heights[node.name] = kinds.scratch_heights(served_from_cache=True)
            self.scratch_kernel[node.name] = kinds.scratch_kernel
        if node.target in ATTENTION_CALLS and not kinds.fused_attention:
            self.plain_runs[node.name] = (node.target, *layouts_of(*self.fetch_args_kwargs_from_env(node), grad=True))
        if self.backward and node.op.startswith("call_"):
            self.pass_through.watch(node.name, self._claim_grad_fns(result, node.name if kinds.opaque else None))
        return result

    def _eval_alias(self, node: fx.Node) -> str | None:
        """In a training-mode run, the owner of the input memory ``node``'s module returns in
        eval mode (:func:`graphckpt.op_keys.eval_output_storage`), other than a parameter."""
        if node.op != "call_module" or not self.module.training:
            return None
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        with self.mode:
            key = eval_output_storage(self.module.get_submodule(node.target), args, kwargs)
        owner = self.owner.get(key) if key is not None else None
        return owner if owner != PARAM else None

    def _claim_grad_fns(self, result: Any, name: str | None) -> list[Any]:
        """Hook the autograd functions this node made (those its outputs reach before the
        functions of earlier nodes and the leaves' ``AccumulateGrad``) so that, in the
        backward, :class:`Recorder` gives their ATen calls to ``name``; ``None`` (a node
        that ran only views and pointwise ops, or a ghost) records nothing and has no hooks.
        Returns those functions."""
        recorder = self.recorder

        def enter(grad_outputs: Any) -> None:
            recorder.enter(name, grad_outputs)

        def leave(grad_inputs: Any, grad_outputs: Any) -> None:
            recorder.leave(name)

        stack, claimed = [t.grad_fn for t in tree_leaves(result) if isinstance(t, torch.Tensor)], []
        while stack:
            function = stack.pop()
            if function is None or function in self.grad_fns or is_accumulate_grad(function):
                continue
            self.grad_fns.add(function)
            claimed.append(function)
            if name is not None and not casts_up_a_parameter_gradient(function):  # (param_grad_cast_bytes)
                function.register_prehook(enter)
                function.register_hook(leave)
            stack.extend(next_function for next_function, _ in function.next_functions)
        return claimed

    def add_forward_scratch(self) -> dict[str, AddedScratch]:
        """Raise each node's ``forward_extra_bytes`` to the most its forward holds while one of
        its replayed calls runs (on 16-bit floats, or a convolution: :func:`graphckpt.op_kinds.replayed_for_scratch`):
        the scratch that call's kernel allocates inside itself
        (:meth:`graphckpt.op_kinds.OpKinds._note_for_replay`, replayed unless measured before in
        this process: :func:`measure_kernel_scratch`) on what the node's earlier calls made
        and had not freed, its results among them (:func:`graphckpt.node_cost.with_forward_scratch`);
        and its ``cached_rerun_extra_bytes`` by the scratch of the calls a rerun served from
        selective checkpointing's cache still makes: not a matmul's, whose output the cache
        hands back without calling it. A node whose op branches on a dispatch mode
        (:data:`graphckpt.op_kinds.ATTENTION_CALLS` by the math kernel) then takes its
        temporaries outside one, measured (:func:`graphckpt.node_cost.with_plain_forward`).
        Returns what was added to each, by node."""
        added = {}
        for name, scratches in scratch_by_call(self.scratch_calls).items():
            cost = self.costs[name]
            most = with_forward_scratch(cost.forward_extra_bytes, self.scratch_heights[name], scratches)
            rerun_scratches = [0 if kernel else scratch
                               for scratch, kernel in zip(scratches, self.scratch_kernel[name], strict=True)]
            rerun_before = cost.cached_rerun_extra_bytes or 0
            rerun = with_forward_scratch(rerun_before, self.rerun_scratch_heights[name], rerun_scratches)
            added[name] = AddedScratch(most - cost.forward_extra_bytes, rerun - rerun_before)
            self.costs[name] = replace(cost, forward_extra_bytes=most, cached_rerun_extra_bytes=rerun)
        for name, (target, args, kwargs) in self.plain_runs.items():
            plain = plain_forward_temporaries(target, args, kwargs)
            if plain is not None:
                scratch = added.get(name, AddedScratch(0, 0))
                added[name] = AddedScratch(scratch.forward, scratch.rerun, plain)
                self.costs[name] = with_plain_forward(self.costs[name], plain)
        return added

    def backward_extra_bytes(self, outputs: Any, inputs: list[torch.Tensor]) -> None:
        """Set each node's ``backward_extra_bytes``: the most bytes any one ATen call of its
        backward allocates beyond what it returns (the calls run one after another, each
        freeing its scratch before the next; results passed between them are not counted).

        One backward of the whole graph runs on fake tensors, from ``outputs`` to the
        parameters and ``inputs``, as autograd runs it in training: each call gets the
        gradient layouts it gets for real (a gradient that comes out of ``cat``'s backward
        is a strided slice, which ``convolution_backward`` first copies). The calls not
        measured before in this process are then replayed (:func:`measure_kernel_scratch`).
        """
        if self.run_backward(outputs, inputs):
            self.assign_pass_through()
            self.assign_backward_extra()

    def run_backward(self, outputs: Any, inputs: list[torch.Tensor]) -> bool:
        """The fake backward of the whole graph, recorded; False when there is none to run."""
        outputs = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        leaves = [t for t in (*self.module.parameters(), *inputs) if t.requires_grad]
        if not outputs or not leaves:
            return False
        with self.mode:
            try:
                torch.autograd.grad(outputs, leaves, [torch.empty_like(t) for t in outputs], allow_unused=True)
            except (RuntimeError, NotImplementedError):
                return False
        return True

    def assign_backward_extra(self) -> None:
        """Each recorded node's ``backward_extra_bytes``, from the backward just run."""
        nodes = {node.name: node for node in self.module.graph.nodes}
        for name, scratches in scratch_by_call(self.recorder.calls).items():
            most, peak = self.recorder.most_with_scratch(name, scratches)
            self.costs[name] = replace(self.costs[name],
                                       backward_extra_bytes=max(0, most - gradients_made(self.costs, nodes[name])),
                                       released_early=peak.released_before,
                                       backward_allocates=self.recorder.allocates(name),
                                       unpack_held_bytes=self.recorder.held_at_first_unpack(name))

    def assign_pass_through(self) -> None:
        """Mark ``grad_views`` the nodes whose backward, just run, passed their gradient
        through (:class:`graphckpt.pass_through.PassThroughWatch`)."""
        for name in self.pass_through.passing():
            self.costs[name] = replace(self.costs[name], grad_views=True)

    def _cost(self, node: fx.Node, result: Any, saved: list[torch.Tensor], flops: int, kinds: OpKinds) -> NodeCost:
        tensors = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        fresh, aliased, own = 0, [], set()
        for tensor in tensors:
            key = storage_key(tensor)
            own.add(key)
            if node.op == "get_attr" and self.owner.get(key, PARAM) == PARAM:
                self.owner[key] = node.name  # views of this buffer alias the get_attr node
            elif key in self.owner:
                aliased.append(self.owner[key])
            else:
                self.owner[key] = node.name
                fresh += allocated_bytes(tensor)
        alias_of = aliased[0] if aliased and not fresh and aliased[0] != PARAM else None
        gradient = sum(allocation_size(t.numel() * t.element_size(), t.device) for t in tensors if t.requires_grad)
        names, extra = [], {}  # storages saved that no value owns, each once (several backward functions may save one)
        kept = set()
        for tensor in saved:
            key = storage_key(tensor)
            kept.add(key)
            name = self.owner.get(key)
            if name is None:
                extra[key] = allocated_bytes(tensor)
                self.recorder.saves(tensor)
            elif name != PARAM:
                self.recorder.saves_value(node.name, tensor, name)
                if name not in names:
                    names.append(name)
        shape, dtype = describe_tensors(tensors)
        inner = {key: nbytes for key, ref, nbytes in kinds.expensive_outputs if storage_alive(ref) and key not in own}
        freed = sum(nbytes for _, ref, nbytes in kinds.expensive_outputs if not storage_alive(ref))  # (keys reused)
        remade = 0 if any(key in own for key, _, _ in kinds.expensive_outputs) else fresh  # selective_extra
        cached = {key: nbytes for key, ref, nbytes in kinds.cached_casts if key not in kept and storage_alive(ref)}
        param_grad = param_grad_bytes(self.module, node)
        casts = kinds.parameter_casts  # of its own parameters' gradients only (not more than it makes)
        casts = casts if sum(full for _, full in casts) <= param_grad else []
        return NodeCost(
            bytes=0 if node.op == "get_attr" else fresh,
            alias_of=alias_of,
            flops=int(flops),
            saved=tuple(names),
            saved_extra_bytes=sum(extra.values()),
            requires_grad=any(t.requires_grad for t in tensors),
            random=kinds.random,
            writes_argument=kinds.writes_argument,
            kernels_written=kinds.kernel_output_written,
            expensive=kinds.expensive and not kinds.kernel_output_written,
            grad_views=kinds.last in GRADIENT_VIEW_OPS,
            grad_bytes=gradient if alias_of is not None else None,  # a view's gradient has its own size
            selective_extra_bytes=selective_extra(sum(inner.values()) + freed, remade),
            autocast_cache_bytes=sum(cached.values()),
            param_grad_bytes=param_grad,
            param_grad_cast_bytes=sum(full for _, full in casts),
            param_grad_narrow_bytes=sum(narrow for narrow, _ in casts),
            param_grads=param_grads(self.module, node, self.param_names),
            shape=shape,
            dtype=dtype,
        )


def positional_inputs(graph_module: fx.GraphModule, args: tuple,
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


def fake_copy(graph_module: fx.GraphModule) -> tuple[FakeTensorMode, fx.GraphModule]:
    """A copy of ``graph_module`` on fake tensors, and its mode: what :func:`node_costs`
    runs, made once for several runs of the same graph (copying parameters is slow)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    copy = fake_module_copy(graph_module, mode)
    with_fixed_momentum(copy.modules())
    return mode, copy


def node_costs(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None = None,
               *, training: bool = True, fake: tuple[FakeTensorMode, fx.GraphModule] | None = None,
               backward: bool | None = None) -> dict[str, NodeCost]:
    """A :class:`NodeCost` for every node, from one fake-tensor run at these inputs, with
    the module in training (default) or eval mode; ``backward=False``: a training-mode
    forward alone, without autograd (views, shapes and dtypes, not what backward saves).

    The real module is not run and its buffers are not touched (it is copied to fake
    tensors first, or ``fake`` from :func:`fake_copy` is used). In training mode a fake
    backward follows, and the ATen calls of each node's backward are replayed once on real
    stand-in tensors to measure their scratch memory (:meth:`_CostInterpreter.backward_extra_bytes`;
    cached per process, so repeated plans of one model replay nothing). Eval mode runs
    without autograd: it is for aliasing only, and an autograd graph of tens of thousands
    of nodes that is never run backward overflows the C stack when freed.
    """
    mode, fake_module = fake or fake_copy(graph_module)
    fake_module.train(training)
    backward = training if backward is None else backward
    real_inputs = positional_inputs(graph_module, args, kwargs or {})
    inputs = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in real_inputs]
    for fake_input, real in zip(inputs, real_inputs, strict=True):
        if isinstance(real, torch.Tensor) and real.requires_grad and backward:
            fake_input.requires_grad_(True)
    interpreter = _CostInterpreter(fake_module, mode, backward=backward)
    try:
        with torch.enable_grad() if backward else torch.no_grad():
            outputs = interpreter.run(*inputs)
            if backward:
                interpreter.add_forward_scratch()
                interpreter.backward_extra_bytes(outputs, [v for v in inputs if isinstance(v, torch.Tensor)])
    finally:
        if fake is None:  # the copy made here: its graph's owning_module is the copy, a cycle
            fake_module.graph.owning_module = None  # that held every fake submodule until a collection
    return interpreter.costs
