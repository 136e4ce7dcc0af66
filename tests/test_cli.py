"""The ``graphckpt`` command line: every command on tiny zoo models, its files and its errors.

Models are tiny (a 4-layer MLP of width 32, a 1-block GPT of width 16) so each command
runs in seconds; the torch.compile anchor (several seconds to compile) is marked slow.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graphckpt.tools.cli import app, parse_budget_option
from graphckpt.tools.report import human_flops
from graphckpt.tools.targets import TargetError, load_target, parse_zoo_spec
from passes.budget import BudgetError
from passes.strategies import STRATEGIES
from passes.units import format_bytes
from tests.torch_features import FX_TRACES_ZOO_GPT

MLP = "zoo:mlp?depth=4&width=32&batch=4"
GPT = "zoo:gpt?layers=1&d=16&heads=2&seq=8&batch=2"
JSON_KEYS = {"checkpoints", "segments", "peak_bytes", "eager_peak_bytes", "recompute_flops", "strategy", "capture"}


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "160"})


def invoke(runner: CliRunner, *args: str):
    return runner.invoke(app, list(args))


def ok(result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after checking the signature)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------- inspect


def test_inspect_prints_segments_checkpoints_and_peaks(runner: CliRunner) -> None:
    text = ok(invoke(runner, "inspect", GPT))
    captured = "captured with fx" if FX_TRACES_ZOO_GPT else "captured with export"  # older torch: export
    for expected in ("segments", "checkpoints", "simulated peak", "vs eager", captured, "recomputed",
                     "of forward FLOPs"):
        assert expected in text


def test_inspect_json_has_stable_keys(runner: CliRunner) -> None:
    document = json.loads(ok(invoke(runner, "inspect", MLP, "--strategy", "mincut", "--json")))
    assert JSON_KEYS <= set(document)
    assert document["strategy"] == "mincut" and document["capture"] == "fx"
    assert 0 < document["peak_bytes"] <= document["eager_peak_bytes"]
    assert document["checkpoints"] and {"node", "shape", "dtype", "bytes"} <= set(document["checkpoints"][0])
    segment = document["segments"][0]
    assert {"nodes", "first", "last", "recompute", "boundary_bytes", "recompute_flops", "children"} <= set(segment)
    assert sum(s["nodes"] for s in document["segments"]) == document["graph"]["op_nodes"]


def test_inspect_recompute_per_segment_adds_up(runner: CliRunner) -> None:
    document = json.loads(ok(invoke(runner, "inspect", GPT, "--strategy", "sqrt", "--json")))
    assert sum(s["recompute_flops"] for s in document["segments"]) == document["recompute_flops"]


def test_inspect_peak_lists_what_is_alive_there(runner: CliRunner) -> None:
    """``--peak`` adds the live set at the simulated peak: its kinds add up to the peak, and
    the largest storages are named by node, largest first."""
    document = json.loads(ok(invoke(runner, "inspect", MLP, "--strategy", "sqrt", "--peak", "--json")))
    peak = document["at_peak"]
    assert peak["peak_bytes"] == document["peak_bytes"]
    assert sum(peak["bytes_by_kind"].values()) == peak["peak_bytes"]
    sizes = [row["bytes"] for row in peak["largest"]]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) <= peak["storage_count"]
    assert peak["reached_by"]
    text = ok(invoke(runner, "inspect", MLP, "--strategy", "sqrt", "--peak"))
    assert "at the simulated peak" in text and peak["largest"][0]["node"] in text
    assert "at the simulated peak" not in ok(invoke(runner, "inspect", MLP, "--strategy", "sqrt"))


def test_inspect_peak_of_a_missed_budget_shows_the_smallest_plans_peak(runner: CliRunner) -> None:
    """A budget no plan meets fails as before, and with ``--peak`` first shows what the
    smallest plan holds at its peak: what would have to shrink."""
    result = invoke(runner, "inspect", MLP, "--budget", "0.05", "--peak")
    assert result.exit_code == 1 and "no plan fits" in result.output
    assert "at the smallest plan's simulated peak" in result.output and "activation" in result.output
    result = invoke(runner, "inspect", MLP, "--budget", "0.05")
    assert result.exit_code == 1 and "simulated peak," not in result.output


def test_inspect_budget_and_batch(runner: CliRunner) -> None:
    document = json.loads(ok(invoke(runner, "inspect", "zoo:mlp?depth=4&width=32", "--batch", "8",
                                    "--budget", "0.9", "--json")))
    assert document["budget"] == "0.9"
    assert document["peak_bytes"] <= 0.9 * document["eager_peak_bytes"]
    assert document["checkpoints"] == [] or document["checkpoints"][0]["shape"].startswith("[8,")


def test_inspect_exact_seconds_gives_the_solver_its_time_and_zero_none(runner: CliRunner) -> None:
    def notes(*options: str) -> str:
        return " ".join(json.loads(ok(invoke(runner, "inspect", "zoo:mlp?depth=4&width=64&batch=256", "--budget",
                                              "0.5", *options, "--json")))["notes"])

    assert "exact solver's schedule" in notes("--exact-seconds", "20")  # a 0.2 s solve
    assert "exact solver" not in notes("--exact-seconds", "0")
    assert "exact solver" not in notes("--no-exact", "--exact-seconds", "20")


def test_inspect_draws_png_svg_and_dot(runner: CliRunner, tmp_path: Path) -> None:
    png, svg, dot = tmp_path / "cut.png", tmp_path / "cut.svg", tmp_path / "cut.dot"
    result = invoke(runner, "inspect", MLP, "--png", str(png), "--svg", str(svg), "--dot", str(dot))
    ok(result)
    width, height = png_size(png)
    assert 600 <= width <= 6000 and 300 <= height <= 6000
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = dot.read_text()
    assert text.startswith("digraph") and text.rstrip().endswith("}")
    assert "cluster_0" in text and "penwidth=3" in text  # segments grouped, checkpoints marked
    assert f"wrote {png}" in result.stderr


def test_inspect_collapses_segments_into_boxes(runner: CliRunner, tmp_path: Path) -> None:
    dot, png = tmp_path / "cut.dot", tmp_path / "cut.png"
    ok(invoke(runner, "inspect", GPT, "--collapse", "--dot", str(dot), "--png", str(png)))
    text = dot.read_text()
    assert '"segment 0"' in text and "ops" in text and "cluster_" not in text
    assert png_size(png)[0] > 600


def test_inspect_json_stays_clean_when_drawing(runner: CliRunner, tmp_path: Path) -> None:
    result = invoke(runner, "inspect", MLP, "--json", "--png", str(tmp_path / "c.png"))
    json.loads(ok(result))  # the "wrote ..." line goes to stderr


# ---------------------------------------------------------------- compare


def test_compare_lists_every_strategy(runner: CliRunner) -> None:
    text = ok(invoke(runner, "compare", MLP))
    for name in STRATEGIES:
        assert name in text
    assert "simulated peak" in text and "planning" in text


def test_compare_json(runner: CliRunner) -> None:
    document = json.loads(ok(invoke(runner, "compare", MLP, "--json")))
    rows = {row["strategy"]: row for row in document["strategies"]}
    assert set(rows) == set(STRATEGIES)
    for row in rows.values():
        if "error" not in row:
            assert 0 < row["peak_ratio"] <= 1.0 + 1e-9 and row["planning_seconds"] >= 0


# ---------------------------------------------------------------- bench, pareto, demo


def test_bench_measures_eager_strategies_and_sequential_anchor(runner: CliRunner, tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    result = invoke(runner, "bench", MLP, "--steps", "1", "--no-compile", "--strategy", "sqrt",
                    "--strategy", "auto", "--json", "--png", str(png))
    document = json.loads(ok(result))
    names = [r["name"] for r in document["results"]]
    assert names[0] == "eager" and "graphckpt sqrt" in names and "graphckpt auto" in names
    assert any(n.startswith("checkpoint_sequential") for n in names)
    assert all(r["peak_bytes"] > 0 and r["step_seconds"] > 0 for r in document["results"])
    assert document["results"][0]["peak_ratio"] == 1.0
    assert png_size(png)[0] > 600
    assert "USDT" not in result.stderr


def test_bench_notes_a_missing_sequential_anchor(runner: CliRunner) -> None:
    result = invoke(runner, "bench", GPT, "--steps", "1", "--no-compile", "--strategy", "sqrt")
    assert "graphckpt sqrt" in ok(result)
    assert "checkpoint_sequential skipped" in result.stderr


@pytest.mark.slow
def test_bench_with_torch_compile_anchor(runner: CliRunner) -> None:
    document = json.loads(ok(invoke(runner, "bench", MLP, "--steps", "1", "--strategy", "auto", "--json")))
    kinds = {r["kind"] for r in document["results"]} | {s["name"].split()[0] for s in document["skipped"]}
    assert "torch.compile" in kinds  # measured, or skipped with a note saying why


def test_pareto_plots_and_skips_infeasible_budgets(runner: CliRunner, tmp_path: Path) -> None:
    png = tmp_path / "pareto.png"
    result = invoke(runner, "pareto", MLP, "--budgets", "1,0.95,0.01", "--steps", "1", "--no-compile",
                    "--png", str(png))
    text = ok(result)
    assert "graphckpt 1" in text and "graphckpt 0.95" in text and "checkpoint_sequential" in text
    assert "graphckpt budget 0.01 skipped: infeasible" in result.stderr
    assert png_size(png)[0] > 600


def test_pareto_flops_axis(runner: CliRunner, tmp_path: Path) -> None:
    png = tmp_path / "pareto.png"
    ok(invoke(runner, "pareto", MLP, "--budgets", "1,0.95", "--steps", "1", "--no-compile", "--x", "flops",
              "--png", str(png)))
    assert png.exists()


def test_demo_measures_the_trade_offs_and_shows_the_best_cut(runner: CliRunner) -> None:
    text = ok(invoke(runner, "demo", "--steps", "2", "--target", "zoo:gpt?layers=3&d=32&heads=2&seq=32&batch=2"))
    for expected in ("model:", "measured peak", "eager", "per-block", "graphckpt at per-block's peak", "graphckpt 0.5",
                     "segments", "at per-block checkpointing's memory:", "best trade-off: graphckpt",
                     "ratio: peak"):
        assert expected in text, expected


def test_best_trade_off_buys_most_memory_per_step_time() -> None:
    from graphckpt.tools.bench import Result
    from graphckpt.tools.demo import best_trade_off, memory_per_time

    def result(name: str, kind: str, peak: float, step: float) -> Result:
        return Result(name, kind, "", 0, step, peak_ratio=peak, time_ratio=step)

    results = [result("eager", "eager", 1.0, 1.0), result("per-block", "per-block", 0.2, 1.5),
               result("graphckpt a", "graphckpt", 0.2, 1.45), result("graphckpt b", "graphckpt", 0.5, 1.1),
               result("graphckpt c", "graphckpt", 1.0, 0.99)]
    assert memory_per_time(results[3]) > memory_per_time(results[2]) > memory_per_time(results[1])
    assert memory_per_time(results[4]) == 0.0  # saves nothing, however fast
    assert memory_per_time(result("free", "graphckpt", 0.9, 0.98)) == float("inf")
    assert best_trade_off(results).name == "graphckpt b"  # the per-block anchor is never ours
    assert best_trade_off(results[:2]) is None


# ---------------------------------------------------------------- user targets


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cli_user_models.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build(batch=3):
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), \\
                torch.randn(batch, 8)

        def wrong():
            return 42

        def broken():
            raise RuntimeError("no weights here")

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def test_module_callable_target_with_batch(runner: CliRunner, user_module: Path) -> None:
    document = json.loads(ok(invoke(runner, "inspect", "cli_user_models:build", "--batch", "5", "--json")))
    assert document["target"] == "cli_user_models:build"
    assert "[5, 8]" in json.dumps(document) or document["eager_peak_bytes"] > 0


def test_file_path_target(runner: CliRunner, user_module: Path) -> None:
    ok(invoke(runner, "compare", f"{user_module}:build"))


# ---------------------------------------------------------------- errors


ERRORS = [
    (["inspect", "zoo:nope"], "unknown zoo model 'nope'"),
    (["inspect", "zoo:mlp?depth=2&colour=red"], "colour"),
    (["inspect", MLP, "--strategy", "nope"], "unknown strategy 'nope'"),
    (["inspect", MLP, "--budget", "lots"], "budget 'lots'"),
    (["inspect", MLP, "--budget", "0.001"], "no plan fits"),
    (["inspect", MLP, "--budget", "0.5", "--strategy", "sqrt"], "budget"),
    (["inspect", "no_such_package_xyz.models:build"], "cannot import 'no_such_package_xyz.models'"),
    (["inspect", "cli_user_models:wrong"], "must return (model, example_inputs)"),
    (["inspect", "cli_user_models:broken"], "no weights here"),
    (["inspect", "cli_user_models:NOT_CALLABLE"], "not a callable"),
    (["inspect", "cli_user_models:missing"], "has no attribute 'missing'"),
    (["inspect", "just-a-word"], "expected zoo:NAME or package.module:callable"),
    (["compare", "zoo:nope"], "unknown zoo model"),
    (["bench", MLP, "--strategy", "nope"], "unknown strategy"),
    (["pareto", MLP, "--budgets", "2,0.5"], "0 < b <= 1"),
    (["pareto", MLP, "--x", "bytes"], "choose time or flops"),
]


@pytest.mark.parametrize(("args", "message"), ERRORS, ids=[" ".join(a)[:60] for a, _ in ERRORS])
def test_bad_input_is_one_red_line(runner: CliRunner, user_module: Path, args: list[str], message: str) -> None:
    result = invoke(runner, *args)
    assert result.exit_code == 1, result.output
    assert message in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output


def test_debug_shows_the_exception(runner: CliRunner) -> None:
    result = invoke(runner, "--debug", "inspect", "zoo:nope")
    assert result.exit_code != 0
    assert isinstance(result.exception, TargetError)


def test_console_script_runs_in_a_real_process(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "120"}
    command = [sys.executable, "-m", "graphckpt.tools.cli"]
    good = subprocess.run([*command, "inspect", MLP, "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert good.returncode == 0, good.stderr
    assert JSON_KEYS <= set(json.loads(good.stdout))
    bad = subprocess.run([*command, "inspect", "zoo:nope"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1
    assert bad.stderr.strip().startswith("error: unknown zoo model") and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- helpers


def test_parse_zoo_spec_coerces_values() -> None:
    assert parse_zoo_spec("zoo:gpt?layers=2&dropout=0.0&name=x&flag=true") == (
        "gpt", {"layers": 2, "dropout": 0.0, "name": "x", "flag": True})
    assert parse_zoo_spec("zoo:mlp") == ("mlp", {})
    assert parse_zoo_spec("zoo:resnet?widths=(32,64,128)&blocks_per_stage=2") == (
        "resnet", {"widths": (32, 64, 128), "blocks_per_stage": 2})
    assert parse_zoo_spec("zoo:resnet?widths=8,16") == ("resnet", {"widths": (8, 16)})


def test_load_target_zoo_batch_option_wins() -> None:
    target = load_target("zoo:mlp?depth=2&width=8&batch=3", batch=6)
    assert target.inputs[0].shape == (6, 8)


def test_parse_budget_option() -> None:
    assert parse_budget_option("0.5") == 0.5
    assert parse_budget_option("1000000") == 1_000_000
    assert parse_budget_option("2MiB") == "2MiB"
    assert parse_budget_option(None) is None
    with pytest.raises(BudgetError):
        parse_budget_option("-3")


def test_human_units() -> None:
    assert format_bytes(32768) == "32 KiB" and format_bytes(512) == "512 B"
    assert format_bytes(3.5 * 2**20) == "3.5 MiB" and format_bytes(3.5 * 2**20, "MiB") == "3.50 MiB"
    assert human_flops(4_194_304) == "4.19 MFLOP"


def test_nested_segments_are_indented_in_rows_and_table() -> None:
    from dataclasses import fields, replace

    from rich.console import Console

    import graphckpt
    from graphckpt.tools import report
    from passes.segments import Segment

    if "children" not in {f.name for f in fields(Segment)}:
        pytest.skip("this version of passes.plan has no nested segments")
    target = load_target(MLP)
    analysis = graphckpt.analyze(target.model, target.inputs, strategy="sqrt", segments=2)
    graph, plan = analysis.cost_graph, analysis.plan
    outer = plan.segments[0]
    half = len(outer.nodes) // 2
    inner = tuple(Segment(nodes, True, (), ()) for nodes in (outer.nodes[:half], outer.nodes[half:]))
    nested = replace(plan, segments=(replace(outer, children=inner), *plan.segments[1:]))
    document = report.plan_document(graph, nested, target=MLP, capture="fx", strategy="sqrt")
    rows = report.flatten_segments(document["segments"])
    assert [(r["index"], r["depth"]) for r in rows[:3]] == [("0", 0), ("0.0", 1), ("0.1", 1)]
    console = Console(record=True, width=160)
    console.print(report.inspect_view(document))
    assert "  0.1" in console.export_text()
