"""Precision debugging across pipeline stages: a pp=2 training run dumps in msprobe's layout
(every rank its stages, plus llmflow's layout.json), and `llmflow probe compare` puts the
stages together into one dump of the whole model that compares with a pp=1 run: every
record matched by name and equal, and a perturbed stage caught and located.

Three training launches, shared by the module: pp=2 (1F1B) and pp=1 dumping task tensor at
level mix, and pp=2 with Interleaved1F1B (two stages per rank) dumping statistics at level
mix, its layer 2 weights changed. The other tasks and levels are derived from the mix-level
tensor dumps: a dump of these runs at level L0 or L1, or with task statistics, holds the
same entries, records and call numbers as the mix-level tensor dump less the API entries,
the module entries or the saved tensors (``derived``).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from forked_workers import train_forked
from safetensors.torch import load_file, save_file
from test_probe import WORKER_ENV, process_state_restored, validate_dump

from llmflow.cli import main as cli_main
from llmflow.probe.compare.stages import OUTSIDE, REPEATED, SHARED_GRADIENT
from llmflow.probe.compare.tables import CompareConfig, compare_dumps

pytestmark = pytest.mark.slow  # three training launches

DECODER = "Module.model.DecoderModel"
TIED_GRADIENT = "Module.model.embed_tokens.Embedding.parameters_grad"
PERTURBED_WEIGHT = "model.layers.2.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def runs(sample_assets, tmp_path_factory) -> dict[str, Path]:
    """Step folders of the three runs (probe step 0 = the first training step), by name."""
    from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain
    from llmflow.train.config import TrainConfig

    root = tmp_path_factory.mktemp("pipeline")
    sample = sample_assets(documents=40, instruct_rows=20)  # tied embeddings, 4 layers
    tokenize_pretrain(PretrainTokenizeConfig(input=[sample / "pretrain" / "corpus.parquet"], tokenizer=sample / "model",
                                             out=root / "wiki", append_eod=True))
    perturbed = root / "perturbed-model"
    shutil.copytree(sample / "model", perturbed)
    weights = load_file(perturbed / "model.safetensors")
    weights[PERTURBED_WEIGHT] = weights[PERTURBED_WEIGHT] * 3
    save_file(weights, perturbed / "model.safetensors", metadata={"format": "pt"})

    layouts = {
        "pp2": (2, "tensor", sample / "model", {"pp": 2}),
        "pp1": (1, "tensor", sample / "model", {}),
        "pp2-perturbed": (2, "statistics", perturbed, {"pp": 2, "pp_schedule": "Interleaved1F1B", "virtual_stages": 2}),
    }
    with process_state_restored():
        for name, (nproc, task, model, train) in layouts.items():
            probe = root / f"{name}.json"
            probe.write_text(json.dumps({"task": task, "dump_path": str(root / name), "step": [0], "level": "mix"}))
            config = TrainConfig.model_validate({
                "model": str(model), "out": str(root / f"run-{name}"), "data": {"paths": [str(root / "wiki")]},
                "seq_length": 32, "micro_batch_size": 2, "global_batch_size": 4, "steps": 1, "deterministic": True,
                "probe": str(probe), "save_interval": None, **train})
            train_forked(config, nproc, env=WORKER_ENV, process_group=True)
    return {name: root / name / "step0" for name in layouts}


def derived(step: Path, out: Path, level: str = "mix", task: str = "statistics") -> Path:
    """A copy of a mix-level dump as the dumper writes it at ``level`` with ``task`` (see the
    module's docstring): L0 keeps the module entries, L1 the API entries; statistics drops
    the saved tensors."""
    keep = {"mix": lambda name: True, "L0": lambda name: name.startswith("Module."),
            "L1": lambda name: not name.startswith("Module.")}[level]

    def without_files(value):
        if isinstance(value, dict):
            return {k: without_files(v) for k, v in value.items() if k != "data_name"}
        return [without_files(v) for v in value] if isinstance(value, list) else value

    for rank in sorted(p for p in step.iterdir() if p.name.startswith("rank")):
        target = out / rank.name
        target.mkdir(parents=True)
        dump = json.loads((rank / "dump.json").read_text())
        dump["level"] = level
        dump["data"] = {name: entry for name, entry in dump["data"].items() if keep(name)}
        if task == "statistics":
            dump.update(task="statistics", dump_data_dir=None, data=without_files(dump["data"]))
        stacks = {key: [[n for n in names if keep(n)], frames] for key, (names, frames)
                  in json.loads((rank / "stack.json").read_text()).items()}
        construct = json.loads((rank / "construct.json").read_text())
        layout = json.loads((rank / "layout.json").read_text())
        for call in layout["calls"]:
            call["counts"] = {key: span for key, span in call["counts"].items() if keep(key)}
        for name, payload in (("dump.json", dump), ("layout.json", layout),
                              ("stack.json", {str(i): group for i, group in enumerate(g for g in stacks.values() if g[0])}),
                              ("construct.json", {k: v for k, v in construct.items() if keep(k)} if level != "L1" else {})):
            (target / name).write_text(json.dumps(payload))
        if task == "tensor":
            shutil.copytree(rank / "dump_tensor_data", target / "dump_tensor_data")
    return out


def test_each_stage_dumps_its_modules_under_the_whole_models_names(runs):
    pp2, pp1 = runs["pp2"], runs["pp1"]
    stages = [validate_dump(pp2 / rank)["data"] for rank in ("rank0", "rank1")]
    whole = validate_dump(pp1 / "rank0")["data"]
    modules = [{name for name in data if name.startswith("Module.")} for data in stages]
    # The stages record every module call of the pp=1 run, under the same names and numbers
    # (pipelining's metadata inference, a third forward in this first step, is not recorded)...
    assert modules[0] | modules[1] == {name for name in whole if name.startswith("Module.")}
    # ...and share the decoder, which each runs over its layers, and the tied embedding's
    # gradient: the first stage's embedding part, the last stage's output projection part.
    assert modules[0] & modules[1] == {f"{DECODER}.{d}.{n}" for d in ("forward", "backward") for n in (0, 1)} | {
        f"{TIED_GRADIENT}.{n}" for n in (0, 1)}
    assert "Module.model.layers.1.DecoderLayer.forward.0" in modules[0] and "Module.model.norm.RMSNorm.forward.1" in modules[1]
    # API calls are numbered per rank: both stages have a Functional.linear.0.
    assert "Functional.linear.0.forward" in stages[0] and "Functional.linear.0.forward" in stages[1]

    layout = json.loads((pp2 / "rank1" / "layout.json").read_text())
    assert {k: layout[k] for k in ("rank", "stages", "num_stages", "pipeline_group", "meshes")} == {
        "rank": 1, "stages": [1], "num_stages": 2, "pipeline_group": [0, 1], "meshes": []}
    assert [call["stage"] for call in layout["calls"]] == [1, 1]  # one forward per micro-batch
    assert [call["counts"][f"{DECODER}."] for call in layout["calls"]] == [[0, 1], [1, 2]]
    interleaved = json.loads((runs["pp2-perturbed"] / "rank0" / "layout.json").read_text())
    assert interleaved["stages"] == [0, 2] and interleaved["num_stages"] == 4
    assert [call["stage"] for call in interleaved["calls"]] == [0, 0, 2, 2]  # Interleaved1F1B's order on rank 0


def _rows(report) -> list:
    (rank,) = report.ranks
    assert rank.rank == "rank0-1"
    return rank.rows


def _check_whole_comparison(rows, out: Path, mode: str, level: str = "mix") -> None:
    """Every value of the pp=2 run matched by name and equal to pp=1's, but those that have no
    counterpart by construction, each left uncompared with its reason."""
    origins = json.loads((out / "merged_names.json").read_text())["target"]
    stacks = {row.leaf.entry: row.stack for row in rows if row.stack}
    uncompared = [row for row in rows if row.result != "pass"]
    assert all(row.result == "N/A" for row in uncompared), [(r.leaf.name, r.messages) for r in uncompared if r.result != "N/A"]
    for row in uncompared:
        (message,) = row.messages
        parts = origins[row.leaf.entry]
        stack = stacks.get(row.leaf.entry.replace(".backward", ".forward"), [""])
        if message == REPEATED:  # the rotary tables the second stage computes again
            assert parts == [["rank1", parts[0][1], 1]] and "in rotary_cos_sin" in stack[0], row.leaf.name
        elif message == OUTSIDE:  # the training loop's and the schedule's own tensor work
            assert any(place in stack[0] for place in ("llmflow/train/run.py", "llmflow/train/loop.py",
                                                       "models/pipeline.py")), row.leaf.name
        else:  # statistics of the tied weight's gradient parts do not give their sum
            assert mode != "tensor" and row.leaf.entry.startswith(TIED_GRADIENT), row.leaf.name
            assert message.startswith(SHARED_GRADIENT.format(stages=[0, 1], why="")), message
    if level == "L1":
        return
    names = {row.leaf.name for row in rows if row.result == "pass"}
    assert {name for name in names if name.startswith("Module.")} >= {
        f"{DECODER}.forward.0.input.0", f"{DECODER}.forward.0.output.0", f"{DECODER}.backward.1.input.0",
        "Module.model.layers.3.mlp.down_proj.Linear.forward.1.parameters.weight"}
    # The decoder's record: the first stage's inputs, the last stage's outputs.
    assert [part[0] for part in origins[f"{DECODER}.forward.0"]] == ["rank0", "rank1"]


def test_pp2_compares_whole_against_pp1_in_tensor_mode(runs, tmp_path):
    out = tmp_path / "cmp"
    report = compare_dumps(CompareConfig(target=runs["pp2"], bench=runs["pp1"], out=out))
    assert report.advice.startswith("[rank0-1] compare_result_rank0-1.csv\nEvery compared value meets the accuracy rules.\n")
    _check_whole_comparison(_rows(report), out, "tensor")
    with open(out / "compare_result_rank0-1.csv", newline="") as f:
        table = {row["NPU Name"]: row for row in csv.DictReader(f)}
    compared = [row for row in table.values() if row["Result"] == "pass" and row["MaxAbsErr"] not in ("unsupported", "N/A")]
    # The same kernels on the same data: pp=2 computes every value of pp=1 exactly.
    assert len(compared) > 2500 and all(float(row["MaxAbsErr"]) == 0.0 for row in compared)
    # The tied embedding's gradient: the stages' parts, summed from their saved tensors.
    for n in (0, 1):
        assert table[f"{TIED_GRADIENT}.{n}.weight"]["Result"] == "pass"
        assert float(table[f"{TIED_GRADIENT}.{n}.weight"]["Cosine"]) == 1.0


@pytest.mark.parametrize("level", ["mix", "L0", "L1"])
def test_pp2_compares_whole_against_pp1_in_statistics_mode(runs, tmp_path, level, capsys):
    target, bench = (derived(runs[name], tmp_path / name, level) for name in ("pp2", "pp1"))
    cli_main(["probe", "compare", str(target), str(bench), "--out", str(tmp_path / "cli")])
    assert "\nEvery compared value meets the accuracy rules.\n" in capsys.readouterr().out
    report = compare_dumps(CompareConfig(target=target, bench=bench, out=tmp_path / "cmp"))
    rows = _rows(report)
    _check_whole_comparison(rows, tmp_path / "cmp", "statistics", level)
    assert report.advice.startswith("[rank0-1] compare_result_rank0-1.csv\nEvery compared value meets the accuracy rules.\n")
    matched = [row for row in rows if row.result == "pass"]
    assert len(matched) > {"mix": 3000, "L0": 700, "L1": 2300}[level]
    assert all(row.stat_errors.get("Norm", 0.0) == 0.0 for row in matched)
    apis = {row.leaf.entry.rsplit(".", 2)[0] for row in matched if not row.leaf.entry.startswith("Module.")}
    assert ("Functional.linear" in apis) == (level != "L0")
    assert any(row.leaf.entry.startswith("Module.") for row in matched) == (level != "L1")


def test_a_perturbed_stage_is_caught_and_located(runs, tmp_path):
    bench = derived(runs["pp1"], tmp_path / "pp1")
    report = compare_dumps(CompareConfig(target=runs["pp2-perturbed"], bench=bench, out=tmp_path / "cmp"))
    rows = _rows(report)
    weight = "Module.model.layers.2.mlp.down_proj.Linear.forward.0.parameters.weight"
    # Interleaved over two ranks, layer 2 is stage 2 of 4, on rank 0.
    assert "\nDumped as: Functional.linear." in report.advice and " in rank0 (pipeline stage 2)\n" in report.advice
    assert f"\nWeight: {weight}\nLikely cause: weight\n" in report.advice
    flagged = [row for row in rows if row.result in ("warning", "error")]
    assert flagged[0].leaf.name == "Module.model.layers.2.mlp.MLP.forward.0.output.0"
    before = rows[: rows.index(flagged[0])]
    assert all(row.result in ("pass", "N/A") for row in before) and any("layers.1." in row.leaf.name for row in before)


def test_a_value_changed_between_stages_is_flagged(runs, tmp_path):
    """The pipeline sends a stage's output as is: a stage that received something else is caught."""
    target, bench = (derived(runs[name], tmp_path / name, "L0") for name in ("pp2", "pp1"))
    dump = json.loads((target / "rank1" / "dump.json").read_text())
    dump["data"][f"{DECODER}.forward.1"]["input_args"][0]["Norm"] *= 1.5
    (target / "rank1" / "dump.json").write_text(json.dumps(dump))
    rows = _rows(compare_dumps(CompareConfig(target=target, bench=bench, out=tmp_path / "cmp")))
    (flagged,) = [row for row in rows if row.result == "warning"]
    assert flagged.leaf.name == f"{DECODER}.forward.1.output.0"
    assert flagged.messages[0].startswith("stage 0's output 0 is not stage 1's (the pipeline sends it as is): Norm ")


def test_runs_of_the_same_pipeline_layout_compare_rank_by_rank(runs, tmp_path):
    target, bench = (derived(runs["pp2"], tmp_path / name, "L0") for name in ("a", "b"))
    report = compare_dumps(CompareConfig(target=target, bench=bench, out=tmp_path / "cmp"))
    assert [rank.rank for rank in report.ranks] == ["rank0", "rank1"]
    assert all(row.result == "pass" for rank in report.ranks for row in rank.rows)
    assert not (tmp_path / "cmp" / "merged_names.json").exists()
