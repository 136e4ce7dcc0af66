"""Export a model whose layers repeat in a fraction of export's time: trace a few, stamp
the rest.

``torch.export`` traces every op of every layer with proxy tensors, about 2 ms a node on a
2-core CPU: an 80-layer LLaMA's export takes 8 s, a 10k-node graph 20 s, more than all of
graphckpt's own stages. The layers of a transformer are copies of one another, so the
model is exported with each run of like blocks (the layers per-block checkpointing wraps,
:func:`graphckpt.blocks.find_blocks`) cut to its first three, and the third block's nodes
are copied ("stamped") once for every block left out, each copy reading its own block's
parameters. Three, because the first block may differ from the rest (T5's first block
makes the position bias every later one reads): the third block is the template, and the
second tells which of the template's inputs come from the block before it.

Layers that alternate (Gemma 2's sliding-window and global attention, every other layer)
repeat with a period: the run is cut to its first block and two periods (plus the blocks
that put the last one traced in the same phase as the model's last), and the last period
traced holds one template per phase.

The model is exported whole instead when the blocks after the first differ in anything
but a layer index and a period (module classes, tensor layouts, hooks, attributes), when
the cut export does not lay the blocks out one after another, and when the stamped
graph's outputs on the example inputs differ from the eager model's (:func:`same_outputs`).
``GRAPHCKPT_STAMP=0`` in the environment turns stamping off.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from graphckpt.blocks import find_blocks, join_path
from graphckpt.op_keys import Unkeyable, constant_key, own_tensors_key
from graphckpt.torch_compat import has_module_hooks, module_registries, tree_leaves

MIN_STAMPED = 3  # a run with fewer blocks to stamp exports about as fast whole
MAX_PERIOD = 8  # the longest pattern of layers looked for (Gemma 3: 5 local, 1 global)
STAMP_ENV = "GRAPHCKPT_STAMP"
Export = Callable[[nn.Module, tuple, dict], fx.GraphModule]


class NotStampable(Exception):
    """The cut export's graph is not laid out so that its template block can be stamped."""


@dataclass(frozen=True)
class BlockRun:
    """Blocks of one container (a ``ModuleList``/``Sequential``) that are alike from the
    second on, block ``i`` like block ``i + period``: ``container`` is its qualified name,
    ``names`` its blocks' child names.

    >>> run = BlockRun("layers", tuple(map(str, range(26))), period=2)
    >>> run.traced, run.template_of(24), run.template_of(25)
    (6, 4, 5)
    """

    container: str
    names: tuple[str, ...]
    period: int = 1

    def path(self, index: int) -> str:
        return join_path(self.container, self.names[index])

    @property
    def traced(self) -> int:
        """Blocks the cut export keeps: the first, two periods, and as many more as put the
        last one traced in the last block's phase."""
        return 1 + 2 * self.period + (len(self.names) - 1 - 2 * self.period) % self.period

    def template_of(self, index: int) -> int:
        """The block of ``index``'s phase in the last period traced: its template."""
        first = self.traced - self.period
        return first + (index - first) % self.period


def stampable_runs(model: nn.Module) -> list[BlockRun]:
    """The runs of like blocks in ``model`` with :data:`MIN_STAMPED` to stamp: per container of
    blocks (:func:`graphckpt.blocks.find_blocks`), or, where those blocks are not alike
    (a ResNet's stages), inside each of them (a stage's residual blocks)."""
    path_of = {id(module): name for name, module in model.named_modules()}
    return list(_runs_in(model, path_of))


def _runs_in(module: nn.Module, path_of: dict[int, str]) -> Iterator[BlockRun]:
    grouped: dict[int, tuple[nn.Module, list[str]]] = {}
    for container, name in find_blocks(module):
        grouped.setdefault(id(container), (container, []))[1].append(name)
    for container, names in grouped.values():
        blocks = [getattr(container, name) for name in names]
        repeat = period(blocks)
        run = BlockRun(path_of[id(container)], tuple(names), repeat or 1)
        if repeat and len(names) - run.traced >= MIN_STAMPED:
            yield run
        else:
            for block in blocks:
                yield from _runs_in(block, path_of)


def period(blocks: Sequence[nn.Module]) -> int | None:
    """The shortest period with which the blocks after the first repeat, each computing
    what the block a period before it does from its own tensors: same module tree, classes
    and tensor layouts, no hooks, no tensor shared between blocks, equal attributes except
    one counting the layers (``layer_idx``); ``None`` when there is none of at least three
    repeats (and at most :data:`MAX_PERIOD`).

    >>> period([nn.Linear(2, 3), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)])
    1
    >>> period([nn.Linear(2, 2), *[nn.Linear(2, 2, bias=i % 2 == 0) for i in range(6)]])
    2
    >>> period([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2, bias=False)]) is None
    True
    """
    rest = blocks[1:]
    described = [_description(block) for block in rest]
    tensors = [id(t) for block in rest for t in (*block.parameters(), *block.buffers())]
    if any(d is None for d in described) or len(set(tensors)) < len(tensors):
        return None
    structures = [d[0] for d in described]  # type: ignore[index]
    attributes = [d[1] for d in described]  # type: ignore[index]
    keys = set().union(*attributes)
    counting = {key for key in keys if _layer_index([a.get(key) for a in attributes])}
    for repeat in range(1, min(MAX_PERIOD, len(rest) // 3) + 1):
        if all(structures[i] == structures[i + repeat] and all(
                a.get(key) == attributes[i + repeat].get(key) for key in keys - counting)
               for i, a in enumerate(attributes[:-repeat])):
            return repeat
    return None


def _description(block: nn.Module) -> tuple[Hashable, dict[tuple[str, str], Hashable]] | None:
    """``(structure, attributes)`` of a block, ``None`` when a hook could change its calls."""
    structure, attributes = [], {}
    for path, module in block.named_modules(remove_duplicate=False):
        if has_module_hooks(module):
            return None
        structure.append((path, type(module), own_tensors_key(module)))
        for name, value in vars(module).items():
            if not name.startswith("_") and not isinstance(value, torch.Tensor):
                attributes[path, name] = _attribute_key(value)
    return tuple(structure), attributes


def _attribute_key(value: Any) -> Hashable:
    """A block attribute compared across blocks: a constant by value, a ``functools.partial``
    (an activation's ``gelu(approximate="tanh")``) by what it calls, anything else by identity."""
    if isinstance(value, functools.partial):
        keywords = tuple(sorted((k, _attribute_key(v)) for k, v in value.keywords.items()))
        return "partial", _attribute_key(value.func), tuple(_attribute_key(a) for a in value.args), keywords
    try:
        return constant_key(value)
    except Unkeyable:
        return "object", id(value)  # a shared config or function: alike only if the same object


def _layer_index(keys: Sequence[Hashable]) -> bool:
    """Whether an attribute's values, block by block, count up by one (a layer index)."""
    values = [key[1] if isinstance(key, tuple) and key[0] == "int" else None for key in keys]
    return len(values) > 1 and None not in values and all(b - a == 1 for a, b in itertools.pairwise(values))  # type: ignore[operator]


@contextlib.contextmanager
def cut_to_traced(model: nn.Module, runs: Sequence[BlockRun]) -> Iterator[None]:
    """While active, each run's container holds only its first ``run.traced`` blocks (and
    its other children); the same container objects, so the model's code finds them."""
    saved = []
    for run in runs:
        children, _, _ = module_registries(model.get_submodule(run.container))
        saved.append((children, dict(children)))
        for name in run.names[run.traced:]:
            del children[name]
    try:
        yield
    finally:
        for children, original in saved:
            children.clear()
            children.update(original)


def export_stamped(model: nn.Module, args: tuple, kwargs: dict, export: Export) -> fx.GraphModule | None:
    """``export`` of ``model`` with its runs of like blocks traced a few blocks deep and
    stamped for the rest, checked against the eager model; ``None`` when the model has no
    such run or stamping does not give the model's outputs (then export it whole)."""
    runs = stampable_runs(model) if os.environ.get(STAMP_ENV, "1") != "0" else []
    if not runs:
        return None
    try:
        with cut_to_traced(model, runs):
            graph_module = export(model, args, kwargs)
        for run in runs:
            stamp(graph_module, run, model)
    except Exception:  # the cut model does not run, or its graph is laid out otherwise
        return None
    graph_module.graph.lint()
    graph_module.recompile()
    graph_module.meta["graphckpt_stamped"] = {run.container: len(run.names) - run.traced for run in runs}
    return graph_module if same_outputs(model, graph_module, args, kwargs) else None


def stamp(graph_module: fx.GraphModule, run: BlockRun, model: nn.Module) -> None:
    """Copy the template of each block left out of the cut export, in order, each copy
    reading that block's parameters and the values of the copies before it; the nodes
    after the run then read the last copy. Raises :class:`NotStampable`."""
    graph = graph_module.graph
    blocks, attributes = _traced_blocks(graph, run)
    templates = range(run.traced - run.period, run.traced)
    # the block before the first template -> the template of its phase, node by node
    previous_of = dict(zip(blocks[templates[0] - 1], blocks[templates[-1]], strict=True))
    anchor, first_node = blocks[templates[-1]][-1].next, next(n for n in graph.nodes if n.op != "get_attr")
    latest = {node: node for t in templates for node in blocks[t]}  # template node -> its latest copy
    made: set[fx.Node] = set()
    for index in range(run.traced, len(run.names)):
        template = run.template_of(index)
        copies = _attach_block(graph_module, model, run, index, template, attributes[template], first_node)
        with graph.inserting_before(anchor):
            _copy_template(graph, blocks[template], copies, latest, previous_of, run.path(template), run.path(index))
        made.update(copies.values())
        latest.update((node, copies[node]) for node in blocks[template])
    inside = set(latest) | made
    for node in [n for t in templates for n in blocks[t]]:
        for user in list(node.users):
            if user not in inside:
                user.replace_input_with(node, latest[node])


def _copy_template(graph: fx.Graph, template: Sequence[fx.Node], copies: dict[fx.Node, fx.Node],
                   latest: dict[fx.Node, fx.Node], previous_of: dict[fx.Node, fx.Node], old: str, new: str) -> None:
    """One copy of a template block at the graph's insertion point, into ``copies``: an
    input the template took from a block before it comes from the latest copy of that
    block's template (``latest``), one from outside the run stays."""
    def source(node: fx.Node) -> fx.Node:
        return copies.get(node) or latest.get(previous_of.get(node, node), node)

    for node in template:
        copies[node] = graph.node_copy(node, source)
        copies[node].meta["nn_module_stack"] = _moved_stack(node.meta.get("nn_module_stack") or {}, old, new)


def _traced_blocks(graph: fx.Graph, run: BlockRun) -> tuple[list[list[fx.Node]], list[list[fx.Node]]]:
    """Per traced block, its computing nodes and its ``get_attr`` nodes, after checking that
    the last two periods traced lie side by side, block by block making the same calls, and
    that neither the templates nor the nodes after them read a block they cannot name."""
    nodes = list(graph.nodes)
    member = {node: _traced_index(node, run) for node in nodes}
    blocks = [[n for n in nodes if member[n] == i and n.op != "get_attr"] for i in range(run.traced)]
    attributes = [[n for n in nodes if member[n] == i and n.op == "get_attr"] for i in range(run.traced)]
    first = run.traced - 2 * run.period  # first block of the period before the templates
    position = {node: i for i, node in enumerate(nodes)}
    for block, template in zip(blocks[first:-run.period], blocks[-run.period:], strict=True):
        if not block or len(block) != len(template) or any(
                n.op != "call_function" or n.target != m.target for n, m in zip(template, block, strict=True)):
            raise NotStampable(f"{run.container}: blocks a period apart make different calls")
    span = position[blocks[-1][-1]] - position[blocks[first][0]] + 1
    if span != sum(len(block) for block in blocks[first:]):
        raise NotStampable(f"{run.container}: other nodes run between its blocks")
    earlier = {n for i in range(run.traced - run.period) for n in (*blocks[i], *attributes[i])}
    later = nodes[position[blocks[-1][-1]] + 1:]
    if any(arg in earlier for node in later for arg in node.all_input_nodes):
        raise NotStampable(f"{run.container}: a node after its blocks reads one but the last")
    readable = {*blocks[0], *blocks[run.traced - run.period - 1]}  # the first block, the one before the templates
    if any(arg in earlier and arg not in readable for t in blocks[-run.period:] for node in t
           for arg in node.all_input_nodes):
        raise NotStampable(f"{run.container}: a template block reads a block it cannot name")
    return blocks, attributes


def _traced_index(node: fx.Node, run: BlockRun) -> int | None:
    """Which traced block of ``run`` a node computes in (by its recorded module stack) or
    fetches a tensor of (a ``get_attr`` target); ``None`` outside them."""
    paths = [node.target] if node.op == "get_attr" else [p for p, _ in (node.meta.get("nn_module_stack") or {}).values()]
    for i in range(run.traced):
        block = run.path(i)
        if any(isinstance(p, str) and (p == block or p.startswith(block + ".")) for p in paths):
            return i
    return None


def _attach_block(graph_module: fx.GraphModule, model: nn.Module, run: BlockRun, index: int, template: int,
                  template_attributes: Sequence[fx.Node], before: fx.Node) -> dict[fx.Node, fx.Node]:
    """Register block ``index``'s tensors on the graph module where the template's are
    (the same tensor objects as the model's), and a ``get_attr`` node for each template
    one, placed with the others at the top; returns template node -> new node."""
    template_path, block_path = run.path(template), run.path(index)
    holder = graph_module.get_submodule(template_path)
    persistent = set(holder.state_dict(keep_vars=True))
    source = model.get_submodule(block_path)
    stamped = nn.Module()
    for name, _ in holder.named_parameters(remove_duplicate=False):
        _register(stamped, name, source.get_parameter(name), True)
    for name, _ in holder.named_buffers(remove_duplicate=False):
        _register(stamped, name, source.get_buffer(name), name in persistent)
    graph_module.get_submodule(run.container).add_module(run.names[index], stamped)
    copies = {}
    with graph_module.graph.inserting_before(before):
        for node in template_attributes:
            target = block_path + node.target[len(template_path):]
            copies[node] = graph_module.graph.get_attr(target)
            copies[node].meta = dict(node.meta)
    return copies


def _register(root: nn.Module, qualified: str, tensor: torch.Tensor, persistent: bool) -> None:
    """Put ``tensor`` at ``qualified`` inside ``root``, making empty modules on the way."""
    *parents, leaf = qualified.split(".")
    module = root
    for name in parents:
        if getattr(module, name, None) is None:
            module.add_module(name, nn.Module())
        module = getattr(module, name)
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


def _moved_stack(stack: dict[str, tuple[str, Any]], old: str, new: str) -> dict[str, tuple[str, Any]]:
    """A recorded module stack with the template block's paths renamed to block ``new``'s.

    >>> _moved_stack({"L__self__h.2.mlp": ("h.2.mlp", "MLP")}, "h.2", "h.7")
    {'L__self__h.7.mlp': ('h.7.mlp', 'MLP')}
    """
    moved = {}
    for key, (path, kind) in stack.items():
        if path == old or path.startswith(old + "."):
            renamed = new + path[len(old):]
            key = key[:-len(path)] + renamed if key.endswith(path) else key
            path = renamed
        moved[key] = (path, kind)
    return moved


def same_outputs(model: nn.Module, graph_module: fx.GraphModule, args: tuple, kwargs: dict) -> bool:
    """Whether ``graph_module`` returns what ``model`` does on the example inputs: both run
    without autograd from the same random state, and buffers they update (BatchNorm's
    running statistics) are put back after each run."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    devices = {t.device for t in (*tree_leaves((args, kwargs)), *model.parameters()) if isinstance(t, torch.Tensor)}
    cuda = sorted({torch.cuda.current_device() if d.index is None else d.index for d in devices if d.type == "cuda"})

    def run(module: nn.Module) -> Any:
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                return module(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)

    expected = run(model)
    try:
        torch.testing.assert_close(run(graph_module), expected, equal_nan=True)
    except Exception:  # a mismatch, or the stamped graph does not run
        return False
    return True
