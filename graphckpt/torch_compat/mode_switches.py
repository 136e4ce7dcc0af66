"""Switches of grad mode and autocast made by Python code, which fx's symbolic tracing runs
but cannot put in a graph. Part of :mod:`graphckpt.torch_compat`, which re-exports every
name here.

``torch.no_grad``, ``torch.enable_grad`` and ``torch.set_grad_enabled`` switch grad mode
through ``torch._C._set_grad_enabled``; ``torch.autocast`` switches autocast through
``torch.set_autocast_enabled``. Both are looked up on their module at each call, so a
stand-in set there sees every switch. Checked on 2.13.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModeSwitch:
    """One switch: ``what`` changed (``"grad mode"`` or ``"autocast"``), and the stack that did it."""

    what: str
    stack: traceback.StackSummary


@contextlib.contextmanager
def mode_switches() -> Iterator[list[ModeSwitch]]:
    """While active, record each call that changes grad mode or autocast (a call setting
    the state it finds changes nothing and is not recorded); the switches still happen."""
    seen: list[ModeSwitch] = []
    set_grad, set_autocast = torch._C._set_grad_enabled, torch.set_autocast_enabled

    def grad_switch(mode: bool) -> Any:
        if bool(mode) != torch.is_grad_enabled():
            seen.append(ModeSwitch("grad mode", traceback.extract_stack()[:-1]))
        return set_grad(mode)

    def autocast_switch(*args: Any) -> Any:
        device, enabled = args if len(args) == 2 else ("cuda", *args)
        if bool(enabled) != torch.is_autocast_enabled(device):
            seen.append(ModeSwitch("autocast", traceback.extract_stack()[:-1]))
        return set_autocast(*args)

    torch._C._set_grad_enabled, torch.set_autocast_enabled = grad_switch, autocast_switch
    try:
        yield seen
    finally:
        torch._C._set_grad_enabled, torch.set_autocast_enabled = set_grad, set_autocast
