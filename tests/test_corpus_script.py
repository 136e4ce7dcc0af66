"""scripts/corpus.py on one small entry: every setting measured or said infeasible, the table's shape."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.corpus import harness as h

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def corpus_script():
    spec = importlib.util.spec_from_file_location("corpus_script", ROOT / "scripts" / "corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["corpus_script"] = module
    spec.loader.exec_module(module)
    return module


def test_corpus_report_of_one_entry(corpus_script, tmp_path) -> None:
    out = tmp_path / "corpus.md"
    assert corpus_script.main(["--entries", "shared_bn_convnet", "--out", str(out)]) == 0
    text = out.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| entry |"))
    row = next(line for line in text.splitlines() if line.startswith("| shared_bn_convnet |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == header.count("|") - 1
    assert cells[2] == "fx" and float(cells[3].split()[0]) > 0  # captured with fx, eager measured
    settings = cells[5:5 + len(h.SETTINGS)]
    for setting, cell in zip(h.SETTINGS, settings, strict=True):
        assert cell == "below the floor" or "/" in cell, (setting, cell)
    assert settings[0] != "below the floor"  # auto always has a plan
    assert cells[-1] == "pass" or "## Failures\n\n* **shared_bn_convnet**" in text


def test_corpus_script_refuses_an_unknown_entry(corpus_script) -> None:
    with pytest.raises(SystemExit):
        corpus_script.main(["--entries", "no_such_model"])
