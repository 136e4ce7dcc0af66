"""The corpus registry: :class:`Entry` and ``ENTRIES``, the Hugging Face and plain torch models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Example = tuple[nn.Module, tuple, dict[str, Any]]
"""A model in training mode, its positional example inputs and its keyword example inputs."""


@dataclass(frozen=True)
class Entry:
    """One corpus model: ``build()`` makes it (seeded) with example inputs; ``family`` and
    ``description`` say what architecture it stands for; ``capture`` is how graphckpt is
    expected to capture it ("export" for Hugging Face models, "fx" for the torch ones)."""

    name: str
    family: str
    description: str
    builder: Callable[[], Example] = field(repr=False)
    capture: str = "export"
    hf: bool = True

    def build(self, seed: int = 0) -> Example:
        """The model (in train mode, parameters from ``seed``) and its example inputs."""
        torch.manual_seed(seed)
        model, args, kwargs = self.builder()
        return model.train(), args, kwargs


def _registry() -> dict[str, Entry]:
    """Every entry by name: Hugging Face ones when transformers is installed, then torch's."""
    from tests.corpus import torch_models

    entries: list[Entry] = []
    try:
        from tests.corpus import hf, hf_vision
    except ImportError:  # transformers is a test-only dependency
        pass
    else:
        entries += hf.entries() + hf_vision.entries()
    entries += torch_models.entries()
    return {entry.name: entry for entry in entries}


ENTRIES: dict[str, Entry] = _registry()

FAST: tuple[str, ...] = tuple(name for name in ("gpt2", "bert", "resnet", "shared_bn_convnet") if name in ENTRIES)
"""Small architectures checked in the default run: a decoder LM, an encoder with dropout, a
convolutional net with BatchNorm, and one BatchNorm module called at several places."""
