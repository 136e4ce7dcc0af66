"""Which nodes' backward hands its inputs the gradient it received, making none: an ``add``
of two values of one shape, a ``reshape``, a ``transpose``, a ``clone``. Their inputs'
gradients are the node's own gradient buffer (the cost graph's ``grad_views``), where the
simulator once gave each input a buffer of its own: on GPT-NeoX's parallel residual
(``attention + mlp + hidden``) that was two gradients too many at the peak, 6% over the
measured peak of its plan.

Found in the profile's fake backward, from what each autograd function of a node returns:
every gradient it hands on lies in the storage of one it received.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch

from graphckpt.torch_compat import storage_key


class PassThroughWatch:
    """Watches the autograd functions of each node during one backward (:meth:`watch`),
    then tells whether all of a node's ran and passed their gradients through
    (:meth:`passes_through`)."""

    def __init__(self) -> None:
        self.functions: dict[str, int] = {}  # node -> autograd functions watched
        self.passed: dict[str, int] = {}  # node -> functions that ran and passed their gradient through
        self.made: set[str] = set()  # nodes with a function that handed on a gradient of its own making

    def watch(self, name: str, functions: Iterable[Any]) -> None:
        """Hook ``functions``, the autograd functions node ``name`` made in forward."""
        functions = list(functions)
        if not functions:
            return
        self.functions[name] = self.functions.get(name, 0) + len(functions)
        for function in functions:
            function.register_hook(partial(self._returned, name))

    def _returned(self, name: str, grad_inputs: tuple, grad_outputs: tuple) -> None:
        received = {storage_key(g): g.numel() for g in grad_outputs if isinstance(g, torch.Tensor)}
        if all(received.get(storage_key(g)) == g.numel() for g in grad_inputs if isinstance(g, torch.Tensor)):
            self.passed[name] = self.passed.get(name, 0) + 1
        else:
            self.made.add(name)

    def passing(self) -> list[str]:
        """The watched nodes whose backward passed its gradient through (:meth:`passes_through`)."""
        return [name for name in self.functions if self.passes_through(name)]

    def passes_through(self, name: str) -> bool:
        """Whether every autograd function of ``name`` ran and handed on only gradients it
        received (or none), as many elements each: the node's backward makes no gradient
        buffer of its own. ``sum``'s backward hands on an ``expand`` of the gradient it got,
        which a later gradient added into it replaces with a buffer of the full size: not
        passed through."""
        return name not in self.made and self.passed.get(name, 0) == self.functions.get(name, -1)


def returns_an_input(result: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``result`` is one of the tensors passed as ``args`` or ``kwargs``: a
    ``dropout`` with ``p=0``, or one in eval mode, returns its input, and its gradient is
    that input's. An element taken out of a tuple (``getitem`` of ``split``'s outputs) is
    not: its gradient goes to the function that made the tuple."""
    given = {id(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
    return isinstance(result, torch.Tensor) and id(result) in given
