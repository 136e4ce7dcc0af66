"""Emit the rewritten module: one ``GraphModule`` that runs a plan's segments.

Kept segments are copied inline into the top-level forward. Each recomputed segment
becomes a :class:`graphckpt.runtime.SegmentModule` called from forward, e.g.::

    def forward(self, x):
        gelu_5 = self.segment_0(x)          # recomputed in backward, keeps x
        gelu_11 = self.segment_1(gelu_5)
        layers_12 = getattr(self.layers, "12")(gelu_11)
        ...

except a segment that only drops values an op saves (:func:`passes.remat.runs_by_hooks`),
which becomes a :class:`graphckpt.dropping.DropModule` (``drop_0``, ...), and a selective
segment run by saved-tensor hooks (:mod:`passes.hooked`), which becomes a
:class:`graphckpt.hooked.HookedSegmentModule` (``hooked_0``, ...), and a plan running the
exact solver's schedule (:mod:`passes.exact`), whose one segment becomes a
:class:`graphckpt.exact.ScheduledModule` (``exact_0``, its steps ``exact_0_step_<op>``).

``print(gm.code)`` shows forward followed by every segment's body.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import fx, nn

from graphckpt.bodies import (
    Source,
    attribute_table,
    drop_module,
    facts_of,
    hooked_module,
    remat_arguments,
    remat_module,
    resolve,
    return_values,
    scheduled_module,
)
from graphckpt.dropping import DropModule
from graphckpt.eval_forward import EVAL_FORWARD, ModelForward, dispatching_forward
from graphckpt.exact import ScheduledModule
from graphckpt.hooked import HookedSegmentModule
from graphckpt.kv_cache import caches_by_default
from graphckpt.leaf_modules import stateful_calls
from graphckpt.module_hooks import HOOK_WATCH, HookWatch, hook_kinds, hooked_calls, warn_once_if_hooks_added
from graphckpt.op_kinds import is_cast_node
from graphckpt.planned_inputs import emit_call_checks, emit_parameter_check, example_shapes
from graphckpt.progress import paused_gc
from graphckpt.runtime import SegmentModule
from graphckpt.segment_calls import keep_begin, keep_end
from graphckpt.torch_compat import (
    copy_graph_codegen,
    keep_on_copies,
    module_registries,
    non_persistent_buffers,
    share_call_hooks,
)
from passes.plan import Plan
from passes.remat import remat_sources
from passes.schedule import plan_schedule
from passes.segments import Segment as PlannedSegment
from passes.units import format_bytes


class RewrittenModule(fx.GraphModule):
    """A ``GraphModule`` with the original model's modules, parameters and buffers at the
    original names, so ``state_dict`` and optimizers see exactly the model's tensors."""

    def __init__(self, root: nn.Module | Mapping[str, Any], graph: fx.Graph,
                 class_name: str = "RewrittenModule") -> None:
        super().__init__(root, graph, class_name)
        if isinstance(root, nn.Module):
            adopt_structure(self, root)

    def recompile(self) -> Any:
        """Generate ``forward`` from the graph, run in eval mode by the model itself when the
        module holds it (:mod:`graphckpt.eval_forward`)."""
        python_code = super().recompile()
        type(self).forward = dispatching_forward(type(self).forward)
        return python_code

    @property
    def segments(self) -> list[tuple[str, SegmentModule]]:
        """Every recomputed segment by name, nested ones after their parent."""
        return list(_walk_segments(self))

    @property
    def drops(self) -> list[tuple[str, DropModule]]:
        """Every op run with dropped inputs (:class:`graphckpt.dropping.DropModule`) by name."""
        return [(name, child) for name, child in self.named_children() if isinstance(child, DropModule)]

    @property
    def hooked(self) -> list[tuple[str, HookedSegmentModule]]:
        """Every selective segment run by saved-tensor hooks
        (:class:`graphckpt.hooked.HookedSegmentModule`) by name."""
        return [(name, child) for name, child in self.named_children() if isinstance(child, HookedSegmentModule)]

    @property
    def scheduled(self) -> list[tuple[str, ScheduledModule]]:
        """Every segment run by an exact schedule (:class:`graphckpt.exact.ScheduledModule`) by name."""
        return [(name, child) for name, child in self.named_children() if isinstance(child, ScheduledModule)]

    @property
    def code(self) -> str:
        header = self.meta.get("graphckpt_header", "")
        bodies = []
        for name, scheduled in self.scheduled:
            bodies.append(f"# {name}: {scheduled.extra_repr()}{_named_code(scheduled.body, name)}")
            for op, step in scheduled.steps.items():
                extras = scheduled.with_autograd(op)
                but = (f"; but {', '.join(extras)}, run with autograd on to hold what it saves beyond values "
                       "(its extra, such as max-pool's indices)" if extras else "")
                bodies.append(f"# {name}_step_{op}: runs without gradients just before the backward of {op}{but}"
                              f"{_named_code(step, f'{name}_step_{op}')}")
        for name, segment in [*self.segments, *self.drops, *self.hooked]:
            bodies.append(f"# {name}: {segment.extra_repr()}{_named_code(segment.body, name)}")
            if isinstance(segment, HookedSegmentModule):
                for i, (group, remake) in enumerate(zip(segment.groups, segment.remakes, strict=True)):
                    when = ("when backward first needs" if group[0] in segment.held or not segment.each_use
                            else "each time backward unpacks")
                    held = ", held until nothing left may need it" if group[0] in segment.held else ""
                    code = _named_code(remake, f"{name}_remake_{i}")
                    bodies.append(f"# {name}_remake_{i}: runs without gradients {when} "
                                  f"{' or '.join(group)}, to make them again{held}{code}")
                continue
            if segment.remat is not None:
                when = "its recompute runs first" if isinstance(segment, SegmentModule) else "backward runs"
                bodies.append(f"# {name}_remat: what {when}, without gradients, "
                              f"to make again the inputs forward dropped{_named_code(segment.remat, f'{name}_remat')}")
        return "\n".join([header + super().code, *bodies])


def _named_code(module: fx.GraphModule, name: str) -> str:
    """``module``'s generated code with its ``forward`` named ``name``, as the part of
    ``print(gm.code)`` that shows what it runs."""
    return module.code.replace("def forward(self, ", f"def {name}(self, ", 1)


def _walk_segments(owner: nn.Module) -> Iterator[tuple[str, SegmentModule]]:
    for name, child in owner.named_children():
        if isinstance(child, SegmentModule):
            yield name, child
            yield from _walk_segments(child.body)


def adopt_structure(target: nn.Module, source: nn.Module) -> None:
    """Give ``target`` the top-level modules, parameters and buffers of ``source`` (same
    objects, same persistence), so both have the same ``state_dict`` keys."""
    modules, parameters, buffers = module_registries(source)
    for name, child in modules.items():
        if module_registries(target)[0].get(name) is not child:
            setattr(target, name, child)
    for name, parameter in parameters.items():
        if parameter is not None:
            target.register_parameter(name, parameter)
    not_persistent = non_persistent_buffers(source)
    for name, buffer in buffers.items():
        if buffer is not None:
            target.register_buffer(name, buffer, persistent=name not in not_persistent)
    for own, theirs in zip(module_registries(target), (modules, parameters, buffers), strict=True):
        _order_like(own, theirs)


def _order_like(mapping: dict, reference: Mapping) -> None:
    """Reorder ``mapping`` in place: ``reference``'s keys first, in its order, so
    ``parameters()`` and ``state_dict()`` list tensors in the model's order."""
    ordered = {key: mapping[key] for key in reference if key in mapping}
    ordered.update((key, value) for key, value in mapping.items() if key not in ordered)
    mapping.clear()
    mapping.update(ordered)


def _segment_module(source: Source, planned: PlannedSegment, target: str) -> SegmentModule:
    """The runtime module of one recomputed segment. Its body takes the segment's inputs and
    returns its outputs; nested recomputed children become segments called from the body."""
    facts = facts_of(planned)
    originals = source.nodes
    body = fx.Graph()
    env = {name: body.placeholder(name) for name in planned.inputs}

    def copy_node(name: str) -> None:
        if name in env:
            return
        kept = name in planned.saved_inside
        if kept:  # the policy keeps what runs between the marks (graphckpt.segment_calls.keep_begin)
            how = ("cast" if is_cast_node(originals[name]) else "whole") if name in facts.kept_whole else "kernels"
            body.call_function(keep_begin, (how,), name=f"keep_{name}")
        env[name] = body.node_copy(originals[name], lambda n: env[n.name])
        if kept:
            body.call_function(keep_end, (env[name],), name=f"kept_{name}")

    children = planned.children or (PlannedSegment(planned.nodes, False, planned.inputs, planned.outputs),)
    modules = _emit_segments(body, source, children, env, copy_node, prefix=f"{target}_")
    return_values(body, [env[name] for name in planned.outputs])
    attributes = {**attribute_table(body, source.module, skip=modules), **modules}
    remat, wiring = remat_module(source, planned)
    segment = SegmentModule(fx.GraphModule(attributes, body, "SegmentBody"), nodes=planned.nodes,
                            inputs=planned.inputs, outputs=planned.outputs, saved_inside=planned.saved_inside,
                            kept_bytes=facts.kept_bytes, replays_rng=facts.draws_random, reruns=facts.reruns,
                            state_inputs=facts.state_inputs, kept_whole=facts.kept_whole, remat=remat, **wiring)
    for child in modules.values():
        object.__setattr__(child, "enclosing", segment)
    return segment


def _emit_segments(target_graph: fx.Graph, source: Source,
                   segments: tuple[PlannedSegment, ...], env: dict[str, fx.Node],
                   copy_node: Callable[[str], None], prefix: str) -> dict[str, nn.Module]:
    """Emit a sequence of planned segments into ``target_graph``: kept ones inline, each
    recomputed one as a call of a new :class:`SegmentModule` or, run by hooks, a new
    :class:`DropModule` or :class:`HookedSegmentModule` (returned by name, each kind
    numbered on its own)."""
    modules: dict[str, nn.Module] = {}
    made = {DropModule: 0, HookedSegmentModule: 0, SegmentModule: 0, ScheduledModule: 0}
    for planned in segments:
        if not planned.recompute:
            for name in planned.nodes:
                copy_node(name)
            continue
        unmade = [name for name in remat_sources(planned) if name not in env]
        if unmade:  # copying it here would run its ops again in forward, outside the segment owning them
            raise ValueError(f"segment {planned.nodes[0]} .. {planned.nodes[-1]} rematerializes inputs from "
                             f"{unmade}, which no earlier code returns: the plan is invalid (passes.remat.held_at_each)")
        for name in planned.inputs:
            copy_node(name)
        if planned.schedule is not None:
            target = f"exact_{made[ScheduledModule]}"
            modules[target] = scheduled_module(source, planned)
        elif facts_of(planned).by_hooks:
            target = f"drop_{made[DropModule]}"
            modules[target] = drop_module(source, planned)
        elif facts_of(planned).keeps_by_hooks:
            target = f"hooked_{made[HookedSegmentModule]}"
            modules[target] = hooked_module(source, planned)
        else:
            target = f"{prefix}{made[SegmentModule]}"
            modules[target] = _segment_module(source, planned, target)
        made[type(modules[target])] += 1
        modules[target].label = target  # its name in a profiler's trace
        _emit_call(target_graph, target, planned, env, source)
    return modules


def _emit_call(top: fx.Graph, target: str, planned: PlannedSegment, env: dict[str, fx.Node],
               source: Source) -> None:
    """Call a segment from the top-level forward, naming its results as the originals."""
    arguments = tuple(env[name] for name in (*planned.inputs, *remat_arguments(source, planned)))
    if len(planned.outputs) == 1:
        env[planned.outputs[0]] = top.create_node("call_module", target, arguments, name=planned.outputs[0])
        return
    call = top.create_node("call_module", target, arguments, name=f"{target}_outputs")
    for index, name in enumerate(planned.outputs):
        env[name] = top.create_node("call_function", operator.getitem, (call, index), name=name)


def _header(plan: Plan, method: str) -> str:
    depth = max((s.depth for s in plan.segments), default=0)
    nesting = f", nested {depth} deep (segment_i_j runs inside segment_i's recompute)" if depth > 1 else ""
    hooked = sum(1 for s in plan.recomputed_segments if s.facts is not None and s.facts.by_hooks)
    dropping = f"; {hooked} of them ops run with dropped inputs (drop_i)" if hooked else ""
    selective = sum(1 for s in plan.recomputed_segments if s.facts is not None and s.facts.keeps_by_hooks)
    dropping += f"; {selective} selective ones run by saved-tensor hooks (hooked_i)" if selective else ""
    scheduled = sum(1 for s in plan.segments if s.schedule is not None)
    dropping += "; run by the exact solver's schedule (exact_0, its steps exact_0_step_<op>)" if scheduled else ""
    lines = [f"# graphckpt: strategy {plan.strategy}, captured with {method}; "
             f"{len(plan.recomputed_segments)} of {len(plan.segments)} segments recomputed in backward{nesting}{dropping}"]
    for kept in plan.checkpoint_details:
        lines.append(f"#   keeps {kept.name}: {kept.shape} {kept.dtype} ({format_bytes(kept.bytes)})")
    if plan.autocast:
        lines.append(f"#   planned under autocast {plan.autocast}: warns if a call runs under another")
    if plan.inputs_without_grad:
        lines.append(f"#   planned for {', '.join(plan.inputs_without_grad)} without gradients: "
                     f"{'refuses' if scheduled else 'warns at'} a call passing one that requires grad")
    return "\n".join(lines) + "\n"


def _hooks_note(source: fx.GraphModule, model: nn.Module, method: str) -> str:
    """Header lines naming the modules whose hooks the rewritten module runs as eager does,
    and the torch modules it never recomputes because they update their own buffers."""
    lines = []
    for calls, why in ((hooked_calls(source), "module hooks run once a step"),
                       (stateful_calls(source), "torch modules updating their own buffers run once a step")):
        kept = list(dict.fromkeys(calls.values()))  # in the order the graph calls them
        them = "it" if len(kept) == 1 else "them"
        if kept:
            lines.append(f"#   calls {', '.join(kept)} whole and never recomputes {them}: {why}")
    if caches_by_default(model):
        lines.append("#   captured with use_cache=False: a training step builds no KV cache (graphckpt.kv_cache)")
    own = hook_kinds(model) if method == "fx" else ()  # export traced the model's own hooks in
    if own:
        lines.append(f"#   runs {type(model).__name__}'s own hooks ({', '.join(own)}) around forward")
    return "".join(line + "\n" for line in lines)


@paused_gc()
def generate(source: fx.GraphModule, model: nn.Module, plan: Plan, method: str = "fx") -> RewrittenModule:
    """The rewritten module for ``plan`` over the captured ``source`` of ``model``. Everything
    it needs of the cost graph is in the plan (:class:`passes.segments.RecomputeFacts`,
    :attr:`passes.plan.Plan.checkpoint_details`). The garbage collector is paused meanwhile
    (:func:`graphckpt.progress.paused_gc`)."""
    captured = Source.of(source)
    top = fx.Graph()
    copy_graph_codegen(source.graph, top)
    env: dict[str, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node.name not in env:
            env[node.name] = top.node_copy(node, lookup)
        return env[node.name]

    for node in source.graph.nodes:
        if node.op == "placeholder":
            lookup(node)
    emit_call_checks(top, dict(env), plan.inputs_without_grad, plan.peak_bytes, plan.autocast,
                     exact=plan_schedule(plan.segments) is not None,
                     fixed_shapes=example_shapes(source) if method == "export" else None)
    emit_parameter_check(top, model, plan.peak_bytes, fixed=method == "export")
    top.create_node("call_function", warn_once_if_hooks_added, (top.get_attr(HOOK_WATCH),), name="hooks_added")
    segments = _emit_segments(top, captured, plan.segments, env,
                              lambda name: lookup(captured.nodes[name]), prefix="segment_")
    for node in source.graph.nodes:
        if node.op == "output":
            lookup(node)
    staging = nn.Module()
    adopt_structure(staging, model)
    setattr(staging, HOOK_WATCH, HookWatch.of(model, source, method, _rerun_modules(captured, plan)))
    for target, segment in segments.items():
        staging.add_module(target, segment)
    for node in top.nodes:
        if node.op in ("call_module", "get_attr") and not _has_attribute(staging, node.target):
            _attach(staging, node, resolve(source, node.target))
    top.lint()
    rewritten = RewrittenModule(staging, top, type(model).__name__ + "Checkpointed")
    if method == "fx":  # export traced the model's own hooks in
        share_call_hooks(model, rewritten, keep_on_copies)
    keep_on_copies(rewritten, EVAL_FORWARD, ModelForward(model, hooks_ran=method == "fx"))
    rewritten.meta["graphckpt_header"] = (_header(plan, method) + _hooks_note(source, model, method)
                                          + f"#   eval() runs {type(model).__name__}'s own forward\n")
    rewritten.meta["graphckpt_plan"] = plan
    return rewritten


def _rerun_modules(captured: Source, plan: Plan) -> set[str]:
    """The paths of the modules called whole that the plan's recomputes run again (what a
    segment's recompute runs, and what a segment run by hooks makes again)."""
    names = set()
    for segment in plan.recomputed_segments:
        if segment.facts is None:
            names.update(segment.nodes)
        else:
            names.update(segment.facts.reruns, *segment.facts.remake_ops)
    nodes = (captured.nodes[name] for name in names if name in captured.nodes)
    return {node.target for node in nodes if node.op == "call_module"}


def _has_attribute(root: nn.Module, target: str) -> bool:
    try:
        resolve(root, target)
    except AttributeError:
        return False
    return True


def _attach(root: nn.Module, node: fx.Node, value: Any) -> None:
    """Attach what only the captured graph has (export constants, guard modules) at the top
    level, without adding ``state_dict`` keys or touching the model's own modules."""
    name = "_graphckpt_" + node.target.replace(".", "_")
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        root.register_buffer(name, value, persistent=False)
    else:
        setattr(root, name, value)
    node.target = name
