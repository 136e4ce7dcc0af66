"""scripts/corpus.py on one small entry: every setting measured or said infeasible, the table's shape."""

from __future__ import annotations

import pytest

from tests.corpus import harness as h
from tests.scripts import load_script

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def corpus_script():
    return load_script("corpus")


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
