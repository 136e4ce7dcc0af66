"""What the loss holds in a training step, as the simulator counts it.

A model that computes its own loss is trained on it alone; otherwise, between forward and
backward, an elementwise loss and its reduction hold ``LOSS_WORKING_SET`` times the outputs'
bytes for a moment (``x.pow(2).mean()``'s backward makes four output-sized temporaries:
three here plus the output's gradient), at float32's width for 16-bit outputs, with their
float32 copy (``loss_widening``). From the loss until backward returns, the scalars it
leaves are held too (:func:`loss_scalar_bytes`): the caller's loss and the gradient backward
starts from. :mod:`passes.simulate`, the chain dynamic program and the exact solver's
training graph all count it so.
"""

from __future__ import annotations

import networkx as nx

from passes.graph_facts import graph_outputs, needs_grad
from passes.kept_bytes import gradient_bytes

LOSS_WORKING_SET = 3



def trained_outputs(graph: nx.DiGraph) -> list[str]:
    """The outputs backward starts from: the model's own loss when it returns one
    (``graph.graph["loss"]``), else every output that takes part in backward."""
    loss = graph.graph.get("loss")
    return [loss] if loss is not None else [v for v in graph_outputs(graph) if needs_grad(graph, v)]


def loss_working_bytes(graph: nx.DiGraph) -> int:
    """What computing the loss holds for a moment between forward and backward: nothing
    when the model computed its own loss, else ``LOSS_WORKING_SET`` times the outputs, and
    where the loss runs on a wider copy of them (``graph.graph["loss_widening"]``, 16-bit
    outputs under autocast) that copy too, everything at its width, and the copy's gradient
    cast back to the outputs' width (measured with ``x.float().pow(2).mean()`` on bf16
    outputs: the zoo MLP and GPT under CPU autocast, within 0.5% of their measured peaks)."""
    if graph.graph.get("loss") is not None:
        return 0
    outputs = sum(gradient_bytes(graph, v) for v in trained_outputs(graph))
    widening = graph.graph.get("loss_widening", 1)
    if widening == 1:
        return LOSS_WORKING_SET * outputs
    return (LOSS_WORKING_SET + 1) * widening * outputs + outputs  # the copy, and its gradient cast back


def loss_scalar_bytes(graph: nx.DiGraph) -> int:
    """Bytes of the scalars a step holds from the loss until backward returns, when the loss
    is computed outside the model: the caller's loss and the gradient backward starts from
    (``torch.autograd.backward`` keeps its seed until it returns), ``graph.graph["scalar_bytes"]``
    each (a 512-byte block on a GPU). A model's own loss is an output already, and its
    gradient is the seed, held likewise (:func:`passes.simulate.step_peak`)."""
    if graph.graph.get("loss") is not None or not trained_outputs(graph):
        return 0
    return 2 * graph.graph.get("scalar_bytes", 0)
