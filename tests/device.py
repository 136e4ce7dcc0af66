"""Where the device-aware tests run: ``GRAPHCKPT_TEST_DEVICE=cuda pytest ...`` checks the same
promises on a GPU (peaks from the CUDA caching allocator's statistics); CI runs them on the CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from graphckpt.tools.measure import on_device

DEVICE = os.environ.get("GRAPHCKPT_TEST_DEVICE", "cpu")


def deterministic_kernels(device: str | torch.device) -> None:
    """On a GPU, use the deterministic kernels: cuDNN's weight gradients and the embedding
    backward add with atomics in no fixed order, so two runs of one step differ in the last
    bits, and "the rewrite trains like the model" could not be checked at 1e-5."""
    if torch.device(device).type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def on_test_device(model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
    """``model`` and ``inputs`` moved to :data:`DEVICE` (deterministic kernels there)."""
    deterministic_kernels(DEVICE)
    return model.to(DEVICE), on_device(inputs, DEVICE)


def under_autocast(module: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """``module`` with its forward under ``torch.autocast`` on the CPU, backward outside, as a
    training loop runs it."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            return module(*args, **kwargs)
    return run
