"""scripts/bench.py on a tiny configuration: every variant measured or noted, the table's shape.

No wall-clock assertion: the published numbers come from the full run (docs/benchmarks.md).
"""

from __future__ import annotations

import json
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
    ratios = tmp_path / "ratios.json"
    bench_script.main(["--tiny", "--models", "mlp", "--steps", "1", "--out", str(out), "--json", str(ratios)])
    text = out.read_text()
    assert "## Targets" in text and "mlp: at 0.25 of eager, step ≤ checkpoint_sequential" in text
    assert "mlp: at torch.compile's (aot_eager, budget 0.5) measured peak" in text
    assert re.search(r"\*\*(met|missed)\*\*: no graphckpt plan or budget above eager", text)
    rows = _table_rows(text, "mlp")
    assert all(len(row) == len(COLUMNS) for row in rows)
    names = [row[0] for row in rows]
    assert names[0] == "eager" and rows[0][3] == "1.00"
    assert any(name.startswith("checkpoint_sequential ") for name in names)
    for expected in ("per-block", "graphckpt sqrt", "graphckpt articulation",
                     "graphckpt mincut", "graphckpt auto", "graphckpt optimal", "graphckpt at per-block's peak"):
        assert expected in names, (expected, names)
    sequential = next(name for name in names if name.startswith("checkpoint_sequential "))
    at_sequential = f"graphckpt at {sequential}'s peak"
    assert at_sequential in names or f"*graphckpt budget {at_sequential.split(' ', 1)[1]}* not measured" in text
    budgets = [f"graphckpt {b}" for b in ("0.75", "0.5", "0.35", "0.25", "0.15")]
    for budget in budgets:  # measured, or noted as infeasible under the table
        assert budget in names or f"*graphckpt budget {budget.split()[1]}* not measured: infeasible" in text
    for compiled in ("torch.compile aot_eager 0.5", "torch.compile aot_eager 0.35"):
        assert compiled in names or f"*{compiled}* not measured" in text
    for row in rows:
        # peak and step ratios: numbers (a one-step timing on a loaded machine can round to 0.00)
        assert float(row[3]) > 0 and float(row[6]) >= 0 and float(row[8]) >= 0  # and faults per step
        if row[0].startswith("graphckpt"):
            assert row[4] and row[-1].endswith(" s")  # simulated peak and build time
            assert re.fullmatch(r"\d+ / \d+ / -?\d+ ms", row[9]), row[9]  # predicted / in recomputes / measured
    assert json.loads(ratios.read_text())["mlp"]["eager"] == 1.0
    assert (tmp_path / "bench_mlp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_allocator_ratios_go_beside_the_run(bench_script) -> None:
    from graphckpt.tools.bench import Result

    results = {"mlp": [Result("eager", "eager", "", 1, 1.0), Result("graphckpt 0.5", "graphckpt", "", 1, 1.2)]}
    bench_script.merge_default_allocator(results, {"mlp": {"eager": 1.0, "graphckpt 0.5": 1.31}})
    assert [r.default_time_ratio for r in results["mlp"]] == [1.0, 1.31]
