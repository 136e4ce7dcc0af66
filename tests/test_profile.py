"""The fake-tensor profile (graphckpt.profile): what its runs may and may not do."""

from __future__ import annotations

import contextlib
import functools
import gc
import types

import pytest
import torch
from torch import fx, nn

from graphckpt.api import cost_model
from graphckpt.backward_record import RELEASED, Recorder
from graphckpt.costs import prepare
from graphckpt.profile import _CostInterpreter, fake_copy, node_costs
from graphckpt.torch_compat import FakeTensorMode
from passes.graph_facts import op_nodes

GRAD_MODES: list[bool] = []


@fx.wrap
def record_grad_mode(x: torch.Tensor) -> torch.Tensor:
    """Notes whether autograd records where this runs (an fx leaf: called at run time)."""
    GRAD_MODES.append(torch.is_grad_enabled())
    return x


class Recorded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(record_grad_mode(self.linear(x)))


def test_eval_run_builds_no_autograd_graph_and_training_run_does() -> None:
    """The eval run exists for aliasing only; an autograd graph it never runs backward
    overflowed the C stack when freed at 50k nodes (segfault), so it must not build one."""
    gm = fx.symbolic_trace(Recorded())
    x = torch.randn(2, 4, requires_grad=True)
    GRAD_MODES.clear()
    fake = fake_copy(gm)
    train = node_costs(gm, (x,), training=True, fake=fake)
    evaluated = node_costs(gm, (x,), training=False, fake=fake)
    assert GRAD_MODES == [True, False]
    assert train["drop"].alias_of is None and evaluated["drop"].alias_of == "linear"  # its storage root
    assert train["drop"].eval_alias_of == "linear" and evaluated["drop"].eval_alias_of is None


def test_prepare_sees_eval_mode_views_with_one_fake_copy() -> None:
    gm = fx.symbolic_trace(Recorded())
    profile = prepare(gm, (torch.randn(2, 4),))
    drop = next(n for n in gm.graph.nodes if n.name == "drop")
    assert profile.parents[drop].name == "record_grad_mode"  # dropout is a view in eval


def test_saves_from_tells_when_backward_has_what_it_saves() -> None:
    """Linear and GELU save their inputs, ReLU its output, an add nothing; dropout its mask."""

    class Ops(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.gelu = torch.nn.GELU()
            self.relu = torch.nn.ReLU()
            self.dropout = torch.nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.relu(self.gelu(self.linear(x))) + x)

    _, graph = cost_model(Ops(), (torch.randn(4, 8, requires_grad=True),))
    saves = {graph.nodes[n]["label"]: graph.nodes[n]["saves_from"] for n in op_nodes(graph)}
    assert saves == {"linear": "inputs", "gelu": "inputs", "relu": "outputs", "add": "nothing", "dropout": "outputs"}


def test_fused_attention_rng_state_is_replayed_on_the_host() -> None:
    """Replaying a fused attention backward with its philox seed and offset stood in on the
    GPU crashed the process (T5 on CUDA): the kernel reads them through a host pointer."""
    from graphckpt.scratch import Layout, rng_state_on_host

    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    names = [argument.name for argument in op._schema.arguments]
    layout = Layout((2, 2, 4, 8), (64, 32, 8, 1), torch.float32, torch.device("cuda"))
    state = Layout((), (), torch.int64, torch.device("cuda"))
    args = tuple(state if name.startswith("philox") else layout for name in names[:9])
    moved, _ = rng_state_on_host(op, args, {})
    assert [t.device.type for t in moved] == ["cuda"] * 7 + ["cpu"] * 2


def test_selective_segments_recompute_calls_that_draw_random_numbers() -> None:
    """A fused attention with dropout is recomputed, not kept: a kept result draws nothing
    in the recompute, and every later random op of the segment then drew other numbers."""
    from graphckpt.op_kinds import kept_by_selective
    from graphckpt.torch_compat import draws_random_numbers

    attention = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.zeros(1, 1, 2, 2)
    assert kept_by_selective(attention, (q, q, q, None, False, 0.0), {})
    assert not kept_by_selective(attention, (q, q, q, None, False), {"dropout_p": 0.1})
    cpu_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not draws_random_numbers(cpu_attention, (q, q, q, 0.0), {})
    assert draws_random_numbers(cpu_attention, (q, q, q), {"dropout_p": 0.1})
    assert not draws_random_numbers(torch.ops.aten.native_dropout.default, (q, 0.5, False))
    assert draws_random_numbers(torch.ops.aten.native_dropout.default, (q, 0.0, True))  # draws all the same
    assert kept_by_selective(torch.ops.aten.mm.default, (q, q), {})
    assert not kept_by_selective(torch.ops.aten.relu.default, (q,), {})


def test_draws_random_numbers_matches_what_the_generator_sees() -> None:
    """The call-level answer is checked against the generator itself: a call said to draw
    nothing leaves the next ``rand`` where it was, one said to draw moves it. (CPU's fused
    attention refuses dropout; with dropout, attention runs the math kernel's own dropout.)"""
    from graphckpt.torch_compat import draws_random_numbers

    q = torch.ones(1, 1, 4, 4)
    calls = [(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0)),
             (torch.ops.aten.native_dropout.default, (q, 0.0, True)),
             (torch.ops.aten.native_dropout.default, (q, 0.5, False))]
    for op, args in calls:
        torch.manual_seed(0)
        untouched = torch.rand(1)
        torch.manual_seed(0)
        op(*args)
        assert draws_random_numbers(op, args) == (torch.rand(1) != untouched).item(), (op, args[1:])


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no backward on fake tensors")


def test_the_backward_recorder_is_on_only_while_a_recorded_node_runs() -> None:
    """The recorder is a dispatch mode entered by a recorded node's autograd functions
    alone: their ATen calls are recorded, the calls of functions no node claimed are not
    seen, and a function that fails leaves the mode stack as it was (torch restores it)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    interpreter = _CostInterpreter(gm, FakeTensorMode())
    x = torch.randn(3, 4, requires_grad=True)
    y = x.sin()
    interpreter._claim_grad_fns(y, "sin")
    (y.cos() + y).sum().backward()  # the cos and the add: no node's
    assert [str(call[0]) for call in interpreter.recorder.calls["sin"]] == ["aten.cos.default", "aten.mul.Tensor"]
    interpreter._claim_grad_fns(failing := _FailsInBackward.apply(x), "failing")
    with pytest.raises(RuntimeError, match="no backward"):
        failing.sum().backward()
    assert _get_current_dispatch_mode_stack() == []


def test_a_calls_scratch_sits_on_what_is_held_while_it_runs() -> None:
    """What each backward call's kernel scratch sits on: what the calls before it made and
    have not freed, net of the saved extras released before it, and its own results; what
    is freed or released once it returns, not yet. A bf16 linear's backward under autocast
    as the recorder sees it: two ``mm`` (input and weight gradients in bf16), the saved
    casts released, then the float32 copies of the gradients, each bf16 one freed after."""
    recorder = Recorder()
    grad_input, grad_weight, input_copy, weight_copy = (object() for _ in range(4))
    recorder.events["linear"] = [(grad_input, 64), (grad_weight, 128), (RELEASED, -64), (RELEASED, -128),
                                 (input_copy, 128), (grad_input, 0), (weight_copy, 256), (grad_weight, 0)]
    recorder.call_starts["linear"] = [0, 1, 4, 6]
    recorder.ends["linear"] = 8
    saved_casts = 64 + 128  # made in forward: their release takes the count below where backward started
    assert recorder.held_after_calls("linear") == [64, 64 + 128, 64 + 128 - saved_casts + 128,
                                                   128 + 128 - saved_casts + 256]
    assert recorder.backward_peak("linear").bytes == 128 + 128 - saved_casts + 256


def _is_own(thing: object) -> bool:
    """A module, or a function of the project's own (bare, bound or partially applied)."""
    if isinstance(thing, functools.partial):
        thing = thing.func
    if isinstance(thing, types.MethodType):
        thing = thing.__func__
    return isinstance(thing, nn.Module) or \
        (isinstance(thing, types.FunctionType) and (thing.__module__ or "").startswith(("graphckpt", "passes")))


def _own_cyclic_garbage(blocks: int, dedup: bool = True) -> int:
    """How many objects of the project's own (modules, functions) a profile of a stack of
    ``blocks`` blocks (deduplicated or not) leaves in reference cycles. Garbage left by
    whatever ran before is collected first, to the end: a cycle through an autograd
    function's hooks frees the functions after it only at the next collection (the chain is
    held by C++, which the collector does not see), so one collection can leave another
    test's graph to be found during this profile."""
    gm = fx.symbolic_trace(nn.Sequential(*(m for _ in range(blocks) for m in (nn.Linear(8, 8), nn.GELU()))))
    x = torch.randn(2, 8)
    prepare(gm, (x,), dedup=dedup)
    for _ in range(1000):
        if not gc.collect():
            break
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    before = len(gc.garbage)
    try:
        prepare(gm, (x,), dedup=dedup)
        gc.collect()
        return sum(map(_is_own, gc.garbage[before:]))
    finally:
        gc.set_debug(0)
        del gc.garbage[before:]
        if enabled:
            gc.enable()


@pytest.mark.parametrize("dedup", [True, False])
def test_the_profile_leaves_no_reference_cycles(dedup: bool) -> None:
    """Nothing the profile makes is a reference cycle (a recursive closure, a copy of the
    module holding itself, a hook holding the autograd function it is registered on): at
    10k nodes such cycles were 98k objects left for the garbage collector, half a second of
    a collection after every profile. Torch's own (pytree and meta-conversion closures) are
    not counted. With dedup, 11 of the 12 blocks are deduplicated ghosts of the first, whose
    backward the dedup's gradient watch hooks; without it (``GRAPHCKPT_DEDUP=0``, or dedup's
    fallback) the full profile's fake copy of the GraphModule is its graph's owning module,
    a cycle that held all 24 fake submodules."""
    assert _own_cyclic_garbage(12, dedup) == 0


def test_scratch_heights_are_what_a_forward_call_runs_on_above_what_the_node_ends_with() -> None:
    """Where each 16-bit forward call's kernel scratch sits: what the node's calls had made
    and not freed just after the call's own results, less what is alive when the node ends
    (its value and what it saves), which the simulator holds beside the temporaries."""
    from graphckpt.op_kinds import OpKinds

    kinds = OpKinds()
    kinds.made = [64, 256, 32]  # a cast, a score matrix, the result
    kinds.events = [0, 1, -1, 2, -2]  # cast made, scores made, cast freed, result made, scores freed
    kinds.scratch_at = [1, 2, 4]  # just after the cast; after the scores; after the result
    assert kinds.scratch_heights() == [64 - 32, 64 + 256 - 32, 256 + 32 - 32]


def test_a_rerun_served_from_the_selective_cache_holds_the_cached_outputs_from_its_start() -> None:
    """In a selective segment's recompute, the matmul outputs of a node it keeps come out of
    selective checkpointing's cache, made in forward: alive from the rerun's first call, not
    from their kernel's (which does not run), so a later one sits under every temporary before
    it. Swin's attention under bf16 held its second matmul's float32 product, cached, while
    the rerun added the mask: its plans measured 6.5-7.9% over their simulated peaks."""
    from graphckpt.op_kinds import OpKinds

    kinds = OpKinds()
    kinds.opaque = True
    kinds.made = [256, 512, 128]  # scores (a matmul's), their softmax, the product (a matmul's)
    kinds.cached_made = {0, 2}
    kinds.events = [0, 1, -1, 2, -2]  # scores, softmax, scores freed, product, softmax freed
    kinds.scratch_at = [2]  # just after the softmax
    assert kinds.forward_extra_bytes() == 256 + 512 - 128
    assert kinds.forward_extra_bytes(served_from_cache=True) == 256 + 512 + 128 - 128
    assert kinds.scratch_heights(served_from_cache=True) == [256 + 512 + 128 - 128]


def test_forward_extra_bytes_of_math_attention_hold_its_softmax_mask() -> None:
    """CPU attention with a mask that needs a gradient runs the math kernel, whose
    ``_safe_softmax`` builds a boolean mask of its input's ``-inf`` entries and each row's
    ``all`` of it inside itself, where no dispatch mode sees it: a 6-block Swin's float32
    floor plan measured 3.1% over its simulated peak for want of it. The node's value, what
    it saves beyond values and its temporaries come to the call's measured peak (measured
    here, not asserted in bytes)."""
    from graphckpt.tools.measure import peak_memory

    class BiasedAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(4, 2, 64, 64))

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)

    torch.manual_seed(0)
    layer, inputs = BiasedAttention(), tuple(torch.randn(4, 2, 64, 16, requires_grad=True) for _ in range(3))
    _, graph = cost_model(layer, inputs)
    (node,) = op_nodes(graph)
    layer(*inputs)
    outputs: list[torch.Tensor] = []
    peak = peak_memory(lambda: outputs.append(layer(*inputs)))
    attributes = graph.nodes[node]
    assert attributes["bytes"] + attributes["saved_extra_bytes"] + attributes["forward_extra_bytes"] == peak


def test_math_attention_has_the_temporaries_of_plain_code_and_of_a_dispatch_mode() -> None:
    """CPU's math attention adds a float mask to its scores in place in plain code, and out of
    place when a dispatch mode is active (the profile's, selective checkpointing's): under
    bf16 the mixed-width add then makes a new score matrix and a float32 copy of the mask
    inside itself. The node's ``forward_extra_bytes`` are plain code's (BEiT's eager peak
    simulated 20% over its measured one), its ``selective_forward_extra_bytes`` a mode's;
    each with its value and what it saves comes to the call's measured peak there."""
    from graphckpt.tools.measure import peak_memory
    from graphckpt.torch_compat import TorchDispatchMode

    class BiasedAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(1, 2, 64, 64))

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.expand(4, 2, 64, 64))

    class Plain(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def measured(moded: bool) -> int:
        outputs: list[torch.Tensor] = []
        with torch.autocast("cpu", dtype=torch.bfloat16), Plain() if moded else contextlib.nullcontext():
            layer(*inputs)
            return peak_memory(lambda: outputs.append(layer(*inputs)))

    torch.manual_seed(0)
    layer = BiasedAttention()
    inputs = tuple(torch.randn(4, 2, 64, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, graph = cost_model(layer, inputs)
    attention = graph.nodes[next(n for n in op_nodes(graph) if n.startswith("scaled_dot_product_attention"))]
    held = attention["bytes"] + attention["saved_extra_bytes"]
    assert held + attention["forward_extra_bytes"] == measured(moded=False)
    assert held + attention["selective_forward_extra_bytes"] == measured(moded=True)


def test_a_forward_calls_scratch_is_laid_on_what_the_node_held_while_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-bit call's kernel scratch raises ``forward_extra_bytes`` only where it and what
    the node held while it ran reach above the node's temporaries: scratch in an early call
    of attention's math kernel under bf16, when little is made yet, changes nothing (laid on
    the whole temporaries' peak, T5's position-bias ``add`` over-simulated its plans by
    5-7%, stop 69). Scratch sizes are given, not replayed: no CPU's own figures."""
    import graphckpt
    import graphckpt.profile

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.project = nn.Linear(16, 48)
            self.bias = nn.Parameter(torch.randn(1, 2, 32, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.project(x).view(4, 32, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)

    def temporaries(first_call_scratch: int) -> int:
        def scratch_by_call(calls_by_node: dict) -> dict:
            return {name: [first_call_scratch if "attention" in name and i == 0 else 0 for i, _ in enumerate(calls)]
                    for name, calls in calls_by_node.items()}

        monkeypatch.setattr(graphckpt.profile, "scratch_by_call", scratch_by_call)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            graph = graphckpt.analyze(Attention(), (torch.randn(4, 32, 16, requires_grad=True),)).cost_graph
        (attention,) = (n for n in op_nodes(graph) if "scaled_dot_product_attention" in n)
        return graph.nodes[attention]["forward_extra_bytes"]

    peak = temporaries(0)
    assert peak > 0  # the math kernel's temporaries
    assert temporaries(1) == peak  # on top of them before: peak + 1
    assert temporaries(10 * peak) < 11 * peak  # where little was held yet
