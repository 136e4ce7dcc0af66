"""Fake kernels that give an output another dtype than the real kernel: the cost profile runs
every op on fake tensors (:mod:`graphckpt.profile`), and a saved tensor of the wrong dtype is
priced at the wrong size. :class:`RealOutputDtypes` gives such outputs the real kernel's dtype.
Part of :mod:`graphckpt.torch_compat`, which re-exports every name here.

The case found: a batch norm in training on a 16-bit input with float32 weights and running
statistics (what autocast runs: it leaves a norm to its input's dtype) saves its batch mean and
inverse standard deviation in float32 on CPU, where torch 2.13's meta kernel says 16-bit.
MobileNetV2's bf16 plan at 0.5 of eager measured 0.6% over its simulated peak for it (and for
the recompute's copies of the running statistics, :mod:`passes.simulate`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch

# torch.utils._python_dispatch: a dispatch mode's base class, and the context that takes every
# mode off the stack for a while (the probe below runs real kernels inside a fake-tensor
# mode). Checked on 2.13.
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["RealOutputDtypes", "real_output_dtypes"]

BATCH_NORMS = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
               "_native_batch_norm_legit_no_training", "_batch_norm_with_update",
               "_batch_norm_with_update_functional", "_batch_norm_no_update")
"""ATen batch norms whose statistics outputs may differ in dtype between fake and real kernels
(those the installed torch has: a name missing from it is skipped)."""

_PACKETS = frozenset(getattr(torch.ops.aten, name) for name in BATCH_NORMS if hasattr(torch.ops.aten, name))
_PROBED: dict[Hashable, tuple[torch.dtype | None, ...] | None] = {}


def _signature(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> Hashable:
    """What decides the dtypes a call returns: the op, each tensor's dtype, device and rank,
    every other argument as given."""
    def part(value: Any) -> Hashable:
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dtype, str(value.device), value.dim())
        return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
    return (func, tuple(part(a) for a in args), tuple(sorted((k, part(v)) for k, v in kwargs.items())))


def _small_real(value: Any, first: bool) -> Any:
    """A real tensor standing for fake ``value`` in a probe: its dtype and device, the input
    (``first``) cut to two rows of its channels, a per-channel tensor as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = (2, int(value.shape[1])) if first and value.dim() >= 2 else tuple(int(s) for s in value.shape)
    return torch.ones(shape, dtype=value.dtype, device=value.device)


def real_output_dtypes(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple[torch.dtype | None, ...] | None:
    """The dtype of each output the real kernel of batch norm ``func`` returns for arguments
    like ``args`` (``None`` for an output that is no tensor), from one call on small real
    tensors of the same dtypes and device; ``None`` when it cannot be run here (a device this
    process has no kernels for). Probed once per op and argument dtypes."""
    key = _signature(func, args, kwargs)
    if key not in _PROBED:
        try:
            with _disable_current_modes(), torch.no_grad():
                outputs = func(*(_small_real(a, i == 0) for i, a in enumerate(args)),
                               **{k: _small_real(v, False) for k, v in kwargs.items()})
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            _PROBED[key] = tuple(o.dtype if isinstance(o, torch.Tensor) else None for o in outputs)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            _PROBED[key] = None
    return _PROBED[key]


class RealOutputDtypes(TorchDispatchMode):
    """A dispatch mode, entered under a :class:`FakeTensorMode`, that gives a batch norm's
    fake outputs the dtypes its real kernel returns (:func:`real_output_dtypes`): autograd
    then saves, and the profile prices, what a real run saves. Outputs of other ops pass
    through untouched."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outputs = func(*args, **kwargs)
        if getattr(func, "overloadpacket", None) not in _PACKETS or not isinstance(outputs, tuple):
            return outputs
        real = real_output_dtypes(func, args, kwargs)
        if real is None or len(real) != len(outputs):
            return outputs
        return tuple(o.to(dtype) if isinstance(o, torch.Tensor) and dtype is not None and o.dtype != dtype
                     and o.is_floating_point() else o for o, dtype in zip(outputs, real, strict=True))
