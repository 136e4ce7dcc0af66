"""Smoke test of scripts/planner_gap.py: a ``--quick`` run writes every table, well formed."""

from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace

from passes.checkmate import SolveTimeout
from tests.scripts import load_script

CELL = re.compile(r"^(\d+\.\d+)(?:–(\d+\.\d+))?x\*?$")


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables in ``text``: each a list of rows, each a list of cells."""
    found: list[list[list[str]]] = []
    previous = ""
    for line in text.splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                found.append([])
            found[-1].append([cell.strip() for cell in line.strip("|").split("|")])
        previous = line
    return found


def test_quick_run_writes_every_table(tmp_path: Path) -> None:
    script = load_script("planner_gap")
    out = tmp_path / "gap.md"
    script.main(["--quick", "--out", str(out)])
    text = out.read_text()
    assert not text.startswith("#") and "python scripts/planner_gap.py --quick" in text
    random_table, zoo_table, budget_table, timing_table = tables(text)
    assert random_table[0] == ["strategy", "median", "worst"]
    assert zoo_table[0][0] == "strategy" and zoo_table[0][1].startswith("mlp (")
    for table in (random_table, zoo_table):
        assert set(table[1][1:]) == {"---:"}
        assert [row[0] for row in table[2:]] == list(script.ROWS)
        for row in table[2:]:
            assert len(row) == len(table[0])
            for cell in row[1:]:
                match = CELL.match(cell)
                assert match or cell == "—", cell
                if match:
                    assert float(match[1]) >= 0.99, row  # no plan beats the exact optimum
                    assert match[2] is None or float(match[2]) >= float(match[1])

    assert budget_table[0][:4] == ["graphs", "budget (× eager)", "median", "worst"]
    assert [row[1] for row in budget_table[2:]] == ["0.3", "0.5", "0.7"] * 2  # random DAGs, then the zoo
    for row in budget_table[2:]:
        assert len(row) == len(budget_table[0])
        for cell in row[2:4]:
            match = CELL.match(cell)
            assert match or cell == "—", cell
            if match:
                assert float(match[1]) >= 0.99, row

    assert timing_table[0][:3] == ["graphs", "budget (× eager)", "planning s (median / max)"]
    assert [row[1] for row in timing_table[2:]] == ["0.3", "0.5", "0.7"]
    for row in timing_table[2:]:
        median, worst = (float(x) for x in row[2].split(" / "))
        assert 0 < median <= worst, row
        assert row[3] == "—" or all(float(x) >= 0 for x in row[3].split(" / ")), row
        assert int(row[4]) >= 0


def test_timing_only_writes_the_planning_time_table_alone(tmp_path: Path) -> None:
    """``--timing-only`` re-measures the larger DAGs' planning time without any MILP."""
    script = load_script("planner_gap")
    out = tmp_path / "timing.md"
    argv = ["--timing-only", "--timing-ops", "80", "--budget-graphs", "2", "--timing-rounds", "1", "--out", str(out)]
    script.main(argv)
    text = out.read_text()
    assert "python scripts/planner_gap.py --timing-only" in text
    (timing_table,) = tables(text)
    assert timing_table[0][:3] == ["graphs", "budget (× eager)", "planning s (median / max)"]
    assert [row[:2] for row in timing_table[2:]] == [["2 random DAGs of 80 ops", f] for f in ("0.3", "0.5", "0.7")]


def test_an_unsettled_budget_cell_is_solved_once_more_for_the_longer_limit(monkeypatch) -> None:
    """A reference solve that ends at its limit with a range (or no answer) is asked again for
    ``again_limit`` seconds, once; a settled one is not."""
    script = load_script("planner_gap")
    graph = script.random_cost_graph(random.Random(0), 6)
    monkeypatch.setattr(script, "planning_seconds", lambda *a, **k: (0.1, SimpleNamespace(recompute_flops=10)))
    asked: list[float] = []

    def gap(graph, budget, ours, limit):
        asked.append(limit)
        return script.Gap(1.0, 1.3) if limit < 100 else script.Gap(1.12, 1.4)  # a weaker bound this time

    monkeypatch.setattr(script, "gap_to_milp", gap)
    row = script.BudgetRow()
    script.measure(graph, 0.5, row, 20.0, again_limit=120.0)
    assert asked == [20.0, 120.0] and row.ratios == [(1.12, 1.3)]  # what both solves know
    asked.clear()
    script.measure(graph, 0.5, row, 20.0)  # no again_limit: the range stands
    assert asked == [20.0] and row.ratios[-1] == (1.0, 1.3)

    monkeypatch.setattr(script, "planning_seconds", lambda *a, **k: (0.1, None))  # the planner refuses
    solves: list[float] = []

    def schedule(graph, budget, time_limit):
        solves.append(time_limit)
        if time_limit < 100:
            raise SolveTimeout("no answer yet", 0.0)
        return None  # proven: no schedule meets the budget

    monkeypatch.setattr(script, "checkmate_schedule", schedule)
    refused = script.BudgetRow()
    script.measure(graph, 0.5, refused, 20.0, again_limit=120.0)
    assert solves == [20.0, 120.0] and (refused.neither, refused.unsolved) == (1, 0)
    script.measure(graph, 0.5, refused, 20.0)
    assert refused.unsolved == 1
