"""scripts/bench.py on a tiny configuration: every variant measured or noted, the table's shape.

No wall-clock assertion: the published numbers come from the full run (docs/benchmarks.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphckpt.tools.bench_report import COLUMNS
from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench_script():
    return load_script("bench")


def _table_rows(text: str, section: str) -> list[list[str]]:
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in body.splitlines()
            if line.startswith("| ") and not line.startswith("| variant")]


def test_tiny_benchmark_writes_one_table_per_model_with_every_variant(bench_script, tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    bench_script.main(["--tiny", "--models", "mlp", "--steps", "1", "--out", str(out)])
    text = out.read_text()
    assert "## Targets" in text and "MLP chain: peak ≤ 0.25× eager" in text
    assert re.search(r"\*\*(met|missed)\*\*: no graphckpt plan or budget above eager", text)
    rows = _table_rows(text, "mlp")
    assert all(len(row) == len(COLUMNS) for row in rows)
    names = [row[0] for row in rows]
    assert names[0] == "eager" and rows[0][3] == "1.00"
    assert any(name.startswith("checkpoint_sequential ") for name in names)
    for expected in ("per-block", "graphckpt sqrt", "graphckpt articulation",
                     "graphckpt mincut", "graphckpt auto", "graphckpt optimal", "graphckpt at per-block's peak"):
        assert expected in names, (expected, names)
    budgets = [f"graphckpt {b}" for b in ("0.5", "0.25", "0.1")]
    for budget in budgets:  # measured, or noted as infeasible under the table
        assert budget in names or f"*graphckpt budget {budget.split()[1]}* not measured: infeasible" in text
    for compiled in ("torch.compile aot_eager 0.5", "torch.compile aot_eager 0.1"):
        assert compiled in names or f"*{compiled}* not measured" in text
    for row in rows:
        # peak and step ratios: numbers (a one-step timing on a loaded machine can round to 0.00)
        assert float(row[3]) > 0 and float(row[6]) >= 0
        if row[0].startswith("graphckpt"):
            assert row[4] and row[7].endswith(" s")  # simulated peak and build time
    assert (tmp_path / "bench_mlp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
