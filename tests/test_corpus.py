"""Every promise on models nobody here wrote: the corpus (tests/corpus/) rewritten with
``strategy="auto"`` and with budgets 0.5 and 0.3 of eager's simulated peak.

For each entry and setting:

* one training step (dropout on, seeded) gives the same outputs, loss, gradients and buffers
  as an untouched copy of the model (:func:`tests.equivalence.assert_trains_like`);
* the rewritten module's ``state_dict()`` has exactly the model's keys;
* the measured peak (a warm-up step, then the profiler's memory timeline) is at or below
  eager's measured peak on this machine;
* a budget plan's measured peak is within 3% of its budget (fraction x eager's simulated
  peak), or ``rewrite`` raises ``BudgetError`` naming a floor above the budget.

Besides ``auto``, 0.5 and 0.3, every check also runs at ``floor``: a budget at the smallest
simulated peak that ``BudgetError`` names, i.e. the tightest plan graphckpt makes, so a
budget below the floor (skipped by the other checks) still has its most aggressive plan tested.

The default run checks the ``FAST`` entries (a few seconds each); the rest of the corpus and
GPT-2 at its real width are ``slow`` (``pytest -m slow tests/test_corpus.py``).
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch

import graphckpt
from passes.budget import BudgetError
from tests.corpus import ENTRIES, FAST
from tests.corpus import harness as h
from tests.equivalence import assert_steps_alike, assert_trains_like

# Promises still broken, as measured (issue 13's closing note has the numbers). Not strict:
# these are sub-MiB models, and a miss of a few KiB can go either way on another CPU.
ABOVE_EAGER: dict[tuple[str, str], str] = {}
BUDGET_MISSED: dict[tuple[str, str], str] = {}


def _param(name: str, *rest: object, known: dict | None = None, slow: bool = False) -> object:
    """A pytest param for an entry (and a setting), ``slow`` unless the entry is in FAST (or
    ``slow`` always); an expected failure where ``known`` says why."""
    marks = [] if name in FAST and not slow else [pytest.mark.slow]
    if known and (name, *rest) in known:
        marks.append(pytest.mark.xfail(reason=known[(name, *rest)], strict=False))
    return pytest.param(name, *rest, marks=marks, id="-".join(str(part) for part in (name, *rest)))


ENTRY_SETTINGS = [_param(name, setting) for name, setting in itertools.product(ENTRIES, h.SETTINGS)]
ENTRY_PEAKS = [_param(name, setting, known=ABOVE_EAGER) for name, setting in itertools.product(ENTRIES, h.SETTINGS)]
ENTRY_BUDGETS = [_param(name, setting, known=BUDGET_MISSED) for name, setting in itertools.product(ENTRIES, h.SETTINGS)
                 if setting != "auto"]
BUDGET_MISSED_AUTOCAST: dict[tuple[str, h.Setting], str] = {}
# Swin's plans at 0.5 and the floor kept their budgets once a rerun served from selective checkpointing's cache held
# the cached matmul products from its start (cached_rerun_extra_bytes; 6.5-7.9% over before)
# ViT, DeiT, Wav2Vec2 and HuBERT's tightest plans kept their budgets once attention's temporaries and autocast's cached
# casts were simulated, ALBERT's once remakes ran with autocast's cache off (test_autocast_memory)
ENTRY_BUDGETS_AUTOCAST = [_param(name, setting, known=BUDGET_MISSED_AUTOCAST, slow=True)
                          for name, setting in itertools.product(ENTRIES, h.SETTINGS) if setting != "auto"]


@functools.cache
def prepared(name: str) -> h.Prepared:
    """The entry's model, captured and costed once for every test that needs it."""
    return h.prepare(ENTRIES[name])


@functools.cache
def eager_measured(name: str) -> int:
    """Eager's measured peak for the entry (measured once)."""
    entry = prepared(name)
    return h.measure(entry, entry.model)


@functools.cache
def plan_measured(name: str, setting: h.Setting) -> int:
    """The measured peak of the entry's rewrite under ``setting`` (measured once)."""
    entry = prepared(name)
    return h.measure(entry, h.rewritten(entry, h.plan_for(entry, setting)))


def _plan_or_skip(entry: h.Prepared, setting: h.Setting):
    """The plan for ``setting``; a budget below every plan's floor is checked by
    :func:`test_budget_is_met_on_the_measured_peak`, so other checks skip it."""
    try:
        return h.plan_for(entry, setting)
    except BudgetError as error:
        pytest.skip(f"budget {setting} is below the floor: {error}")


@pytest.mark.parametrize(("name", "setting"), ENTRY_SETTINGS)
def test_rewrite_trains_like_the_model(name: str, setting: h.Setting) -> None:
    entry = prepared(name)
    plan = _plan_or_skip(entry, setting)
    assert entry.captured.method == entry.entry.capture
    entry.model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(entry.model)
    module = h.rewritten(entry, plan)
    assert_trains_like(reference, entry.model, module, entry.args, entry.kwargs)


@pytest.mark.parametrize(("name", "setting"), ENTRY_SETTINGS)
def test_rewrite_keeps_the_state_dict_keys(name: str, setting: h.Setting) -> None:
    entry = prepared(name)
    module = h.rewritten(entry, _plan_or_skip(entry, setting))
    keys, expected = list(module.state_dict()), list(entry.model.state_dict())
    assert len(keys) == len(set(keys)), "a key appears twice"
    assert set(keys) == set(expected), (f"missing {sorted(set(expected) - set(keys))[:5]}, "
                                        f"extra {sorted(set(keys) - set(expected))[:5]}")


@pytest.mark.parametrize(("name", "setting"), ENTRY_PEAKS)
def test_measured_peak_is_at_most_eager(name: str, setting: h.Setting) -> None:
    _plan_or_skip(prepared(name), setting)
    eager, rewritten = eager_measured(name), plan_measured(name, setting)
    assert rewritten <= eager, f"{name} {setting}: measured {rewritten:,} B above eager's {eager:,} B"


@pytest.mark.parametrize(("name", "setting"), ENTRY_BUDGETS)
def test_budget_is_met_on_the_measured_peak(name: str, setting: h.Setting) -> None:
    _check_budget(prepared(name), name, setting)


def _check_budget(entry: h.Prepared, name: str, setting: h.Setting) -> None:
    """The budget is met within :data:`~tests.corpus.harness.BUDGET_SLACK` on the measured
    peak, or ``BudgetError`` names a floor above it."""
    allowed = h.budget_bytes(entry, setting)
    try:
        plan = h.plan_for(entry, setting)
    except BudgetError as error:
        floor = error.smallest_peak_bytes
        assert floor is not None, f"BudgetError does not name the floor: {error}"
        assert floor > allowed, f"floor {floor:,} B fits the budget {allowed:,} B: {error}"
        return
    assert plan.peak_bytes <= allowed, f"simulated {plan.peak_bytes:,} B over the budget {allowed:,} B"
    measured = h.measure(entry, h.rewritten(entry, plan)) if entry.autocast else plan_measured(name, setting)
    assert measured <= h.BUDGET_SLACK * allowed, (
        f"{name} budget {setting}: measured {measured:,} B is {measured / allowed:.3f}x the budget "
        f"{allowed:,} B (simulated {plan.peak_bytes:,} B)")


@functools.cache
def prepared_under_autocast(name: str) -> h.Prepared:
    """The entry planned under bf16 autocast, as a user training with it calls ``rewrite``."""
    return h.prepare(ENTRIES[name], autocast=torch.bfloat16)


@pytest.mark.parametrize(("name", "setting"), ENTRY_BUDGETS_AUTOCAST)
def test_budget_is_met_under_autocast(name: str, setting: h.Setting) -> None:
    """The same promise planned and stepped under bf16 autocast (docs/corpus_autocast.md):
    the sweep that added it found three things the simulator missed there (a convolution's
    input alive during its backward's scratch, a 16-bit kernel's own scratch in forward,
    BatchNorm's backward scratch not replayed)."""
    _check_budget(prepared_under_autocast(name), name, setting)


AUTOCAST_STEPS = ("t5", "albert", "vit", "llama")


@pytest.mark.slow
@pytest.mark.parametrize("name", AUTOCAST_STEPS)
def test_rewrite_steps_like_the_captured_program_under_autocast(name: str) -> None:
    """Under bf16 autocast each plan keeps the captured program's numerics, within bf16's
    rounding (ALBERT's shared layer: one cast per use in a checkpointed segment). T5's
    captured program itself steps unlike eager Hugging Face code there (harness,
    ``AUTOCAST_TOLERANCE``), so the plan is compared with the program it was made from."""
    entry = prepared_under_autocast(name)
    for setting in ("auto", "floor"):
        module = h.rewritten(entry, h.plan_for(entry, setting))
        with h.entry_autocast(entry):
            assert_steps_alike(entry.model, entry.captured.graph_module, module, entry.args, entry.kwargs,
                               **h.AUTOCAST_TOLERANCE)


GPT2_BUDGETS = (0.6, 0.8)


@functools.cache
def gpt2_real_width() -> h.Prepared:
    """GPT-2 small at its real width (tests/corpus/hf.py), captured and costed once."""
    from tests.corpus.hf import GPT2_REAL_WIDTH

    return h.prepare(GPT2_REAL_WIDTH)


@functools.cache
def gpt2_real_width_eager() -> int:
    """Eager's measured peak for GPT-2 at its real width (measured once)."""
    entry = gpt2_real_width()
    return h.measure(entry, entry.model)


@pytest.mark.slow
@pytest.mark.parametrize("budget", GPT2_BUDGETS)
def test_gpt2_real_width_meets_the_budget_on_the_measured_peak(budget: float) -> None:
    """12 layers, d=768, 12 heads, vocabulary 50257, seq 512, batch 2: each budget's plan
    measures at most 3% above its budget and below eager's measured peak."""
    entry = gpt2_real_width()
    allowed = h.budget_bytes(entry, budget)
    plan = h.plan_for(entry, budget)  # a BudgetError here fails: these budgets are above GPT-2's floor
    measured = h.measure(entry, h.rewritten(entry, plan))
    assert measured <= h.BUDGET_SLACK * allowed, (
        f"budget {budget}: measured {measured:,} B is {measured / allowed:.3f}x the budget {allowed:,} B "
        f"(simulated {plan.peak_bytes:,} B)")
    assert measured <= gpt2_real_width_eager(), f"budget {budget}: measured {measured:,} B above eager's"


@pytest.mark.slow
def test_gpt2_real_width_refuses_a_budget_below_per_blocks_peak() -> None:
    """0.3 of eager is below what per-block checkpointing reaches on GPT-2 small (0.304x:
    parameter gradients and the 50257-way logits dominate its peak), so ``rewrite`` refuses
    it, naming a floor no higher than per-block's; per-block's plan measures what it
    simulates (832 MiB of 2738 on a 2-core CPU), so the floor it names is real."""
    from graphckpt.api import plan_cost_graph

    entry = gpt2_real_width()
    per_block = plan_cost_graph(entry.cost_graph, "blocks")
    with pytest.raises(BudgetError) as refused:
        h.plan_for(entry, 0.3)
    assert refused.value.smallest_peak_bytes <= per_block.peak_bytes
    measured = h.measure(entry, h.rewritten(entry, per_block))
    assert measured <= h.BUDGET_SLACK * per_block.peak_bytes, (measured, per_block.peak_bytes)


ENABLE_ENTRIES = [_param(name) for name, entry in ENTRIES.items() if entry.hf]


def _enabled(name: str, budget: float | int | None) -> tuple:
    """``(reference, model, args, kwargs)``: the entry built twice from one seed, the second
    checkpointed in place by ``graphckpt.enable`` at ``budget``."""
    reference, args, kwargs = ENTRIES[name].build(0)
    model, _, _ = ENTRIES[name].build(0)
    graphckpt.enable(model, args, example_kwargs=kwargs or None, budget=budget)
    return reference, model, args, kwargs


@pytest.mark.parametrize("name", ENABLE_ENTRIES)
def test_enable_trains_like_the_model(name: str) -> None:
    """``graphckpt.enable``, every block checkpointed, then at a budget mixing whole and
    selective blocks (0.8 of eager's simulated peak, or the block plans' floor where 0.8 is
    below it): two steps each equal the model's own, buffers included."""
    for budget in (None, 0.8):
        try:
            reference, model, args, kwargs = _enabled(name, budget)
        except BudgetError as error:
            reference, model, args, kwargs = _enabled(name, error.smallest_peak_bytes)
        for _ in range(2):
            assert_trains_like(reference, model, model, args, kwargs, loss_fn=h.model_loss)
