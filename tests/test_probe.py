"""Precision debugging: the probe config, dumps in msprobe's schema at every level and task,
deterministic runs that compare equal, the advisor naming a perturbed module, dumps made by
the real training worker, and runs of other layouts (tp=2, cp=2) compared with one process."""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch
from forked_workers import train_forked
from test_frontier_flows import FAMILIES as FRONTIER

from llmflow.cli import main as cli_main
from llmflow.models import CausalLM, ModelConfig
from llmflow.probe import Dumper, ProbeConfig, load_probe_config, seed_all
from llmflow.probe.compare.advisor import first_divergence
from llmflow.probe.compare.merge import (
    CP_GRADIENT_PARTS,
    CP_LOCAL,
    CP_OUTSIDE,
    CP_REDUCTION,
    CP_SIZE,
    merge_context_parallel,
    merge_ranks,
)
from llmflow.probe.compare.reading import Leaf, RankDump, load_tensor
from llmflow.probe.compare.tables import CROSS_LAYOUT_NOISE_FLOOR, CompareConfig, compare_dumps
from llmflow.probe.dump.config import expand_ranges

# --- msprobe's dump schema ------------------------------------------------------------------------------
# Written from msprobe's documentation (Ascend/mstt): the dump.json examples and field list of
# debug/accuracy_tools/msprobe/docs/27.dump_json_instruction.md (section 1, PyTorch: L0, L1, mix)
# and docs/zh/dump/pytorch_data_dump_instruct.md section 3 (the step{N}/rank{R} layout,
# Module.{name}.{class}.{forward|backward}.{n}, Module...parameters_grad.{n}, {api_type}.{api}.{n}.{forward|backward},
# "md5" in md5 mode, "data_name" in tensor mode, stack.json, construct.json).

TENSOR_RECORD = {
    "type": "object",
    "properties": {
        "type": {"enum": ["torch.Tensor", "torch.distributed.tensor.DTensor"]},
        "dtype": {"type": "string", "pattern": r"^torch\.\w+$"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "Max": {"type": ["number", "boolean", "null"]},
        "Min": {"type": ["number", "boolean", "null"]},
        "Mean": {"type": ["number", "null"]},
        "Norm": {"type": ["number", "null"]},
        "requires_grad": {"type": "boolean"},
        "md5": {"type": "string", "pattern": "^[0-9a-f]{8}$"},
        "data_name": {"type": "string", "pattern": r"\.pt$"},
        # DTensors (msprobe's PyTorch data processor, get_dtensor_info): the mesh's ranks and the placements.
        "device_mesh": {"type": "array"},
        "placements": {
            "type": "array",
            "items": {"oneOf": [
                {"type": "object", "properties": {"Shard": {"type": "object", "properties": {"dim": {"type": "integer"}},
                                                           "required": ["dim"]}}, "required": ["Shard"]},
                {"type": "object", "properties": {"Replicate": {"const": {}}}, "required": ["Replicate"]},
                {"type": "object", "properties": {"Partial": {"type": "object", "properties": {"reduce_op": {"type": "string"}},
                                                             "required": ["reduce_op"]}}, "required": ["Partial"]},
            ]},
        },
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


DOWN_PROJ = "Module.model.layers.0.mlp.down_proj.Linear.forward.0"


def dumped_step(dump_path: Path, perturb: float | None = None, weight_scale: float | None = None,
                model: Callable[[], CausalLM] = tiny_model, perturbed: str = "mlp", **probe) -> Path:
    """Dump one forward/backward step of ``model()`` (the tiny model) in deterministic mode, the
    output of the first layer's ``perturbed`` module multiplied by ``perturb`` if given, or its
    down_proj weight by ``weight_scale``; returns the step folder."""
    seed_all(0)
    model = model()
    if weight_scale is not None:
        with torch.no_grad():
            model.model.layers["0"].mlp.down_proj.weight.mul_(weight_scale)
    if perturb is not None:

        def scale(module, args, output):
            # Stands for a wrong kernel inside the module: not an API call of its own.
            with torch._C.DisableTorchFunction():
                return output * perturb

        model.model.layers["0"].get_submodule(perturbed).register_forward_hook(scale)
    dumper = Dumper(ProbeConfig(dump_path=dump_path, **probe), model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
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
    # The output projection's gradient, though the loss uses its weight without calling it.
    assert "Module.lm_head.Linear.parameters_grad.0" in data and "Module.lm_head.Linear.forward.0" not in data
    # llmflow's layout.json: one stage outside pipelining, and the numbers its forward call took.
    layout = json.loads((rank_dir / "layout.json").read_text())
    assert {k: layout[k] for k in ("rank", "stages", "num_stages", "pipeline_group", "meshes")} == {
        "rank": None, "stages": [0], "num_stages": 1, "pipeline_group": None, "meshes": []}
    (call,) = layout["calls"]
    assert call["stage"] == 0 and call["counts"]["Module.model.layers.0.mlp.MLP."] == [0, 1]
    assert call["counts"]["Functional.linear"][0] == 0


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
        # msprobe writes "0" for equal statistics, and computes no tensor metric of a non-tensor
        assert all(row[column] in ("0", "0.0", "unsupported") for column in zero), row["NPU Name"]
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


@pytest.mark.parametrize("family", list(FRONTIER))
def test_frontier_families_dump_compare_equal_and_locate_a_perturbed_attention(family, make_hf_model, tmp_path,
                                                                               deterministic):
    """The frontier blocks (DeepSeek-V3's latent attention and grouped experts, GLM-4.5, gpt-oss's
    sinks and biased experts, Gemma 3's sandwich norms) dump in msprobe's schema, two
    deterministic steps compare equal, and the advisor names the first layer's attention when
    its output is 1% off."""
    from llmflow.weights import load_hf_model

    _, path = make_hf_model(family, **FRONTIER[family])
    model = functools.partial(load_hf_model, path)
    clean, again, perturbed = (dumped_step(tmp_path / name, model=model, perturbed="self_attn", task="tensor",
                                           level="mix", perturb=perturb)
                               for name, perturb in (("clean", None), ("again", None), ("perturbed", 1.01)))
    attention = f"Module.model.layers.0.self_attn.{type(model().model.layers['0'].self_attn).__name__}.forward.0"
    assert attention in validate_dump(clean / "rank")["data"]
    assert all(row.result == "pass" for row in compare_dumps(CompareConfig(target=again, bench=clean,
                                                                           out=tmp_path / "same")).ranks[0].rows)
    report = compare_dumps(CompareConfig(target=perturbed, bench=clean, out=tmp_path / "cmp"))
    _, row = first_divergence(report.ranks[0].rows)
    assert (row.leaf.entry, row.leaf.side) == (attention, "output")
    assert f"Suspect Nodes: {attention}\n" in report.advice


# --- the training worker -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretraining_data(sample_assets, tmp_path_factory) -> tuple[Path, Path]:
    """The sample model and its tokenized pretraining text."""
    from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain

    root = tmp_path_factory.mktemp("worker")
    sample = sample_assets(documents=40, instruct_rows=20)
    tokenize_pretrain(PretrainTokenizeConfig(input=[sample / "pretrain" / "corpus.parquet"], tokenizer=sample / "model",
                                             out=root / "wiki", append_eod=True))
    return sample / "model", root / "wiki"


def probed_config(tmp_path: Path, name: str, model: Path, data: Path, step: list[int], task: str = "statistics", **train):
    """A deterministic training run of ``name`` dumping ``step`` at level mix into tmp_path/name."""
    from llmflow.train.config import TrainConfig

    probe = tmp_path / f"{name}.json"
    probe.write_text(json.dumps({"task": task, "dump_path": str(tmp_path / name), "step": step, "level": "mix"}))
    return TrainConfig.model_validate({
        "model": str(model), "out": str(tmp_path / f"run-{name}"), "data": {"paths": [str(data)]}, "seq_length": 32,
        "micro_batch_size": 2, "deterministic": True, "probe": str(probe), "save_interval": None, **train,
    })


WORKER_ENV = {"OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu"}


@pytest.fixture(scope="module")
def layout_runs(pretraining_data, tmp_path_factory) -> Callable[..., Path]:
    """``layout_runs(name, nproc, task="statistics", **train)``: the step folder of the first
    training step of the sample model dumped at level mix, from one checkpoint for every
    layout, each name launched once in the module."""
    from llmflow.weights.convert import ConvertConfig, convert

    model, data = pretraining_data
    root = tmp_path_factory.mktemp("layouts")
    checkpoint = root / "ckpt"
    convert(ConvertConfig(hf=model, out=checkpoint))
    steps: dict[str, Path] = {}

    def run(name: str, nproc: int, task: str = "statistics", **train) -> Path:
        if name not in steps:
            config = probed_config(root, name, model=checkpoint, data=data, step=[0], task=task, steps=1, **train)
            with process_state_restored():
                train_forked(config, nproc, env=WORKER_ENV, process_group=True)
            steps[name] = root / name / "step0"
        return steps[name]

    return run


def as_statistics(step: Path, out: Path) -> Path:
    """A task tensor dump as task statistics writes it: the same records, without their files."""

    def without_files(value):
        if isinstance(value, dict):
            return {k: without_files(v) for k, v in value.items() if k != "data_name"}
        return [without_files(v) for v in value] if isinstance(value, list) else value

    for rank in sorted(step.glob("rank*")):
        shutil.copytree(rank, out / rank.name, ignore=shutil.ignore_patterns("dump_tensor_data"))
        dump = json.loads((rank / "dump.json").read_text())
        dump.update(task="statistics", dump_data_dir=None, data=without_files(dump["data"]))
        (out / rank.name / "dump.json").write_text(json.dumps(dump))
    return out


@pytest.mark.slow
def test_training_worker_dumps_the_listed_steps(pretraining_data, tmp_path, deterministic):
    from llmflow.train.loop import train

    model, data = pretraining_data
    config = functools.partial(probed_config, tmp_path, model=model, data=data, step=[1], steps=3, global_batch_size=4)
    train_forked(config("worker"), 1, env=WORKER_ENV, process_group=True)
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


@pytest.mark.slow
def test_tp2_against_tp1_compares_the_merged_shards_and_fsdp2_records_parameter_gradients(layout_runs, tmp_path):
    steps = {  # one micro-batch per rank in every run; the one-process run is shared with the cp=2 test
        "tp2": layout_runs("tp2", 2, tp=2, global_batch_size=2),
        "tp1": as_statistics(layout_runs("one", 1, task="tensor", global_batch_size=2), tmp_path / "tp1"),
        "dp2": layout_runs("dp2", 2, global_batch_size=4),
    }
    dumps = {name: validate_dump(step / "rank0")["data"] for name, step in steps.items()}
    # The calls torch.distributed makes itself (DTensor redistribution, FSDP2's all-gathers) are
    # not recorded: every layout dumps the same entries.
    assert list(dumps["tp2"]) == list(dumps["tp1"]) and sorted(dumps["dp2"]) == sorted(dumps["tp1"])
    q_proj = "Module.model.layers.0.self_attn.q_proj.Linear"
    weight = dumps["tp2"][f"{q_proj}.forward.0"]["parameters"]["weight"]
    assert weight["type"] == "torch.distributed.tensor.DTensor" and weight["placements"] == [{"Shard": {"dim": 0}}]
    assert weight["device_mesh"] == [0, 1] and weight["shape"] == [64, 128]
    # Under FSDP2 each rank records the gradient of the unsharded weight it computed with.
    assert dumps["dp2"][f"{q_proj}.parameters_grad.0"]["weight"][0]["shape"] == [128, 128]

    # msprobe's own rules flag float32 rounding between the layouts (an output's norm error of
    # ~1e-7 against inputs' ~1e-8); the noise floor for cross-layout comparisons clears it.
    pair = {"target": steps["tp2"], "bench": steps["tp1"]}
    strict = compare_dumps(CompareConfig(**pair, out=tmp_path / "strict"))
    assert any(row.result == "warning" for row in strict.ranks[0].rows) and "Noise floor" not in strict.advice
    report = compare_dumps(CompareConfig(**pair, out=tmp_path / "cmp", norm_noise_floor=CROSS_LAYOUT_NOISE_FLOOR))
    (rank,) = report.ranks
    assert rank.rank == "rank0-1" and len(rank.rows) > 1000
    uncompared = [row for row in rank.rows if row.result != "pass"]
    # Partial sums (row-parallel matmuls, gradients of replicated inputs) cannot be merged from
    # statistics; everything else, sharded or replicated, matches the single process.
    assert uncompared and all(row.result == "N/A" and "Partial(sum)" in row.messages[0] for row in uncompared)
    assert report.advice.startswith("[rank0-1] compare_result_rank0-1.csv\nEvery compared value meets the accuracy rules.\n")
    assert "Noise floor on: norm relative errors below 1e-05 count as agreement" in report.advice


@pytest.mark.slow
def test_cp2_against_one_process_compares_the_merged_sequence_shards(layout_runs, tmp_path):
    """cp=2 (Ulysses on two gloo ranks) against the one-process run of the same step, fp32:
    each value the model computes is put together from the two ranks (sequence shards, the
    attention kernel's head shards, gradients unscaled, weight gradients summed) and agrees
    with the one process's as the tp=2 comparison does; what cannot be put together is left
    uncompared, with its reason."""
    cp2 = layout_runs("cp2", 2, task="tensor", cp=2, global_batch_size=2)
    one = layout_runs("one", 1, task="tensor", global_batch_size=2)
    layout = json.loads((cp2 / "rank1" / "layout.json").read_text())
    # FSDP2 shards over dp and cp flattened: only layout.json names the cp group.
    assert layout["meshes"] == [{"dims": ["dp_cp"], "ranks": [0, 1]}]
    assert (layout["cp_group"], layout["cp_algo"], layout["calls"][0]["tokens"]) == ([0, 1], "ulysses", [2, 16])
    # Context parallelism's own calls are not recorded: both runs dump the same calls, numbered alike.
    assert list(validate_dump(cp2 / "rank0")["data"]) == list(validate_dump(one / "rank0")["data"])
    one_layout = json.loads((one / "rank0" / "layout.json").read_text())
    assert [c["counts"] for c in layout["calls"]] == [c["counts"] for c in one_layout["calls"]]

    sizes = {CP_SIZE.format(value=16, ranks=2, other=32): 16, CP_SIZE.format(value=32, ranks=2, other=64): 4}
    uncompared = {CP_OUTSIDE: 22, CP_LOCAL: 9, CP_REDUCTION: 7, **sizes}
    rows = {}
    for mode, target, bench, compared in (
        ("tensor", cp2, one, 1789),
        ("statistics", as_statistics(cp2, tmp_path / "cp2"), as_statistics(one, tmp_path / "one"), 1698),
    ):
        report = compare_dumps(CompareConfig(target=target, bench=bench, out=tmp_path / mode,
                                             norm_noise_floor=CROSS_LAYOUT_NOISE_FLOOR))
        (rank,) = report.ranks
        rows[mode] = rank.rows
        assert rank.rank == "rank0-1"
        assert Counter(row.result for row in rank.rows) == {"pass": compared, "N/A": 58 + (91 if mode == "statistics" else 0)}
        reasons = Counter("; ".join(row.messages) for row in rank.rows if row.result == "N/A")
        assert reasons == uncompared | ({CP_GRADIENT_PARTS: 91} if mode == "statistics" else {})
    # In tensor mode the values themselves agree, whichever way they were put together.
    passed = [row for row in rows["tensor"] if row.result == "pass"]
    assert max(row.metrics["MaxAbsErr"] for row in passed if "MaxAbsErr" in row.metrics) < 1e-6
    assert {(row.leaf.join or (None,))[0] for row in passed if row.leaf.is_tensor} == {"cat", "cat_samples", "avg", None}
    sdpa = next(row.leaf for row in passed if row.leaf.name == "Functional.scaled_dot_product_attention.0.forward.input.0")
    assert sdpa.join == ("cat", 1) and sdpa.record["shape"] == [2, 4, 32, 32]  # the ranks' heads over the whole sequence
    assert sum(row.leaf.scale == 0.5 for row in passed) > 200  # gradients, each cp rank's twice a run's without cp


def _tensor_leaf(name: str, values: torch.Tensor, **record) -> Leaf:
    stats = {"Max": values.max().item(), "Min": values.min().item(), "Mean": values.mean().item(), "Norm": values.norm().item()}
    return Leaf(name, name.rsplit(".", 2)[0], "output", {"type": "torch.Tensor", "dtype": "torch.float32",
                                                           "shape": list(values.shape), **stats, "requires_grad": False, **record})


def test_merging_ranks_combines_shards_and_flags_replicas_that_differ():
    whole = torch.arange(24.0).reshape(2, 12) - 7
    bench = RankDump("rank0", "statistics", [_tensor_leaf("x.0.forward.output.0", whole), _tensor_leaf("y.0.forward.output.0", whole)], {})
    halves = whole.chunk(2, dim=1)
    ranks = [RankDump(f"rank{r}", "statistics", [_tensor_leaf("x.0.forward.output.0", halves[r]),
                                                 _tensor_leaf("y.0.forward.output.0", whole + r)], {}) for r in (0, 1)]
    sharded, replica = merge_ranks(ranks, bench).leaves
    assert sharded.record["shape"] == [2, 12] and sharded.problem is None
    for stat in ("Max", "Min", "Mean", "Norm"):  # msprobe's merge: max, min, size-weighted mean, root of summed squares
        assert sharded.record[stat] == pytest.approx(bench.leaves[0].record[stat], rel=1e-6)
    assert replica.problem == ("warning", "a replica whose copy on rank 1 of the group differs from rank 0's")


def test_merging_a_context_parallel_group_rebuilds_the_whole_sequence(tmp_path):
    """Two Ulysses cp ranks, each holding half of every sequence, against one process, in
    tensor mode: sequence shards (also flattened with the batch) concatenated in order,
    gradients unscaled, a weight's gradient parts summed, and what is no shard left uncompared."""
    hidden = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0))  # [batch, positions, hidden]
    parts = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(1))
    values = {  # name: (the one process's value, each cp rank's)
        "x.0.forward.output.0": (hidden, [hidden[:, :2], hidden[:, 2:]]),
        "x.0.forward.output.1": (hidden.reshape(8, 3), [hidden[:, :2].reshape(4, 3), hidden[:, 2:].reshape(4, 3)]),
        "x.0.backward.input.0": (hidden, [2 * hidden[:, :2], 2 * hidden[:, 2:]]),  # each rank's loss scaled by cp
        "m.parameters_grad.0.weight": (parts.sum(0), [2 * parts[0], 2 * parts[1]]),
        "i.0.forward.output.0": (torch.arange(8.0), [torch.arange(4.0)] * 2),  # each rank's own row numbers
        "loss.0.forward.output.0": (torch.tensor(5.0), [torch.tensor(2.0), torch.tensor(3.0)]),
        "loop.0.forward.output.0": (torch.tensor(1.0), [torch.tensor(1.0)] * 2),
    }

    def dump(rank: str, index: int | None, size: int) -> RankDump:
        leaves = [Leaf("x.0.forward.input.1", "x.0.forward", "input", {"type": "int", "value": size})]
        for name, (one, shards) in values.items():
            tensor = one if index is None else shards[index]
            torch.save(tensor, tmp_path / f"{rank}-{name}.pt")
            leaves.append(replace(_tensor_leaf(name, tensor), files=(tmp_path / f"{rank}-{name}.pt",)))
        return RankDump(rank, "tensor", leaves, {})

    merged = merge_context_parallel([dump("rank0", 0, 2), dump("rank1", 1, 2)], dump("bench", None, 4),
                                    {"loop.0.forward"}, (2, 2))
    merged = {leaf.name: leaf for leaf in merged.leaves}
    for name in ("x.0.forward.output.0", "x.0.forward.output.1", "x.0.backward.input.0", "m.parameters_grad.0.weight"):
        whole = values[name][0]
        assert merged[name].problem is None and torch.allclose(load_tensor(merged[name]), whole), name
        assert merged[name].record["Norm"] == pytest.approx(whole.norm().item(), rel=1e-6)
    problems = {name: leaf.problem[1] for name, leaf in merged.items() if leaf.problem is not None}
    assert problems == {"x.0.forward.input.1": CP_SIZE.format(value=2, ranks=2, other=4), "i.0.forward.output.0": CP_LOCAL,
                        "loss.0.forward.output.0": CP_REDUCTION, "loop.0.forward.output.0": CP_OUTSIDE}


@pytest.mark.parametrize("layout, refusal", [
    ({"cp_algo": "ring"}, r"rank0's context-parallel group \[0, 1\] runs cp_algo ring: only Ulysses' contiguous"),
    ({"meshes": [{"dims": ["dp_cp", "tp"], "ranks": [[0, 1], [2, 3]]}], "cp_group": [0, 2]},
     r"rank0 holds a context-parallel group \[0, 2\] and a tensor-parallel group \[0, 1\]"),
    ({"num_stages": 2, "pipeline_group": [0, 1]}, r"target: rank0 holds a context-parallel group \[0, 1\] beside pipeline"),
], ids=["ring", "cp-x-tp", "cp-x-pp"])
def test_context_parallel_runs_that_are_not_put_together_are_refused(clean_runs, tmp_path, layout, refusal):
    dump = clean_runs["statistics"][0] / "rank"
    for rank in (0, 1):
        shutil.copytree(dump, tmp_path / "cp2" / f"rank{rank}")
        written = {**json.loads((dump / "layout.json").read_text()), "rank": rank, "cp_group": [0, 1],
                   "cp_algo": "ulysses", **layout}
        (tmp_path / "cp2" / f"rank{rank}" / "layout.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match=refusal):
        compare_dumps(CompareConfig(target=tmp_path / "cp2", bench=clean_runs["statistics"][1], out=tmp_path / "cmp"))


def test_runs_of_different_ranks_without_a_tensor_parallel_layout_are_refused(clean_runs, tmp_path):
    dump = clean_runs["statistics"][0] / "rank"
    for rank in ("rank0", "rank1"):  # two data-parallel ranks: no DTensor tells a group
        shutil.copytree(dump, tmp_path / "dp2" / rank)
    with pytest.raises(ValueError, match=r"dumped no DTensor to tell their tensor-parallel group"):
        compare_dumps(CompareConfig(target=tmp_path / "dp2", bench=clean_runs["statistics"][1], out=tmp_path / "cmp"))
    assert not (tmp_path / "cmp").exists()
