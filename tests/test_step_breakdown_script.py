"""scripts/step_breakdown.py and what it measures with (:mod:`graphckpt.tools.step_profile`):
a step's kernel time against the GPU left idle, beside the anchors. On a CPU there are no
kernels, so these check the host side and the table; a GPU session checks the rest."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import graphckpt
from graphckpt.tools import zoo
from graphckpt.tools.step_profile import StepProfile, covered_seconds, profile_step
from tests.scripts import load_script


def test_a_cpu_step_has_host_calls_and_no_kernels() -> None:
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    profile = profile_step(lambda: layer(x).sum().backward(), torch.device("cpu"))
    assert profile.wall_seconds > 0
    assert profile.kernels == 0 and profile.kernel_seconds == 0 and profile.idle_seconds == 0
    assert profile.aten_calls >= 3  # addmm forward, its backward's mm, the sum


def test_host_time_in_recomputes_is_counted_for_a_rewrite_only() -> None:
    model, inputs = zoo.make("mlp")
    rewritten = graphckpt.rewrite(model, inputs, strategy="sqrt")

    def step(module: torch.nn.Module) -> Callable[[], None]:
        return lambda: zoo.scalar_loss(module(*inputs)).backward()

    ours, eager = (profile_step(step(m), torch.device("cpu")) for m in (rewritten, model))
    assert 0 < ours.recompute_host_seconds < ours.wall_seconds
    assert eager.recompute_host_seconds == 0


def test_idle_is_wall_time_no_kernel_covers() -> None:
    assert StepProfile(0.010, 0.007, 12, 40).idle_seconds == pytest.approx(0.003)
    assert covered_seconds([(5, 6), (0, 2), (1, 3)]) == 4  # overlapping kernels count once


@pytest.mark.slow
def test_breakdown_rows_name_every_anchor_and_plan() -> None:
    """Slow (about 30 s): two torch.compile anchors of a tiny LLaMA."""
    script = load_script("step_breakdown")
    rows = script.breakdown("llama-tiny", rounds=2, device="cpu", costs=("flops",))
    assert rows[0].startswith("| llama-tiny | eager |")
    variants = [row.split(" | ")[1] for row in rows]
    for anchor in ("torch.compile aot_eager 0.5", "torch.compile aot_eager 0.35", "per-block"):
        assert anchor in variants
        assert any(v.startswith(f"graphckpt at {anchor}'s peak, cost=flops") for v in variants), variants
