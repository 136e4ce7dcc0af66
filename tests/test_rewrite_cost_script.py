"""Smoke test of scripts/rewrite_cost.py: tiny sizes, one table row each, a markdown fragment and a PNG."""

from __future__ import annotations

import time
from pathlib import Path

import networkx as nx
import pytest

from tests.scripts import load_script


def test_rewrite_cost_script_writes_table_and_plot(tmp_path: Path, capsys) -> None:
    markdown, png = tmp_path / "cost.md", tmp_path / "cost.png"
    options = ["--sizes", "200", "400", "--budget-timeout", "1", "--out-md", str(markdown), "--png", str(png)]
    rows = load_script("rewrite_cost").main(options)  # a budget plan given up after 1 s or not: a row either way
    assert [row["nodes"] for row in rows] == [202, 402]
    printed = capsys.readouterr().out
    text = markdown.read_text()
    for table in (printed, text):
        lines = [line for line in table.splitlines() if line.startswith("| ")]
        assert lines[0].startswith("| nodes | capture | costs | plan auto | plan budget 0.25 | codegen | total |")
        assert [line.split(" | ")[0] for line in lines[1:]] == ["| 202", "| 402"]
    assert "Command: `python scripts/rewrite_cost.py --sizes 200 400" in text
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow
def test_an_exported_hugging_face_llama_is_a_stack_too() -> None:
    """``--stacks llama``: a model captured by torch.export, its rewrite checked against eager
    (15 s: with ``-m slow``; the default run's export dedup tests capture the same model)."""
    pytest.importorskip("transformers")
    row = load_script("rewrite_cost").measure(200, 20, "llama")
    assert 150 <= row["nodes"] <= 300 and row["stack"] == "llama" and row["plan budget 0.25"] is not None


def test_an_inplace_stack_is_rewritten_and_trains_like_eager() -> None:
    """``--stacks inplace``: in-place ReLUs and ``out += x`` in every block (run as their
    out-of-place twins), the rewrite checked against eager's gradients by ``measure``."""
    row = load_script("rewrite_cost").measure(200, 5, "inplace")
    assert row["stack"] == "inplace" and 190 <= row["nodes"] <= 210 and row["total"] > 0


def test_a_plan_that_runs_too_long_is_given_up_even_when_its_error_is_wrapped() -> None:
    script = load_script("rewrite_cost")

    def wrapped() -> None:
        try:
            time.sleep(5)
        except Exception as error:
            raise nx.NetworkXError("Input is not a correct NetworkX graph.") from error

    assert script.timed_or_none(wrapped, 1) is None
    assert script.timed_or_none(lambda: None, 1) is not None
    with pytest.raises(ZeroDivisionError):  # an error that is not the alarm's propagates
        script.timed_or_none(lambda: 1 / 0, 1)
