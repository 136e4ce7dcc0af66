"""Checkpointing's internals in torch: what a selective-checkpoint context keeps, the error it
raises when it has nothing kept, and torch.compile's activation budget (the benchmarks' anchor).
Part of :mod:`graphckpt.torch_compat`, which re-exports every name here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def clear_selective_cache(context: Any) -> None:
    """Drop what a selective-checkpoint recompute context kept (the ``cached`` half returned
    by ``torch.utils.checkpoint.create_selective_checkpoint_contexts``); nothing if the
    context keeps nothing.

    Its ``storage`` dict (``_CachedTorchDispatchMode.storage``). Checked on 2.5, 2.6, 2.13.
    """
    getattr(context, "storage", {}).clear()


def selective_cache_missed(error: object) -> bool:
    """Whether ``error`` is torch's selective checkpointing finding, in a recompute, no kept
    output for an op its policy keeps (``_CachedTorchDispatchMode``: "... encountered during
    backward but not found in storage"), as after the one backward it keeps them for.
    Checked on 2.5, 2.13."""
    return isinstance(error, RuntimeError) and "not found in storage" in str(error)


@contextlib.contextmanager
def activation_memory_budget(budget: float) -> Iterator[None]:
    """``torch.compile``'s min-cut partitioner keeps activations within ``budget`` (a
    fraction of what it would save by default) for graphs compiled inside the block.

    ``torch._functorch.config.activation_memory_budget``. Checked on 2.5, 2.6, 2.13.
    """
    from torch._functorch import config

    with config.patch(activation_memory_budget=budget):
        yield
