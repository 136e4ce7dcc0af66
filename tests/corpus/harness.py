"""Capture, plan, rewrite and measure a corpus entry: what the tests and ``scripts/corpus.py`` share.

One capture (``graphckpt.api.cost_model``: what ``graphckpt.rewrite`` runs first) serves every
plan of an entry; ``rewritten`` then runs the codegen ``rewrite`` would, so each plan's module
is the one ``graphckpt.rewrite(model, args, example_kwargs=kwargs, budget=...)`` returns.
Measurement is :func:`graphckpt.tools.bench.measured_peak` (a warm-up step, then one step under the
profiler's memory timeline) of a step whose loss is the model's own (``output.loss`` for
Hugging Face models, a scalar output as is, else the mean squares of every output).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import nn

from graphckpt.api import Analysis, cost_model, generate_rewrite, plan_cost_graph
from graphckpt.capture import Captured
from graphckpt.tools.anchors import Skipped, block_anchor
from graphckpt.tools.bench import measured_peak
from graphckpt.tools.measure import on_device
from passes.budget import BudgetError
from passes.plan import Plan
from passes.simulate import eager_peak
from tests.corpus.entries import Entry
from tests.device import DEVICE, deterministic_kernels
from tests.equivalence import default_loss

Setting = str | float
"""``"auto"`` (the default strategy), a budget as a fraction of eager's simulated peak, or
``"floor"``: a budget at the smallest simulated peak any plan reaches (the tightest plan)."""

SETTINGS: tuple[Setting, ...] = ("auto", 0.5, 0.3, "floor")
BUDGET_SLACK = 1.03  # a budget plan's measured peak may exceed its budget by 3% at most
AUTOCAST_TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-4}  # a step under bf16 autocast against the model's: within
# bf16's rounding (torch.testing's rtol for bf16). A parameter used by several layers gets one autocast
# cast per use in a checkpointed segment (graphckpt.dropping.autocast_uncached), so its gradients are
# summed in float32, where eager's one cached cast sums them in bf16: ALBERT's shared layer differed by
# 3.7e-3 of its largest element. T5's decoder relative-attention bias differs by 1.6e-3 (beyond atol) in the
# captured program already: eager Hugging Face code passes SDPA a [1, heads, q, k] bias mask broadcast over
# the batch (no attention mask, is_causal), whose gradient SDPA's backward sums over the batch in bf16; under
# tracing it materializes the mask, [batch, heads, q, k], summed in float32 after the cast. Eager with the
# mask materialized steps bit for bit like every T5 plan. scripts/corpus.py reports such a difference once,
# as the captured program's, when each plan steps like the captured program.


@dataclass
class Prepared:
    """An entry's model, example inputs and the capture and cost graph every plan shares."""

    entry: Entry
    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    captured: Captured
    cost_graph: nx.DiGraph
    floor: int | None = None
    autocast: torch.dtype | None = None  # planned and stepped under autocast to this dtype
    plans: dict[Setting, Plan | BudgetError] = field(default_factory=dict)  # by setting (:func:`plan_for`)

    @property
    def eager_simulated(self) -> int:
        """The simulator's peak for eager (what a budget fraction multiplies)."""
        return eager_peak(self.cost_graph)


def prepare(entry: Entry, seed: int = 0, device: str | torch.device = DEVICE,
            autocast: torch.dtype | None = None) -> Prepared:
    """Build ``entry`` (seeded) on ``device`` and capture and cost it as ``graphckpt.rewrite``
    would; under ``autocast`` to that dtype when given, as a user training with it plans."""
    model, args, kwargs = entry.build(seed)
    deterministic_kernels(device)
    model, args, kwargs = model.to(device), on_device(args, device), on_device(kwargs, device)
    with _autocast(torch.device(device).type, autocast):
        captured, cost_graph = cost_model(model, args, example_kwargs=kwargs or None)
    return Prepared(entry, model, args, kwargs, captured, cost_graph, autocast=autocast)


def _autocast(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def plan_for(prepared: Prepared, setting: Setting) -> Plan:
    """The plan ``rewrite`` makes with ``strategy="auto"`` or ``budget=setting``; raises
    :class:`BudgetError` when no plan fits the budget. Planned once per entry and setting:
    a refusal of a convolutional net at 0.3 takes seconds (the exact floor's solve), and
    four checks ask for each plan."""
    if setting not in prepared.plans:
        try:
            prepared.plans[setting] = _planned(prepared, setting)
        except BudgetError as error:
            prepared.plans[setting] = error
    found = prepared.plans[setting]
    if isinstance(found, BudgetError):
        raise found
    return found


def _planned(prepared: Prepared, setting: Setting) -> Plan:
    """:func:`plan_for`, planned afresh."""
    if setting == "auto":
        return plan_cost_graph(prepared.cost_graph, "auto")
    if setting == "floor":
        return plan_cost_graph(prepared.cost_graph, budget=budget_bytes(prepared, setting))
    return plan_cost_graph(prepared.cost_graph, budget=float(setting))


def rewritten(prepared: Prepared, plan: Plan) -> nn.Module:
    """The rewritten module for ``plan``, sharing the entry model's tensors."""
    return generate_rewrite(prepared.model, Analysis(prepared.captured, prepared.cost_graph, plan))


def budget_bytes(prepared: Prepared, setting: Setting) -> int:
    """The bytes a budget allows: the fraction of eager's simulated peak, or for ``"floor"``
    the floor itself (:func:`floor_bytes`)."""
    if setting == "floor":
        return _floor(prepared)
    return int(float(setting) * prepared.eager_simulated)


def floor_bytes(prepared: Prepared) -> int | None:
    """The smallest simulated peak any plan reaches: what ``rewrite``'s :class:`BudgetError`
    says (``smallest_peak_bytes``) when asked for one byte; None if it does not say."""
    try:
        plan_cost_graph(prepared.cost_graph, budget=1)
    except BudgetError as error:
        return error.smallest_peak_bytes
    return 0


def _floor(prepared: Prepared) -> int:
    """:func:`floor_bytes`, computed once per entry; an error if the floor is not named."""
    if prepared.floor is None:
        prepared.floor = floor_bytes(prepared)
    if prepared.floor is None:
        raise AssertionError("BudgetError at one byte does not name the smallest simulated peak")
    return prepared.floor


def model_loss(output: Any) -> torch.Tensor:
    """The loss a user trains on: a Hugging Face output's ``.loss``, a scalar output itself,
    else the mean squares of every floating output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output
    return default_loss(output)


def bound(module: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``module`` with the keyword inputs bound, so positional-only helpers can step it."""
    return functools.partial(module, **kwargs) if kwargs else module


def measure(prepared: Prepared, module: Callable[..., Any]) -> int:
    """Measured peak activation bytes of one training step of ``module`` on the entry's
    inputs; its forward under the entry's autocast, if any (backward outside, as usual)."""
    return measured_peak(bound(_under_autocast(module, prepared), prepared.kwargs), prepared.args, model_loss)


def entry_autocast(prepared: Prepared) -> contextlib.AbstractContextManager:
    """The autocast the entry was planned under (a no-op context when none)."""
    return _autocast(next(prepared.model.parameters()).device.type, prepared.autocast)


def _under_autocast(module: Callable[..., Any], prepared: Prepared) -> Callable[..., Any]:
    if prepared.autocast is None:
        return module

    def run(*args: Any, **kwargs: Any) -> Any:
        with entry_autocast(prepared):
            return module(*args, **kwargs)
    return run


def per_block(prepared: Prepared) -> tuple[int | None, str]:
    """Measured peak of per-block checkpointing (HF ``gradient_checkpointing_enable`` where the
    model supports it, else every repeated block checkpointed), and what was used or why not."""
    variant = block_anchor(prepared.model, prepared.args)
    if isinstance(variant, Skipped):
        return None, variant.reason
    return measure(prepared, variant.module), variant.setting
