"""The cost graph: the one contract between the torch side (``graphckpt``) and the passes.

A cost graph is a :class:`networkx.DiGraph` over the values of one forward pass. Nodes are
value names (the fx node names, e.g. ``"linear_3"``); an edge ``u -> v`` means "computing
``v`` reads ``u``".

Graph attributes, all optional:

``name``
    For display.
``measured`` (default ``False``)
    ``True`` when the node attributes come from running example inputs; otherwise every op
    costs one unit, ``random`` is unknown (assume any op may draw) and every op is taken to
    save its outputs (a recompute runs its whole segment).
``cost_unit`` (default ``"FLOPs"``)
    What ``flops`` counts: ``"FLOPs"``, or ``"ns"`` when the graph was costed with measured
    op times.
``rng_state_bytes`` (default 0)
    Bytes of random-number-generator state a recompute boundary keeps from forward when its
    segment draws random numbers (:func:`passes.graph_facts.draws_random`): about 5 KiB on CPU, none in a GPU's
    memory (the CUDA generator state is a host tensor).
``checkpoint_call_cost`` (default 0)
    What one recomputed segment's checkpoint call costs beyond the ops it reruns (saving its
    inputs and RNG state, starting and stopping the recompute), in ``cost_unit``: measured
    once per process and device when the graph is costed in ``"ns"``, 0 for FLOPs.
``selective_op_cost`` (default 0)
    What each op of a selective segment costs beyond its own work, forward and recompute
    together (torch's selective-checkpoint policy sees every op), in ``cost_unit``.
``dropped_value_cost`` (default 0)
    What each value a segment run by saved-tensor hooks drops costs beyond the ops that make
    it again (:func:`passes.remat.runs_by_hooks`: the hooks, the recipe, one no-grad call),
    in ``cost_unit``; also the price of a selective segment run by hooks
    (:mod:`passes.hooked`), once for its call, once per remake group and once per value it drops.
``hooked_op_cost`` (default 0)
    What each op of a selective segment run by saved-tensor hooks (:mod:`passes.hooked`)
    costs a step beyond its own work, kept or dropped (the pack and unpack of what it
    saves, the report of its value), in ``cost_unit``: measured once per process and
    device on a probe of tiny ops when the graph is costed in ``"ns"``, 0 for FLOPs.
``hooks`` (default ``True``)
    Whether a selective segment may run by saved-tensor hooks (:mod:`passes.hooked`);
    ``False`` where the runtime has only torch's checkpoint, as :func:`graphckpt.enable`,
    which wraps a module's own forward, so the simulator models what torch's selective
    checkpointing holds instead.
``scalar_bytes`` (default 0)
    Bytes one float32 scalar takes in the model's memory (4 on CPU, a 512-byte block on a
    GPU): a step holds two from the loss until backward returns when the loss is computed
    outside the model (:func:`passes.sim_loss.loss_scalar_bytes`).
``autocast`` (default ``""``)
    The autocast state the graph was costed under, as ``"device:dtype"`` (``"cpu:bfloat16"``),
    ``""`` for none: what ops save and make was measured so, and a plan's peak holds for
    steps under that state (the rewritten module warns at a call under another).
``loss_widening`` (default 1)
    How many times the bytes of the outputs a loss computed outside the model works on: 2
    where they are 16-bit floats (under autocast, or a model cast to bf16/fp16), since such
    a loss is taken to run in float32 on a widened copy of them (``logits.float()``, as
    Hugging Face's losses and ``graphckpt.tools.zoo.scalar_loss`` do); 1 otherwise
    (:func:`passes.sim_loss.loss_working_bytes`).
``loss`` (default ``None``)
    The output value that is the model's own loss (a scalar the model computes, as Hugging
    Face models do when given labels), which training backpropagates alone. Without one,
    training is taken to backpropagate an elementwise loss of every output.

Node attributes (every node has all of them; :func:`check_cost_graph` verifies this):

``kind``: ``"input" | "param" | "op" | "output"``
    ``input``: a value the caller passes in (kept alive by the caller, so free to keep).
    ``param``: a parameter, buffer or constant read from the module; always available and
    never activation memory. ``op``: a computed value. ``output``: the single sink that
    gathers the forward's results (no storage of its own).
``order``: ``int``
    Position in the forward's execution order, ``0..n-1``, unique; a topological order.
``bytes``: ``int``
    Bytes of *new* storage the value allocates; ``0`` for views and other aliases.
``alias_of``: ``str | None``
    The value that owns the storage this value shares (its root, never itself an alias),
    or ``None`` when the value owns its storage.
``flops``: ``int``
    What computing the value again costs: floating point operations (0 when free or
    unknown), or nanoseconds when ``graph.graph["cost_unit"] == "ns"``.
``recomputable``: ``bool``
    ``False`` when running the node again would change results or state we do not replay
    exactly (e.g. an in-place write to a buffer that something reads; a torch module that
    updates buffers of its own, called whole; an op that writes one of its arguments after
    saving it, as RReLU's noise), or would run a module's hooks twice in a step (a module
    with hooks, called whole). Such nodes never sit in a recomputed segment. Updates of
    ``state`` values stay recomputable.
``cuttable``: ``bool``
    ``False`` when the value may not be kept at a segment boundary: its storage is written
    in place later in the forward, so a recompute starting from it would read the wrong data.
``saved``: ``tuple[str, ...]``
    Values whose storage the node's backward needs (its own name if it saves its output).
``saves_from``: ``"nothing" | "inputs" | "outputs"``
    When the node's backward has everything it saves: it saves ``"nothing"``; only
    ``"inputs"`` that exist before it runs (values it reads, parameters); or also
    ``"outputs"`` it computes (its own value, a mask, statistics). A recompute stops once it
    has what backward saved, so ops after the last one that saves anything never run again,
    nor that one when it saves only its inputs (:func:`passes.recompute.recompute_steps`).
    :func:`add_value` derives it from ``saved`` and ``saved_extra_bytes`` when not given.
``saved_extra_bytes``: ``int``
    Bytes the node saves for backward that belong to no value of the graph (dropout masks,
    BatchNorm statistics, ...).
``random``: ``bool``
    Whether computing the value draws from the random number generator (dropout). Such
    nodes keep their relative execution order in every plan, so random streams match eager.
``redrawable``: ``bool``
    A training-mode dropout (``random``) whose ``saved_extra_bytes`` are its noise, which
    a segment run by saved-tensor hooks drops after forward and draws again from the
    generator state the op drew from (:func:`passes.hooked.redrawn`). ``False`` for every
    other node.
``ordered``: ``bool``
    The node keeps its execution order relative to every other ordered or random node: an
    in-place write that stays in the graph and the earlier readers of the storage it writes
    (reordering them would let a reader see the written data), and every update of a
    ``state`` buffer updated at several places (one norm layer called three times: its
    momentum updates do not commute).
``state``: ``bool``
    The value is (a view of) a buffer or input that forward only updates in place and never
    reads for its value: running statistics of a training-mode norm, a batch counter bumped
    by an ``add_`` nothing reads. Ops updating it are recomputable: a recompute gets scratch
    copies of the state values its segment reads, so the model's state moves once per step.
    ``False`` for every other value (norm layers called as one node update their own
    buffers, which are not values of the graph). The √n strategies do not count updates of
    state as layers (:func:`passes.cuts.sqrt_segment_count`).
``expensive``: ``bool``
    The value comes out of a matmul or convolution: costly to recompute, so a selective
    plan keeps it from forward even inside a recomputed segment.
``kernels_written``: ``bool``
    The model's code writes in place into the output of one of the node's matmul or
    convolution kernels: an op inside the node (a GRU's ``sigmoid_`` on its gates; then
    the node is never ``expensive``), or a later op on the node's value (a
    ``LeakyReLU(inplace=True)`` on a Linear's output, which the rewritten graph runs out of
    place but the model's own forward does not). Selective checkpointing keeps kernel
    outputs by reference, so a recompute would be handed the written value (torch's own
    selective checkpoint gives such a GRU other gradients, and refuses the Linear's in
    backward). A block holding one is never recomputed selectively (``graphckpt.enable``).
``selective_extra_bytes``: ``int``
    Bytes a selective segment keeps for an ``expensive`` node beyond its own value: the
    outputs of matmul/convolution kernels *inside* the node that are not its result (the
    score matrix of an attention computed by the math kernel: torch's selective policy
    keeps every matmul output it sees). Held from forward until the node is recomputed.
    Where the result is no such output (attention under bf16 autocast returns a bf16 cast
    of its float32 product), the policy keeps the product and a recompute makes the result
    again from it: the bytes are the inner outputs less the result's, which the kept value
    stands for.
``param_grad_bytes``: ``int``
    On an op: bytes of parameter gradients the node's backward creates; they live until
    autograd adds them into the parameters' existing ``.grad``. On a ``param``: the bytes
    of its gradient (0 when it is not trained). A parameter read by several ops (tied
    embeddings) has one accumulator, which holds the first gradient until the last reader's
    backward has run (:func:`passes.kept_bytes.shared_parameters`).
``param_grad_cast_bytes``: ``int`` (default 0)
    Of ``param_grad_bytes``, the gradients of parameters the op reads through autocast's
    16-bit casts (a bf16 Linear's float32 weight and bias): its backward function makes each
    at the cast's width (``param_grad_narrow_bytes`` in all) and, once it has returned and let
    its saved values go, autograd casts it up, the 16-bit one alive for that moment (a shared
    weight's gradient is held at full width from the function on, as its sum needs it; its
    ``backward_extra_bytes`` are counted on the 16-bit one). A bf16 MLP whose weight
    gradients were its peak simulated 8% over its measured peak without it.
``param_grad_narrow_bytes``: ``int`` (default 0)
    The 16-bit gradients of ``param_grad_cast_bytes``, as the backward function makes them.
``param_grads``: ``tuple[tuple[str, int], ...]`` (default ``()``)
    The trained parameters inside an op that is a whole module (fx ``call_module``), as
    ``(name, gradient bytes)`` under the model's (first) name for each; on a ``param``: the
    model's name for it, when known. A parameter named by several ops (a module called twice
    or tied) keeps one summed gradient like a ``param`` several ops read (:func:`passes.kept_bytes.shared_parameters`).
``backward_extra_bytes``: ``int``
    Bytes the node's backward allocates for a moment beyond the gradients it returns
    (kernel scratch, :mod:`graphckpt.scratch`: oneDNN's ``convolution_backward`` on CPU
    reorders its tensors to blocked layouts). It lives while all of the node's gradients
    exist, those added into existing buffers included, and is freed before the next node's
    backward. ``0`` for nodes whose backward only allocates its gradients.
``released_early``: ``tuple[str, ...]`` (default ``()``)
    Values of ``saved`` the node's backward is done with before its peak: a node whose
    backward is several autograd functions (``cross_entropy_loss``: ``NllLossBackward``, then
    ``LogSoftmaxBackward``) lets the first one's saves go before the next makes its
    gradient. The simulator drops these holds before ``backward_extra_bytes``; a value is
    freed only when nothing else holds it. Only values let go before the call whose kernel
    scratch ``backward_extra_bytes`` counts (a convolution's input, under autocast, is read
    by ``ConvolutionBackward`` while its scratch lives, and let go before the weight cast's
    backward).
``backward_allocates``: ``bool`` (default ``False``)
    Whether the node's backward makes any new storage, as the profile's fake backward saw it:
    float32's ``add`` passes its gradient through and makes none; under autocast an ``add``
    of a float32 and a bf16 value casts the bf16 one's gradient. An op ending a recomputed
    segment that saves nothing runs its backward before the recompute (torch recomputes at
    the first unpack), and what it makes lives through it: the simulator runs such trailing
    ops' backward first when one of them allocates (:func:`passes.recompute.trailing_backward`).
``unpack_held_bytes``: ``int`` (default 0)
    What the node's backward holds beyond its gradient when it first unpacks a saved value:
    the results of its first autograd functions, those that save nothing (math attention
    under bf16 casts its gradient up to float32 and reshapes it before the matmul it unpacks
    for), less its gradient when they let it go. torch's checkpoint recomputes at that
    unpack, so a recompute the node's backward starts runs while they live
    (:func:`passes.recompute.recompute_trigger`).
``forward_extra_bytes``: ``int`` (default 0)
    Bytes the node's forward allocates beyond its value and what it saves, alive at its
    peak and freed before it returns: the temporaries of an op that runs as a chain of
    kernels (attention by the math kernel scales the query and builds a float mask). Held
    for the moment the node runs, in forward and in a recompute, on top of what it made.
``cached_rerun_extra_bytes``: ``int | None`` (default ``None``)
    The node's ``forward_extra_bytes`` when a selective segment's recompute reruns it with
    its matmul/convolution outputs served from the cache (a node the segment keeps,
    ``saved_inside``): only its other calls run, so only their temporaries are held, not
    the cached kernels' own scratch (a bf16 Linear's GEMM on CPU: LLaMA's bf16 plan at 0.5
    of eager simulated 5% over its measured peak). ``None``: ``forward_extra_bytes``.
``selective_forward_extra_bytes``: ``int | None`` (default ``None``)
    The node's ``forward_extra_bytes`` when it runs under selective checkpointing's dispatch
    mode: in a selective segment's forward and its recompute. Composite ops may branch on a
    mode being active; CPU's math attention adds a float mask to its scores in place in
    plain code and out of place under a mode, which costs a second score matrix (and, for a
    16-bit mask, a float32 copy of it). ``None``: ``forward_extra_bytes``.
``autocast_cache_bytes``: ``int`` (default 0)
    Bytes of parameter casts the node makes under autocast that autocast's cache keeps to
    the end of forward though its backward saves none of them: a bias's 16-bit copy, or a
    weight's when the layer's input needs no gradient (the first Linear of a model: a
    256-wide one measured 12% over its simulated peak under bf16). Held from the node to
    the end of forward in code that caches casts (eager, kept and hooked segments), not
    in a checkpoint call, which runs with the cache off.
``state_copy_bytes``: ``int`` (default 0)
    Bytes of the scratch copies of running statistics a recompute of the op updates instead
    of the model's (a recompute must not count a batch twice) and its backward holds: a
    training-mode batch norm saves its running mean and variance, so the copies a recompute
    made live until the op's backward. Made as the recompute starts (simulated for the ops a
    checkpoint recompute runs). A state value several ops of one segment save is counted for
    each of them, on the safe side. MobileNetV2's bf16 plan at 0.5 of eager measured 0.4% over
    its simulated peak without them.
``grad_views``: ``bool``
    The gradients the node's backward hands its inputs are views of its own output's
    gradient: slices of it (``cat``, ``stack``) or the very buffer (an ``add`` of two values
    of one shape passes its gradient through, as do a ``reshape``, a ``transpose`` and a
    ``dropout`` that returns its input). No new buffers, but the whole output gradient stays
    alive until the last of them is used. A gradient added into such a buffer makes a new
    one, as autograd's out-of-place sum does, while another value still holds it, when the
    gradient added is a view of it, or when it is a slice of a larger one
    (:func:`passes.sim_ops._added_into_buffers`).
``grad_bytes``: ``int | None`` (default ``None``)
    Bytes of the gradient buffer the value gets in backward, where that is not the size of
    its storage root: a view's gradient has the view's own size (a slice of a fused QKV
    projection's output gets a third of it, an ``expand`` more than its storage). ``None``:
    the storage root's ``bytes`` (:func:`passes.kept_bytes.gradient_bytes`).
``requires_grad``: ``bool``
    Whether the value takes part in backward (its gradient is computed).
``block``: ``str`` (default ``""``)
    The repeated module the op runs in (a layer of a ``ModuleList``/``Sequential``, such as
    ``"transformer.h.3"``), as ``model.named_modules()`` names it; ``""`` outside every
    block. Per-block checkpointing (:mod:`passes.blocks`) recomputes each block whole, as
    ``gradient_checkpointing_enable()`` does.
``label``: ``str``
    What to show a person (``"linear"``, ``"layers.0"``, ``"relu_"``).

Optional display attributes: ``shape`` and ``dtype`` (strings).

A cost graph does not change once planning starts: the passes read its attributes into
flat maps and sets once per graph (:func:`passes.graph_facts.per_graph_value`,
:func:`passes.graph_facts.node_attribute`). To try
other costs, change a ``graph.copy()``.

Without example inputs the torch side costs every op 1 byte and 1 flop (``measured`` false:
:func:`graphckpt.costs.prepare`), so the strategies of the papers still work on node counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import networkx as nx

KINDS = ("input", "param", "op", "output")
SAVES_FROM = ("nothing", "inputs", "outputs")
REQUIRED = object()  # an attribute :func:`add_value` takes as an argument, or derives (``saves_from``)
ATTRIBUTES: Mapping[str, tuple[type | tuple[type, ...], Any]] = {  # name -> (type, default)
    "kind": (str, REQUIRED),
    "order": (int, REQUIRED),
    "bytes": (int, REQUIRED),
    "alias_of": ((str, type(None)), None),
    "flops": (int, 0),
    "recomputable": (bool, True),
    "cuttable": (bool, True),
    "saved": (tuple, ()),
    "saves_from": (str, REQUIRED),
    "saved_extra_bytes": (int, 0),
    "requires_grad": (bool, True),
    "random": (bool, False),
    "redrawable": (bool, False),
    "ordered": (bool, False),
    "state": (bool, False),
    "grad_views": (bool, False),
    "grad_bytes": ((int, type(None)), None),
    "expensive": (bool, False),
    "kernels_written": (bool, False),
    "block": (str, ""),
    "selective_extra_bytes": (int, 0),
    "param_grad_bytes": (int, 0),
    "param_grad_cast_bytes": (int, 0),
    "param_grad_narrow_bytes": (int, 0),
    "param_grads": (tuple, ()),
    "backward_extra_bytes": (int, 0),
    "released_early": (tuple, ()),
    "backward_allocates": (bool, False),
    "unpack_held_bytes": (int, 0),
    "forward_extra_bytes": (int, 0),
    "cached_rerun_extra_bytes": ((int, type(None)), None),
    "selective_forward_extra_bytes": ((int, type(None)), None),
    "autocast_cache_bytes": (int, 0),
    "state_copy_bytes": (int, 0),
    "label": (str, REQUIRED),
}
DEFAULTS: Mapping[str, Any] = {name: default for name, (_, default) in ATTRIBUTES.items() if default is not REQUIRED}


class CostGraphError(ValueError):
    """A cost graph breaks the node-attribute contract of this module."""


def add_value(graph: nx.DiGraph, name: str, *, kind: str, order: int, bytes: int,
              reads: Iterable[str] = (), label: str | None = None, **attributes: Any) -> None:
    """Add one value with the contract's attributes (defaults filled in) and its input edges."""
    attributes = {**DEFAULTS, **attributes}
    made_here = [*(value == name for value in attributes["saved"]), *([True] if attributes["saved_extra_bytes"] else [])]
    attributes.setdefault("saves_from", saves_from(made_here))
    graph.add_node(name, kind=kind, order=order, bytes=bytes, label=label or name, **attributes)
    graph.add_edges_from((source, name) for source in reads)


def saves_from(made_here: Iterable[bool]) -> str:
    """``saves_from`` of a node, from one flag per tensor it saves for backward: whether the
    node made that tensor (its own value, a mask) rather than received it. :func:`add_value`
    knows only names (a saved value named like the node, or ``saved_extra_bytes``, is made
    here; parameters it saves are not known, so an op saving only parameters reads
    ``"nothing"``); the profiler sees every saved tensor's storage."""
    flags = list(made_here)
    if any(flags):
        return "outputs"
    return "inputs" if flags else "nothing"


def check_cost_graph(graph: nx.DiGraph) -> None:
    """Raise :class:`CostGraphError` naming the first node that breaks the contract."""
    orders = set()
    for name, attributes in graph.nodes(data=True):
        for key, (expected, _) in ATTRIBUTES.items():
            if not isinstance(attributes.get(key), expected):
                raise CostGraphError(f"node {name!r}: attribute {key!r} missing or not {expected}")
        if not set(attributes["released_early"]) <= set(attributes["saved"]):
            raise CostGraphError(f"node {name!r}: released_early {attributes['released_early']} not all in saved")
        if attributes["saves_from"] not in SAVES_FROM:
            raise CostGraphError(f"node {name!r}: saves_from {attributes['saves_from']!r} not in {SAVES_FROM}")
        if attributes["kind"] not in KINDS:
            raise CostGraphError(f"node {name!r}: kind {attributes['kind']!r} not in {KINDS}")
        if attributes["order"] in orders:
            raise CostGraphError(f"node {name!r}: order {attributes['order']} is not unique")
        orders.add(attributes["order"])
    for source, target in graph.edges:
        if graph.nodes[source]["order"] >= graph.nodes[target]["order"]:
            raise CostGraphError(f"edge {source!r} -> {target!r} goes backwards in 'order'")

