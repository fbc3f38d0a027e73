"""llmflow's precision compare against mindstudio-probe's own: the real `msprobe compare`
(mindstudio-probe 26.2, installed by the dev extra) and `llmflow probe compare` read the same
dumps of the tiny model, one run with its first down_proj weight scaled by 3, and must write
the same table, column by column and verdict by verdict; the advisor names the call that
`msprobe compare -da` names, and the weight."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_probe import DOWN_PROJ, MLP, dumped_step, process_state_restored

from llmflow.probe.compare.tables import CROSS_LAYOUT_NOISE_FLOOR, CompareConfig, compare_dumps

pytestmark = pytest.mark.slow  # each msprobe run starts a process that imports torch (~8 s)

MODES = {"statistics": {"task": "statistics"}, "tensor": {"task": "tensor"}}
FLOAT_TOLERANCE = 1e-12
"""Relative tolerance for cells that are numbers; every other cell must be the same string."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(target, bench) step folders per mode: the target's down_proj weight of layer 0 scaled by 3."""
    root = tmp_path_factory.mktemp("msprobe")
    with process_state_restored():
        return {mode: (dumped_step(root / f"{mode}-target", weight_scale=3.0, level="mix", **probe),
                       dumped_step(root / f"{mode}-bench", level="mix", **probe)) for mode, probe in MODES.items()}


def msprobe(*args: str) -> None:
    """Run mindstudio-probe's command line (the one next to this interpreter)."""
    command = shutil.which("msprobe", path=str(Path(sys.executable).parent)) or "msprobe"
    done = subprocess.run([command, *args], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def table(folder: Path) -> list[dict[str, str]]:
    (path,) = folder.glob("compare_result_*.csv")
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def same_cell(ours: str, theirs: str) -> bool:
    if ours == theirs:
        return True
    try:
        return math.isclose(float(ours), float(theirs), rel_tol=FLOAT_TOLERANCE, abs_tol=0.0)
    except ValueError:
        return False


@pytest.mark.parametrize("mode", MODES)
def test_compare_writes_msprobe_compare_table(runs, mode, tmp_path):
    target, bench = runs[mode]
    msprobe("compare", "-tp", str(target / "rank" / "dump.json"), "-gp", str(bench / "rank" / "dump.json"),
            "-o", str(tmp_path / "msprobe"))
    theirs = table(tmp_path / "msprobe")
    compare_dumps(CompareConfig(target=target, bench=bench, out=tmp_path / "llmflow"))
    ours = table(tmp_path / "llmflow")

    assert list(ours[0]) == list(theirs[0])  # the same columns in the same order
    assert [row["NPU Name"] for row in ours] == [row["NPU Name"] for row in theirs]  # the same rows in the same order
    differing = [(mine["NPU Name"], column, mine[column], other[column]) for mine, other in zip(ours, theirs, strict=True)
                 for column in other if not same_cell(mine[column], other[column])]
    assert differing == []
    flagged = [row["NPU Name"] for row in theirs if row["Result"] != "pass"]
    assert f"{MLP}.output.0" in flagged  # the comparison has verdicts to agree on
    if mode == "statistics":
        assert any(row["NormRelativeErr"].endswith("%") for row in theirs) and any(row["Max diff"] == "0" for row in theirs)


@pytest.mark.parametrize("mode", MODES)
def test_advisor_names_the_first_diverging_linear_and_its_weight(runs, mode, tmp_path):
    target, bench = runs[mode]
    # msprobe's first-diff analysis reads the step folders' statistics in either mode
    msprobe("compare", "-tp", str(target), "-gp", str(bench), "-o", str(tmp_path / "da"), "-da")
    (analysis,) = (tmp_path / "da").glob("diff_analyze_*.json")
    (first,) = json.loads(analysis.read_text())["rank_0"]
    call = first["op_name"]
    assert call.startswith("Functional.linear.")

    report = compare_dumps(CompareConfig(target=target, bench=bench, out=tmp_path / "llmflow"))
    rows = report.ranks[0].rows
    line = next(i for i, row in enumerate(rows) if row.leaf.entry == call) + 2
    weight = f"{DOWN_PROJ}.parameters.weight"
    assert f"Suspect Nodes: {call}\nLine: {line}\n" in report.advice
    assert f"\nWeight: {weight}\nLikely cause: weight\n" in report.advice
    assert f"The weight {weight} differs between the runs" in report.advice
    assert "models/decoder.py" in report.advice  # the call stack
    # ...and the first row msprobe's rules flag, at its line in the table
    flagged = next(i for i, row in enumerate(rows) if row.result != "pass")
    assert f"First row the accuracy rules flag: Line {flagged + 2}, {rows[flagged].leaf.name} (" in report.advice


def test_the_noise_floor_is_off_by_default_and_reported_when_on(runs, tmp_path):
    target, bench = runs["statistics"]
    assert CompareConfig(target=target, bench=bench, out=tmp_path / "a").norm_noise_floor == 0.0
    default = compare_dumps(CompareConfig(target=target, bench=bench, out=tmp_path / "a"))
    assert "Noise floor" not in default.advice
    floored = compare_dumps(CompareConfig(target=target, bench=bench, out=tmp_path / "b",
                                          norm_noise_floor=CROSS_LAYOUT_NOISE_FLOOR))
    assert floored.advice.endswith("\nNoise floor on: norm relative errors below 1e-05 count as agreement in the "
                                   "accuracy rules (norm_noise_floor, for runs of different parallel layouts); msprobe's "
                                   "own verdicts may differ.\n")
    assert (tmp_path / "b" / "advisor.txt").read_text() == floored.advice
