"""The backward half of the exact solver's training graph (:mod:`passes.training_graph`):
each op's backward as autograd's engine runs it, node by node, mirroring
:func:`passes.sim_ops.run_backward` phase for phase (the function making what it returns;
then, its saved values let go, the sums into existing buffers).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import networkx as nx

from passes.graph_facts import needs_grad, storage_root
from passes.kept_bytes import cast_up, gradient_bytes, shared_by_reader, shared_parameters

BACKWARD_PREFIX = "backward:"  # a backward node's name: this, then the op it is the backward of


def backward_stage(op: str) -> str:
    """The name of ``op``'s first backward node: the stage where a step hooked on its
    ``grad_fn`` runs (its other nodes, one per further gradient buffer, add ``:<value>``)."""
    return BACKWARD_PREFIX + op


def add_backward(graph: nx.DiGraph, add: Callable[..., int], nodes: dict[str, list], index: dict[str, int],
                  extra: dict[str, int], owner: dict[str, int]) -> None:
    """Add, ops in reverse, each op's backward as autograd's engine runs it: its function
    (one node per gradient buffer it makes, new or a shared weight's first, all it returns
    and its scratch for a moment on the last), then, once it has returned and let its saved
    values go, what it adds into existing buffers (a node per sum made out of place, and
    everything it returned for a moment; then its parameters' gradients cast up from the
    16-bit ones it made, where it read them through autocast's casts). ``owner`` maps each
    value to the node of its gradient buffer (the seeds' at first)."""
    holders = Counter(owner.values())  # gradient buffer node -> values whose gradient it still is
    shared = shared_by_reader(graph)
    accumulators: dict[str, int] = {}  # shared parameter -> the node of its summed gradient
    pending = {param: len(readers) for param, _, readers in shared_parameters(graph)}
    for k in reversed(list(index)):
        gets_grad = k in owner and needs_grad(graph, k)
        inputs = [u for u in graph.predecessors(k) if gets_grad and needs_grad(graph, u)]
        reads = [owner[k]] if gets_grad else []
        reads += [owner[u] for u in inputs if u in owner] + ([extra[k]] if k in extra else [])
        reads += [index[r] for r in {storage_root(graph, v) for v in graph.nodes[k]["saved"]} if r in index]
        views, own_buffer = graph.nodes[k]["grad_views"], owner.get(k)
        if gets_grad:
            holders[own_buffer] -= 1  # k's backward is done with its own gradient
        added = [u for u in inputs if u in owner]
        made_to_add = 0 if views else sum(gradient_bytes(graph, u) for u in added)
        params = shared.get(k, []) if gets_grad else []
        firsts = [(param, nbytes) for param, nbytes in params if param not in accumulators]
        later = [(param, nbytes) for param, nbytes in params if param in accumulators]
        own = max(0, graph.nodes[k]["param_grad_bytes"] - sum(nbytes for _, nbytes in firsts))
        cast = cast_up(graph.nodes[k]["param_grad_cast_bytes"], graph.nodes[k]["param_grad_narrow_bytes"], bool(params))
        own_made = own - cast.narrowed_by  # what the function makes of them: 16-bit where read through casts
        # The function: new buffers, the first gradients of shared weights, all it returns with its scratch.
        buffers = [(u, None, gradient_bytes(graph, u)) for u in inputs if u not in owner and not views]
        buffers += [(None, param, nbytes) for param, nbytes in firsts]
        transient = own_made + max(0, graph.nodes[k]["backward_extra_bytes"] + made_to_add - cast.scratch_less) \
            if gets_grad else 0
        for position, (u, param, nbytes) in enumerate(buffers or [(None, None, 0)]):
            node = add(backward_stage(k) + (f":{u or param}" if position else ""), nbytes, reads,
                       about=u or k, transient=transient if position == max(len(buffers) - 1, 0) else 0)
            if param is not None:
                accumulators[param] = node
            elif u is not None:
                owner[u] = node
                holders[node] += 1
        if views and gets_grad:  # views of k's gradient: its buffer lives on as theirs
            viewing = [u for u in inputs if u not in added]
            owner.update((u, own_buffer) for u in viewing)
            holders[own_buffer] += len(viewing)
        # Once it returned and let its saved values go: the gradients added into buffers.
        summed = _summed_out_of_place(graph, added, owner, holders, nodes["mem"], own_buffer if views else None)
        sums = [(u, gradient_bytes(graph, u), [owner[u]]) for u in summed]
        sums += [(None, 0, [accumulators[param] for param, _ in later])] if later else []
        for position, (u, nbytes, preds) in enumerate(sums):
            node = add(f"added:{k}" + (f":{u}" if u else ""), nbytes, preds, about=u or k,
                       transient=own_made + made_to_add + sum(n for _, n in later) if position == len(sums) - 1 else 0)
            if u is not None:
                owner[u] = node
                holders[node] += 1
        if cast.moment and gets_grad:  # then its parameters' gradients cast up, each with its 16-bit one
            add(f"cast-up:{k}", 0, (), about=k, transient=own_made + cast.moment)
        for param, _ in params:
            pending[param] -= 1
    for param, node in accumulators.items():  # a reader whose backward never runs: held to the end
        nodes["kept"][node] = nodes["kept"][node] or pending[param] > 0
    for value, node in owner.items():  # the inputs' gradients, returned to the caller
        nodes["kept"][node] = nodes["kept"][node] or graph.nodes[value]["kind"] == "input"


def _summed_out_of_place(graph: nx.DiGraph, added: list[str], owner: dict[str, int], holders: Counter,
                         mem: list[int], view_of: int | None) -> list[str]:
    """The inputs whose gradient, added into its buffer, makes a new one: the buffer is still
    another value's gradient too, the gradient added is a view of it (``view_of``, for an op
    handing on views of its own), or it is a slice of a larger buffer (``cat``'s): autograd
    sums in place only into a dense tensor it holds the only reference to. Taken in order,
    each letting go of its share, as :func:`passes.sim_ops._added_into_buffers` adds them."""
    summed = []
    for u in added:
        if holders[owner[u]] > 1 or owner[u] == view_of or mem[owner[u]] > gradient_bytes(graph, u):
            summed.append(u)
            holders[owner[u]] -= 1
    return summed
