"""Random DAG models for the rewrite's property tests: :func:`model_specs` draws a recipe
(plain Python data) over values of shape (batch, width), and :class:`RecipeModel`
interprets it in ``forward``; fx traces through the loop since the recipe holds no tensors.
What a recipe may hold is in the comment above :data:`MODULE_KINDS`; the tests are in
tests/test_random_models.py (and tests/test_exact.py runs the exact solver on one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

WIDTH, BATCH = 8, 4

# Steps (each appends one value; operands are value indices, 0 is the input):
#   ("call", key, a)          modules[key](v[a])               Linear/LayerNorm/BatchNorm/Dropout/GELU
#   ("act", name, a)          relu | tanh | gelu (functional)
#   ("add", a, b), ("mul", a, b)
#   ("cat", key, a, b)        modules[key](torch.cat([v[a], v[b]], 1)), key a Linear(2w, w)
#   ("inplace", key, a)       modules[key](v[a]) with key a ReLU(inplace=True)
#   ("add_", a, b), ("mul_", a, b)   v[a].add_(v[b]) / v[a].mul_(v[b])
# An in-place step writes into v[a] and appends the same tensor as a new value; v[a] is read
# again afterwards only sometimes (fx then reads the node from before the write). Writes
# go only to storages no autograd node may have saved (neither the producer of its output
# nor a reader of its input), never to the input, so eager backward is valid.
MODULE_KINDS = {
    "linear": lambda: nn.Linear(WIDTH, WIDTH),
    "cat": lambda: nn.Linear(2 * WIDTH, WIDTH),
    "ln": lambda: nn.LayerNorm(WIDTH),
    "bn": lambda: nn.BatchNorm1d(WIDTH),
    "drop": lambda: nn.Dropout(p=0.3),
    "gelu": lambda: nn.GELU(),
    "relu_": lambda: nn.ReLU(inplace=True),
}
# Modules a recipe may call again at another place: one BatchNorm called three times updates
# its running statistics three times, in eager's order.
REUSABLE = ("linear", "ln", "bn", "drop")


@dataclass(frozen=True)
class ModelSpec:
    modules: tuple[tuple[str, str], ...]  # (key, kind) in creation order
    recipe: tuple[tuple, ...]
    outputs: tuple[int, ...]
    output_form: str  # "tensor" | "tuple" | "dict"
    input_requires_grad: bool
    seed: int


class RecipeModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.mods = nn.ModuleDict({key: MODULE_KINDS[kind]() for key, kind in spec.modules})
        with torch.no_grad():  # non-trivial affine parameters for the norms
            for module in self.mods.values():
                if isinstance(module, (nn.LayerNorm, nn.BatchNorm1d)):
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.5, 0.5)
        self.recipe = [tuple(step) for step in spec.recipe]
        self.outputs = list(spec.outputs)
        self.output_form = spec.output_form

    def forward(self, x: torch.Tensor) -> Any:
        values = [x]
        for step in self.recipe:
            op = step[0]
            if op in ("call", "inplace"):
                values.append(self.mods[step[1]](values[step[2]]))
            elif op == "act":
                function = {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}[step[1]]
                values.append(function(values[step[2]]))
            elif op == "add":
                values.append(values[step[1]] + values[step[2]])
            elif op == "mul":
                values.append(values[step[1]] * values[step[2]])
            elif op == "cat":
                values.append(self.mods[step[1]](torch.cat([values[step[2]], values[step[3]]], dim=1)))
            elif op == "add_":
                values.append(values[step[1]].add_(values[step[2]]))
            elif op == "mul_":
                values.append(values[step[1]].mul_(values[step[2]]))
            else:
                raise ValueError(f"unknown step {step!r}")
        results = [values[i] for i in self.outputs]
        if self.output_form == "tensor":
            return results[0]
        if self.output_form == "dict":
            return {f"out{i}": r for i, r in enumerate(results)}
        return tuple(results)


@st.composite
def model_specs(draw, max_steps: int = 16) -> ModelSpec:
    modules: list[tuple[str, str]] = []
    recipe: list[tuple] = []
    live = [0]  # values that may still be read
    storage = {0: 0}  # value -> the value whose storage it is (in-place results share it)
    pinned = {0}  # storages autograd may have saved, and the input's: never written in place

    def new_module(kind: str) -> str:
        key = f"{kind.rstrip('_')}{len(modules)}"
        modules.append((key, kind))
        return key

    def operand() -> int:
        return draw(st.sampled_from(live))

    for _ in range(draw(st.integers(1, max_steps))):
        writable = [v for v in live if storage[v] not in pinned]
        reusable = [key for key, kind in modules if kind in REUSABLE]
        choices = ["linear", "act", "add", "mul", "cat", "ln", "bn", "drop", "gelu"]
        choices += ["reuse"] * 3 * bool(reusable) + ["relu_", "add_", "mul_"] * bool(writable)
        choice = draw(st.sampled_from(choices))
        index = len(recipe) + 1  # the value this step appends
        storage[index] = index
        if choice in ("linear", "ln", "bn", "drop", "gelu", "reuse"):
            key = draw(st.sampled_from(reusable)) if choice == "reuse" else new_module(choice)
            step, saving = ("call", key, operand()), dict(modules)[key] != "drop"
            pinned |= {storage[step[2]]} if saving else set()
        elif choice == "act":
            name, a = draw(st.sampled_from(["relu", "tanh", "gelu"])), operand()
            step = ("act", name, a)
            pinned |= {storage[a]} if name == "gelu" else {index}
        elif choice in ("add", "mul", "cat"):
            a, b = operand(), operand()
            step = ("cat", new_module("cat"), a, b) if choice == "cat" else (choice, a, b)
            pinned |= {storage[a], storage[b]} if choice == "mul" else set()
        else:  # an in-place write into v[a]
            a = draw(st.sampled_from(writable))
            storage[index] = storage[a]
            if choice == "relu_":
                step = ("inplace", new_module("relu_"), a)
                pinned.add(storage[a])  # ReLU's backward reads its output
            else:
                b = draw(st.sampled_from([v for v in live if storage[v] != storage[a]]))
                step = (choice, a, b)
                pinned |= {storage[b]} if choice == "mul_" else set()
            if draw(st.booleans()):
                live.remove(a)
        recipe.append(step)
        live.append(index)
    count = draw(st.integers(1, min(3, len(live))))
    others = draw(st.lists(st.sampled_from(live[:-1]), min_size=count - 1, max_size=count - 1,
                           unique=True)) if count > 1 else []
    outputs = (live[-1], *others)
    form = draw(st.sampled_from(["tuple", "dict"] + ["tensor"] * (len(outputs) == 1)))
    return ModelSpec(tuple(modules), tuple(recipe), outputs, form, draw(st.booleans()),
                     draw(st.integers(0, 2**16)))
