"""Precision debugging: the probe config, dumps in msprobe's schema at every level and task,
deterministic runs that compare equal, the advisor naming a perturbed module, and a dump
made by the real training worker."""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

from llmflow.cli import main as cli_main
from llmflow.models import CausalLM, ModelConfig
from llmflow.probe import Dumper, ProbeConfig, load_probe_config, seed_all
from llmflow.probe.advisor import first_divergence
from llmflow.probe.compare import CompareConfig, compare_dumps
from llmflow.probe.config import expand_ranges

# --- msprobe's dump schema ------------------------------------------------------------------------------
# Written from msprobe's documentation (Ascend/mstt): the dump.json examples and field list of
# debug/accuracy_tools/msprobe/docs/27.dump_json_instruction.md (section 1, PyTorch: L0, L1, mix)
# and docs/zh/dump/pytorch_data_dump_instruct.md section 3 (the step{N}/rank{R} layout,
# Module.{name}.{class}.{forward|backward}.{n}, Module...parameters_grad.{n}, {api_type}.{api}.{n}.{forward|backward},
# "md5" in md5 mode, "data_name" in tensor mode, stack.json, construct.json).

TENSOR_RECORD = {
    "type": "object",
    "properties": {
        "type": {"const": "torch.Tensor"},
        "dtype": {"type": "string", "pattern": r"^torch\.\w+$"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "Max": {"type": ["number", "boolean", "null"]},
        "Min": {"type": ["number", "boolean", "null"]},
        "Mean": {"type": ["number", "null"]},
        "Norm": {"type": ["number", "null"]},
        "requires_grad": {"type": "boolean"},
        "md5": {"type": "string", "pattern": "^[0-9a-f]{8}$"},
        "data_name": {"type": "string", "pattern": r"\.pt$"},
    },
    "required": ["type", "dtype", "shape", "Max", "Min", "Mean", "Norm", "requires_grad"],
    "additionalProperties": False,
}
VALUE_RECORD = {
    "type": "object",
    "properties": {"type": {"type": "string"}, "value": {}},
    "required": ["type", "value"],
    "additionalProperties": False,
}
ARGUMENT = {
    "anyOf": [
        {"$ref": "#/$defs/tensor"},
        {"$ref": "#/$defs/value"},
        {"type": "null"},
        {"type": "array", "items": {"$ref": "#/$defs/argument"}},
    ]
}
ARGUMENTS = {"type": "array", "items": {"$ref": "#/$defs/argument"}}
FORWARD = {
    "type": "object",
    "properties": {
        "input_args": ARGUMENTS,
        "input_kwargs": {"type": "object", "additionalProperties": {"$ref": "#/$defs/argument"}},
        "output": ARGUMENTS,
        "parameters": {"type": "object", "additionalProperties": {"$ref": "#/$defs/tensor"}},
    },
    "additionalProperties": False,
}
BACKWARD = {"type": "object", "properties": {"input": ARGUMENTS, "output": ARGUMENTS}, "additionalProperties": False}
PARAMETERS_GRAD = {"type": "object", "additionalProperties": {"type": "array", "items": {"$ref": "#/$defs/tensor"}}}
DUMP_SCHEMA = {
    "$defs": {"tensor": TENSOR_RECORD, "value": VALUE_RECORD, "argument": ARGUMENT},
    "type": "object",
    "properties": {
        "task": {"enum": ["statistics", "tensor"]},
        "level": {"enum": ["L0", "L1", "mix"]},
        "framework": {"const": "pytorch"},
        "dump_data_dir": {"type": ["string", "null"]},
        "data": {
            "type": "object",
            "patternProperties": {
                r"^Module\.[\w.]+\.\w+\.forward\.\d+$": FORWARD,
                r"^(Functional|Torch|Tensor)\.\w+\.\d+\.forward$": FORWARD,
                r"^Module\.[\w.]+\.\w+\.backward\.\d+$": BACKWARD,
                r"^(Functional|Torch|Tensor)\.\w+\.\d+\.backward$": BACKWARD,
                r"^Module\.[\w.]+\.\w+\.parameters_grad\.\d+$": PARAMETERS_GRAD,
            },
            "additionalProperties": False,
        },
    },
    "required": ["task", "level", "framework", "dump_data_dir", "data"],
    "additionalProperties": False,
}
STACK_SCHEMA = {  # {"0": [[names sharing the stack], ["File ..., line N, in f, \n code", ...]]}
    "type": "object",
    "patternProperties": {
        r"^\d+$": {
            "type": "array",
            "prefixItems": [{"type": "array", "items": {"type": "string"}}, {"type": "array", "items": {"type": "string"}}],
            "minItems": 2,
            "maxItems": 2,
        }
    },
    "additionalProperties": False,
}
CONSTRUCT_SCHEMA = {"type": "object", "additionalProperties": {"type": ["string", "null"]}}


def validate_dump(rank_dir: Path) -> dict:
    dump = json.loads((rank_dir / "dump.json").read_text())
    jsonschema.validate(dump, DUMP_SCHEMA)
    jsonschema.validate(json.loads((rank_dir / "stack.json").read_text()), STACK_SCHEMA)
    jsonschema.validate(json.loads((rank_dir / "construct.json").read_text()), CONSTRUCT_SCHEMA)
    return dump


# --- a tiny model and one dumped step ------------------------------------------------------------------

MLP = "Module.model.layers.0.mlp.MLP.forward.0"


@contextlib.contextmanager
def process_state_restored() -> Iterator[None]:
    """seed_all changes process-wide state (environment, deterministic algorithms): put it back."""
    enabled = torch.are_deterministic_algorithms_enabled()
    with pytest.MonkeyPatch.context() as patch:
        for var in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC", "CLOSE_MATMUL_K_SHIFT"):
            patch.delenv(var, raising=False)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(enabled)


@pytest.fixture
def deterministic() -> Iterator[None]:
    with process_state_restored():
        yield


def tiny_model() -> CausalLM:
    config = ModelConfig.from_hf(
        {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "torch_dtype": "float32"}
    )
    model = CausalLM(config)
    model.init_weights()
    return model


def dumped_step(dump_path: Path, perturb: float | None = None, **probe) -> Path:
    """Dump one forward/backward step of the tiny model in deterministic mode, the first MLP's
    output multiplied by ``perturb`` if given; returns the step folder."""
    seed_all(0)
    model = tiny_model()
    if perturb is not None:

        def scale(module, args, output):
            # Stands for a wrong kernel inside the module: not an API call of its own.
            with torch._C.DisableTorchFunction():
                return output * perturb

        model.model.layers["0"].mlp.register_forward_hook(scale)
    dumper = Dumper(ProbeConfig(dump_path=dump_path, **probe), model)
    ids = torch.randint(0, 96, (2, 16))
    with dumper.step(0):
        model(ids, labels=ids, loss_reduction="sum").backward()
    return dump_path / "step0"


MODES = {
    "statistics": {"task": "statistics"},
    "md5": {"task": "statistics", "statistics": {"summary_mode": "md5"}},
    "tensor": {"task": "tensor"},
}


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Two deterministic mix-level dumps of the same step, per mode."""
    root = tmp_path_factory.mktemp("probe")
    with process_state_restored():
        return {mode: tuple(dumped_step(root / f"{mode}-{i}", level="mix", **probe) for i in (1, 2)) for mode, probe in MODES.items()}


# --- config ------------------------------------------------------------------------------------------


def test_step_and_rank_ranges(tmp_path):
    assert expand_ranges([0, "4-6", "9"], "step") == {0, 4, 5, 6, 9}
    config = ProbeConfig(dump_path=tmp_path, step=[0, "4-6"], rank=["1-2"])
    assert config.dumps(5, 1) and not config.dumps(3, 1) and not config.dumps(5, 0)
    assert ProbeConfig(dump_path=tmp_path).dumps(123, 7)  # empty lists: every step, every rank
    with pytest.raises(ValueError, match=r"step\[1\]: '6-4' is neither a number nor a range"):
        ProbeConfig(dump_path=tmp_path, step=[0, "6-4"])

    # msprobe's stock config.json loads as is; bad values name their key.
    stock = {"task": "statistics", "dump_path": str(tmp_path), "rank": [], "step": [], "level": "L1", "enable_dataloader": False,
             "tensor": {"scope": [], "list": [], "data_mode": ["all"], "file_format": "npy"},
             "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
             "overflow_check": {"overflow_nums": 1}, "run_ut": {"white_list": []}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(stock))
    assert load_probe_config(path).level == "L1"
    path.write_text(json.dumps({**stock, "level": "L2", "statistics": {"data_mode": ["all", "forward"]}}))
    with pytest.raises(ValueError, match=r"level: Input should be 'L0', 'L1' or 'mix'.*statistics\.data_mode: .*\"all\" cannot be combined"):
        load_probe_config(path)


# --- dumps ---------------------------------------------------------------------------------------------


def test_mix_dump_follows_msprobe_schema(clean_runs):
    rank_dir = clean_runs["statistics"][0] / "rank"  # "rank" without a process group, as msprobe names it
    data = validate_dump(rank_dir)["data"]
    linear = "Module.model.layers.0.mlp.down_proj.Linear"
    for name in (f"{linear}.forward.0", f"{linear}.backward.0", f"{linear}.parameters_grad.0", MLP,
                 "Functional.linear.0.forward", "Functional.linear.0.backward", "Tensor.add.0.forward", "Torch.cat.0.forward"):
        assert name in data, name
    down = data[f"{linear}.forward.0"]
    assert list(down) == ["input_args", "input_kwargs", "output", "parameters"]
    assert down["parameters"]["weight"]["shape"] == [32, 64] and down["output"][0]["shape"] == [2, 16, 32]
    assert data[f"{linear}.backward.0"]["input"][0]["shape"] == [2, 16, 32]  # gradient of the output
    construct = json.loads((rank_dir / "construct.json").read_text())
    assert construct[f"{linear}.forward.0"] == MLP and construct[MLP] == "Module.model.layers.0.DecoderLayer.forward.0"
    assert construct[f"{linear}.backward.0"] == MLP.replace("forward", "backward")
    linear_api = next(name for name, parent in construct.items() if parent == f"{linear}.forward.0")
    assert linear_api.startswith("Functional.linear.")
    stacks = {name: frames for names, frames in json.loads((rank_dir / "stack.json").read_text()).values() for name in names}
    assert any("models/decoder.py" in frame for frame in stacks[MLP])


def test_list_and_data_mode_select_what_is_dumped(tmp_path, deterministic):
    step = dumped_step(tmp_path, level="L0", statistics={"list": ["down_proj"], "data_mode": ["forward"]})
    data = validate_dump(step / "rank")["data"]
    assert sorted(data) == [f"Module.model.layers.{i}.mlp.down_proj.Linear.forward.0" for i in (0, 1)]
    assert json.loads((step / "rank" / "construct.json").read_text())  # L0 records the module structure


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_runs_compare_equal(clean_runs, mode, tmp_path, capsys):
    first, second = clean_runs[mode]
    dump = validate_dump(first / "rank")
    tensors = [r for entry in dump["data"].values() for part in entry.values() for r in part if isinstance(r, dict)]
    if mode == "md5":
        assert all("md5" in r for r in tensors if r.get("type") == "torch.Tensor")
    if mode == "tensor":
        assert dump["dump_data_dir"] == str(first / "rank" / "dump_tensor_data")
        saved = [r for r in tensors if "data_name" in r]
        assert saved and all((first / "rank" / "dump_tensor_data" / r["data_name"]).is_file() for r in saved)

    cli_main(["probe", "compare", str(first), str(second), "--out", str(tmp_path / "cmp")])
    assert "Every compared value meets the accuracy rules." in capsys.readouterr().out
    with open(tmp_path / "cmp" / "compare_result_rank.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) > 500 and all(row["Result"] == "pass" for row in rows)
    zero = {"statistics": ["Max diff", "Min diff", "Mean diff", "L2norm diff"], "tensor": ["EucDist", "MaxAbsErr"], "md5": []}[mode]
    for row in rows:
        assert all(row[column] in ("0.0", "N/A") for column in zero), row["NPU Name"]
        if mode == "md5":
            assert row["NPU MD5"] == row["BENCH MD5"]
    assert (tmp_path / "cmp" / "manifest.json").is_file()


# msprobe's statistics rules flag an output whose norm moved by more than 10% while its inputs
# agree (smaller changes pass them); the tensor and md5 rules catch a 1% change.
PERTURBATION = {"statistics": 1.2, "md5": 1.01, "tensor": 1.01}


@pytest.mark.parametrize("mode", MODES)
def test_advisor_names_the_perturbed_mlp(clean_runs, mode, tmp_path, deterministic):
    perturbed = dumped_step(tmp_path / "perturbed", perturb=PERTURBATION[mode], level="mix", **MODES[mode])
    report = compare_dumps(CompareConfig(target=perturbed, bench=clean_runs[mode][0], out=tmp_path / "cmp"))
    _, row = first_divergence(report.ranks[0].rows)
    assert (row.leaf.entry, row.leaf.side) == (MLP, "output")
    assert f"Suspect Nodes: {MLP}\n" in report.advice
    assert "Likely cause: forward computation" in report.advice
    assert "models/decoder.py" in report.advice  # the call stack
    assert (tmp_path / "cmp" / "advisor.txt").read_text() == report.advice


# --- the training worker -----------------------------------------------------------------------------


def test_training_worker_dumps_the_listed_steps(tmp_path, deterministic):
    from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain
    from llmflow.sample import SampleConfig, write_sample
    from llmflow.train.command import launch_training
    from llmflow.train.config import TrainConfig
    from llmflow.train.loop import train

    sample = write_sample(SampleConfig(out=tmp_path / "sample", documents=40, instruct_rows=20))
    tokenize_pretrain(PretrainTokenizeConfig(input=[sample / "pretrain" / "corpus.parquet"], tokenizer=sample / "model",
                                             out=tmp_path / "wiki", append_eod=True))

    def config(name: str) -> TrainConfig:
        probe = tmp_path / f"{name}.json"
        probe.write_text(json.dumps({"task": "statistics", "dump_path": str(tmp_path / name), "step": [1], "level": "mix"}))
        return TrainConfig.model_validate({
            "model": str(sample / "model"), "out": str(tmp_path / f"run-{name}"),
            "data": {"paths": [str(tmp_path / "wiki")]}, "steps": 3, "seq_length": 32, "micro_batch_size": 2,
            "global_batch_size": 4, "deterministic": True, "probe": str(probe),
        })

    launch_training(config("worker"), 1, on_line=lambda line: None, env={"OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu"})
    assert [p.name for p in (tmp_path / "worker").iterdir()] == ["step1"]  # probe step 1 = training step 2
    data = validate_dump(tmp_path / "worker" / "step1" / "rank0")["data"]
    assert MLP in data and MLP.replace("forward.0", "forward.1") in data  # both micro-batches

    # The same run in this process (no process group: folder "rank") dumps the same values,
    # given the worker's thread count (CPU matmuls may split their sums by thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(config("local"))
    finally:
        torch.set_num_threads(threads)
    report = compare_dumps(CompareConfig(target=tmp_path / "worker" / "step1", bench=tmp_path / "local" / "step1",
                                         out=tmp_path / "cmp"))
    assert all(row.result == "pass" for row in report.ranks[0].rows)
