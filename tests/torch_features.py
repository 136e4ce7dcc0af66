"""What the installed torch can do, for the few tests of things older releases lack.

CI runs the suite on torch 2.13; it also passes on the oldest release pyproject allows
(see README). A test that needs one of these skips on a torch without it, saying why. Each
flag probes the capability itself rather than a version number, so a regression on a new
torch still fails.
"""

from __future__ import annotations

import torch
from torch import fx, nn


class _SizeIntoBufferMethod(nn.Module):
    """``buffer.narrow(0, 0, x.size(1))``: what the zoo GPT does with its position ids."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pos", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pos.narrow(0, 0, x.size(1))


def _fx_passes_traced_sizes_to_tensor_methods() -> bool:
    """Whether ``fx.symbolic_trace`` can hand a traced size to a method of a real tensor
    (a buffer): torch 2.13 can; 2.5 and 2.6 raise ``TypeError`` (``narrow()`` got a
    ``Proxy``), so the zoo GPT falls back to ``torch.export`` there."""
    try:
        fx.symbolic_trace(_SizeIntoBufferMethod())
    except TypeError:
        return False
    return True


def _fsdp2_runs_on_cpu() -> bool:
    """Whether ``fully_shard`` exists and can run on CPU (it records events on a CPU stream,
    ``torch.cpu.Stream.record_event``: not in torch 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.cpu.Stream, "record_event")


FX_TRACES_ZOO_GPT = _fx_passes_traced_sizes_to_tensor_methods()
FSDP2_ON_CPU = _fsdp2_runs_on_cpu()
NO_FX_ZOO_GPT = "this torch's fx cannot pass a traced size to Tensor.narrow (torch 2.5, 2.6; 2.13 can)"
NO_FSDP2_ON_CPU = "this torch's FSDP2 (fully_shard) cannot run on CPU (torch.cpu.Stream has no record_event)"
