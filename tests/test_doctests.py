"""The examples in docstrings (``>>>``) run and print what they say, in every module of
``passes`` and ``graphckpt`` that has one: an example that has gone stale misleads more
than none."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for package in ("passes", "graphckpt")
    for path in (ROOT / package).rglob("*.py")
    if ">>> " in path.read_text()
)


def test_examples_are_found() -> None:
    assert "passes.dp_table" in MODULES and "passes.budget" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name}: no example ran"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (see the output above)"
