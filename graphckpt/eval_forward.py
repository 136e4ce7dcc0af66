"""``eval()`` on a rewritten module runs the model's own forward.

A capture is a trace of one training step: Python that reads ``self.training`` (a custom
``F.dropout(x, p, training=self.training)``, timm's ``DropPath``, an ``if self.training:``)
is frozen in its training branch, and torch.export also fixes the example's shapes. In eval
mode nothing is recomputed, so the rewritten module has nothing to add there: it runs the
model itself, which evaluates as the model does, at any shape. The model's modules are the
rewritten module's, so ``rewritten.eval()`` has already switched them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

EVAL_FORWARD = "graphckpt_eval_forward"
"""The attribute of a rewritten module holding its :class:`ModelForward`."""


class ModelForward:
    """The model's forward as a rewritten module runs it in eval mode: the model's root in
    eval mode for the call (its children are the rewritten module's, already switched).
    ``hooks_ran``: the rewritten module's own call has run the model's hooks (they are
    shared, :mod:`graphckpt.module_hooks`), so only ``forward`` is called; otherwise the
    model is called, hooks and all. Not a module, so it adds no ``state_dict`` keys."""

    def __init__(self, model: nn.Module, *, hooks_ran: bool) -> None:
        self.model = model
        self.hooks_ran = hooks_ran

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training, self.model.training = self.model.training, False
        try:
            return (self.model.forward if self.hooks_ran else self.model)(*args, **kwargs)
        finally:
            self.model.training = training


def dispatching_forward(graph_forward: Callable[..., Any]) -> Callable[..., Any]:
    """``graph_forward`` (a generated ``forward``), except in eval mode where the module
    holds a :class:`ModelForward`: that runs instead."""

    @functools.wraps(graph_forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        model_forward = self.__dict__.get(EVAL_FORWARD)
        if model_forward is not None and not self.training:
            return model_forward(*args, **kwargs)
        return graph_forward(self, *args, **kwargs)

    return forward
