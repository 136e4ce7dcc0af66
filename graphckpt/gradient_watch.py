"""What vouches for a deduplicated profile: the gradient layouts each node gets and gives in
the fake backward (:class:`GradientWatch`).

A ghost (:mod:`graphckpt.ghosts`) takes its representative's figures, which hold only if
autograd treats the two alike: each output receives a gradient of the same layout, and each
input slot is handed gradients of the same layouts. The watch records both during the one
fake backward, and :meth:`GradientWatch.differing` names the representatives whose ghosts
did otherwise. Split from :mod:`graphckpt.op_dedup`, which runs the calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from graphckpt.ghosts import first_slots
from graphckpt.op_keys import tensor_layout
from graphckpt.torch_compat import is_accumulate_grad


class GradientWatch:
    """Gradient layouts per node, recorded by hooks during one fake backward."""

    def __init__(self) -> None:
        self.incoming: dict[str, dict[int, tuple]] = {}  # node -> output index -> layout of its gradient
        self.contributions: dict[str, dict[int, Counter]] = {}  # representative -> slot -> gradient layouts given
        self.emitted: dict[str, dict[int, Counter]] = {}  # ghost -> slot -> gradient layouts given
        self.unknown: set[str] = set()  # representatives that gave a gradient to no input slot

    def emitted_by(self, ghost: str) -> dict[int, Counter]:
        """Where a ghost's backward notes the gradient layouts it gives each input slot."""
        return self.emitted.setdefault(ghost, {})

    def watch(self, name: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
              claimed: Sequence[Any] = ()) -> None:
        """Record the gradient layouts each output of ``name`` receives; for a representative,
        whose backward is the autograd functions it ``claimed``, also those that backward
        hands to each input slot."""
        for index, tensor in enumerate(outputs):
            if tensor.requires_grad:
                tensor.register_hook(partial(self._arrived, name, index))
        if not claimed:
            return
        first = first_slots(list(inputs))
        slot_of = {(id(t.grad_fn), t.output_nr): first[i] for i, t in enumerate(inputs) if t.grad_fn is not None}
        # The hook holds ids and the next functions, never its own function: that would be a
        # cycle, and the collector frees such a chain one function per collection.
        own = frozenset(map(id, claimed))
        for function in claimed:
            function.register_hook(partial(self._contributed, name, function.next_functions, own, slot_of))

    def differing(self, ghosts: Mapping[str, str]) -> frozenset[str]:
        """The representatives (``ghosts``: ghost -> representative) one of whose ghosts got
        or gave other gradient layouts than it, or that gave a gradient to no input slot."""
        return frozenset(representative for ghost, representative in ghosts.items()
                         if representative in self.unknown
                         or self.incoming.get(ghost) != self.incoming.get(representative)
                         or self.emitted.get(ghost, {}) != self.contributions.get(representative, {}))

    def _arrived(self, name: str, index: int, grad: torch.Tensor | None) -> None:
        # None: an output backward gives no gradient (an LSTM's final states, when only its outputs are used)
        self.incoming.setdefault(name, {})[index] = None if grad is None else tensor_layout(grad)

    def _contributed(self, name: str, next_functions: tuple, claimed: frozenset[int], slot_of: dict, grad_inputs: Any,
                     grad_outputs: Any) -> None:
        for (next_function, number), grad in zip(next_functions, grad_inputs, strict=False):
            if grad is None or next_function is None or id(next_function) in claimed or is_accumulate_grad(next_function):
                continue
            slot = slot_of.get((id(next_function), number))
            if slot is None:
                self.unknown.add(name)
                continue
            self.contributions.setdefault(name, {}).setdefault(slot, Counter())[tensor_layout(grad)] += 1
