"""Profile each distinct op once: repeated nodes share one fake-tensor measurement.

A stack of identical blocks repeats the same call (same op or module configuration, same
argument layouts, same aliasing) thousands of times; :mod:`graphckpt.profile` ran every
one on fake tensors, forward and backward, at about 6 ms a node. Here the first node of
each kind (its *representative*) is profiled as before, and a later node with the same key
(:meth:`~graphckpt.dedup_interpreter.DedupInterpreter.call_key`) becomes a *ghost*
(:mod:`graphckpt.ghosts`): a cheap autograd function that makes outputs of the
representative's layouts and, in backward, gradients for its inputs, and takes the
representative's figures (names of saved values remapped to its own inputs, its own
parameters). A call that makes no memory (a view, a reshape that can view, a check) is run
as it is by its copies instead, unmeasured: half the nodes of an exported model. Nothing
is guessed silently: after the backward, each ghost's incoming gradient layouts and the
gradient layouts it handed upstream are checked against what its representative got and
gave; a difference makes the run start again with the keys that differed profiled node by
node, and after :data:`RETRIES` runs (or at a node that cannot be keyed) the whole profile
runs without dedup, so figures are always those of the full run.

Keys are :mod:`graphckpt.op_keys`'s (how a value is used is part of one, so attention's
key projection, read through a transpose, is not a ghost of its query projection). Off with
``GRAPHCKPT_DEDUP=0`` or ``prepare(..., dedup=False)``; the same switch turns off the
pooled op timing of ``cost="time"`` (:func:`graphckpt.timing.node_nanoseconds`).

This module decides whether to deduplicate, retries and falls back; one run, node by node,
is :class:`graphckpt.dedup_interpreter.DedupInterpreter`.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import fx

from graphckpt.dedup_interpreter import DedupInterpreter, DedupMismatch
from graphckpt.lazy_fake import LazyFake, lazy_fake_copy
from graphckpt.node_cost import NodeCost
from graphckpt.profile import node_costs, positional_inputs

DEDUP_ENV = "GRAPHCKPT_DEDUP"
RETRIES = 3  # dedup runs before the full profile: the first, and two with more keys profiled node by node


def dedup_enabled(dedup: bool | None = None) -> bool:
    """``dedup`` if given, else on unless the environment sets ``GRAPHCKPT_DEDUP=0``."""
    return dedup if dedup is not None else os.environ.get(DEDUP_ENV, "1") != "0"


def deduplicated_costs(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None,
                       *, training: bool, lazy: LazyFake, backward: bool | None = None) -> dict[str, NodeCost]:
    """:func:`graphckpt.profile.node_costs` with each distinct call profiled once; raises
    :class:`DedupMismatch` when a ghost's gradients are not its representative's after
    :data:`RETRIES` runs, each profiling every node of the keys that differed before (the
    key and the query projections of attention are one Linear call, but the key's gradient
    comes back through a transpose). ``backward=False``: the forward alone, without autograd
    (:func:`forward_costs`); by default, in training mode only."""
    banned: frozenset[Hashable] = frozenset()
    for _ in range(RETRIES):
        try:
            return _deduplicated_run(graph_module, args, kwargs, training=training, lazy=lazy, banned=banned,
                                     backward=training if backward is None else backward)
        except DedupMismatch as mismatch:
            if not mismatch.representatives:
                raise
            banned |= mismatch.representatives
    raise DedupMismatch("gradients still differ")


def _deduplicated_run(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None,
                      *, training: bool, lazy: LazyFake, banned: frozenset[Hashable],
                      backward: bool) -> dict[str, NodeCost]:
    for module in lazy.module.modules():  # not .train(): an exported module's raises, its copy's too
        module.training = training
    real_inputs = positional_inputs(graph_module, args, kwargs or {})
    inputs = [lazy.mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in real_inputs]
    for fake_input, real in zip(inputs, real_inputs, strict=True):
        if isinstance(real, torch.Tensor) and real.requires_grad and backward:
            fake_input.requires_grad_(True)
    interpreter = DedupInterpreter(lazy, backward=backward, banned=banned)
    with torch.enable_grad() if backward else torch.no_grad():
        outputs = interpreter.run(*inputs)
        if backward:
            interpreter.add_forward_scratch()
            try:
                interpreter.backward_extra_bytes(outputs, [v for v in inputs if isinstance(v, torch.Tensor)])
            except DedupMismatch as mismatch:
                keys = frozenset(interpreter.keys[name] for name in mismatch.representatives)
                raise DedupMismatch(str(mismatch), keys) from None
    return interpreter.costs


def profile_costs(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None,
                  *, dedup: bool | None = None) -> dict[str, NodeCost]:
    """The node costs of ``graph_module`` in training mode: deduplicated
    (:func:`deduplicated_costs`) unless turned off, falling back to the full profile when
    dedup cannot vouch for its figures."""
    if dedup_enabled(dedup):
        try:
            return deduplicated_costs(graph_module, args, kwargs, training=True, lazy=lazy_fake_copy(graph_module))
        except DedupMismatch:
            pass
    return node_costs(graph_module, args, kwargs, training=True)


def forward_costs(graph_module: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None,
                  *, dedup: bool | None = None) -> dict[str, NodeCost]:
    """Node costs of one forward in training mode without autograd: which value is a view
    of which, shapes and dtypes, but not what backward saves or allocates. That is what
    :func:`graphckpt.inplace.isolate_inplace` asks of a graph that is not final yet, in
    about half the time of :func:`profile_costs` (a 10k-node stack of in-place residual
    blocks: 3.5 s against 7.3 s; in-place ops are never deduplicated), with or without dedup."""
    if not dedup_enabled(dedup):
        return node_costs(graph_module, args, kwargs, training=True, backward=False)
    return deduplicated_costs(graph_module, args, kwargs, training=True, lazy=lazy_fake_copy(graph_module),
                              backward=False)
