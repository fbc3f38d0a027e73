"""Pipeline parallelism: the stage split, the checks made before launch, and — through real
torchrun launches on gloo — the single process's losses from every (pp, dp, tp) layout and
schedule, LoRA under pp, resume across pp layouts, exact resume after SIGKILL, and export
of a pipeline checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from train_helpers import assert_close, config, losses, run, train_in_subprocess, training_assets

from llmflow.cli import main as cli_main
from llmflow.models import CausalLM, ModelConfig, is_lora_param
from llmflow.models.pipeline import layer_split, rank_stages, split_model
from llmflow.train.config import TrainConfig
from llmflow.train.preflight import PreflightError, check_training, parallel_problems, pipeline_problems
from llmflow.weights import latest_step_dir, load_hf_model, load_model, read_meta
from llmflow.weights.export import ExportConfig, export
from llmflow.weights.training_checkpoint import stored_tensors

STEPS = 5
SCHEDULES = [{"pp_schedule": "1F1B"}, {"pp_schedule": "GPipe"}, {"pp_schedule": "Interleaved1F1B", "virtual_stages": 2}]
LAYOUTS = {  # name: (settings, ranks, reference)
    "pp2-sft": ({"pp": 2}, 2, "sft"),
    "pp2xdp2": ({"pp": 2, "dp": 2}, 4, "pretrain"),
    "pp2xtp2-documents": ({"pp": 2, "tp": 2}, 4, "documents"),
}


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory) -> dict[str, Path]:
    return training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("pipeline"))


def data(assets, kind: str) -> dict:
    """Settings of the reference kinds: pretraining, pretraining with per-document attention
    (packed documents), packed instruction finetuning."""
    if kind == "sft":
        return {"kind": "sft", "seq_length": None}
    if kind == "documents":
        return {"data": {"kind": "pretrain", "paths": [str(assets["wiki"])], "document_attention": True}}
    return {}


# --- pieces ---------------------------------------------------------------------------------------


def test_layers_split_evenly_or_as_listed():
    assert layer_split(4, 2) == [range(2), range(2, 4)]
    assert layer_split(5, 2) == [range(3), range(3, 5)]
    assert layer_split(32, 2, [16, 16]) == [range(16), range(16, 32)]
    assert layer_split(6, 3, [1, 3, 2]) == [range(1), range(1, 4), range(4, 6)]
    assert rank_stages(1, 2, 2) == [1, 3]


@pytest.mark.parametrize("pp, virtual", [(2, 1), (4, 1), (2, 2)])
def test_stages_chained_are_the_whole_model_under_its_names(assets, pp, virtual):
    model = load_hf_model(assets["model"]).eval()
    names = set(model.state_dict())
    stages = sorted((index, stage) for rank in range(pp) for index, stage in split_model(model, rank, pp, virtual))
    assert [index for index, _ in stages] == list(range(pp * virtual))
    assert set().union(*(stage.state_dict() for _, stage in stages)) == names
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = ids
        for _, stage in stages:
            hidden = stage(hidden)
        assert torch.equal(hidden, model(ids))


def settings_file(assets, tmp_path: Path, **overrides) -> Path:
    path = tmp_path / "train.json"
    path.write_text(config(assets, tmp_path / "run", steps=STEPS, **overrides).model_dump_json())
    return path


@pytest.mark.parametrize("overrides, nproc, problem", [
    ({"pp": 8, "global_batch_size": 16}, 8, "pp=8 stages but the model has 4 layers; each stage needs one"),
    ({"pp": 2, "num_layer_list": [1, 2]}, 2, "num_layer_list [1, 2] sums to 3 layers but the model has 4"),
    ({"pp": 2, "num_layer_list": [4]}, 2, "num_layer_list has 1 entries for pp=2 stages; give one per stage"),
    ({"pp": 2, "pp_schedule": "Interleaved1F1B"}, 2,
     "pp_schedule Interleaved1F1B needs virtual_stages (model chunks per rank, at least 2)"),
    ({"pp": 2, "virtual_stages": 2}, 2, "virtual_stages=2 needs pp_schedule Interleaved1F1B (1F1B runs one stage per rank)"),
    ({"pp": 2, "pp_schedule": "Interleaved1F1B", "virtual_stages": 4}, 2,
     "pp * virtual_stages = 2*4 = 8 stages but the model has 4 layers; each stage needs one"),
    ({"pp": 4, "global_batch_size": 4}, 4,
     ("pp_schedule 1F1B needs at least pp=4 micro-batches per step, but global_batch_size / (micro_batch_size * dp) "
      "= 4 / (2 * 1) = 2")),
    ({"pp": 2, "microbatches": 3}, 2,
     "microbatches=3 but global_batch_size / (micro_batch_size * dp) = 8 / (2 * 1) = 4; they must be equal"),
    ({"num_layer_list": [2, 2]}, 1, "num_layer_list splits pipeline stages, but pp=1; set pp > 1 or leave num_layer_list out"),
    ({"pp": 2}, 3, "nproc=3 is not a multiple of pp*tp = 2*1 = 2"),
])
def test_bad_pipeline_settings_are_one_line_before_launch(assets, tmp_path, overrides, nproc, problem):
    cfg = config(assets, tmp_path / "run", **overrides)
    with pytest.raises(PreflightError) as error:
        check_training(cfg, nproc, env={"LLMFLOW_DEVICE": "cpu"})
    assert error.value.problems == [problem]
    assert not (tmp_path / "run").exists()


def test_cli_names_the_pipeline_problem_in_one_line(assets, tmp_path):
    path = settings_file(assets, tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", str(path), "pp=2", "pp_schedule=Interleaved1F1B", "--nproc", "2", "--workspace", str(tmp_path)])
    assert str(exit_.value.code).splitlines() == [
        f"llmflow train {path}: 1 problem found before launch, nothing was started:",
        "  - pp_schedule Interleaved1F1B needs virtual_stages (model chunks per rank, at least 2)",
    ]
    assert not (tmp_path / "run").exists()


# --- distributed (torchrun, gloo) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(assets) -> dict[str, dict[int, float]]:
    """Single-process losses of every reference kind, STEPS steps."""
    root = assets["root"]
    return {kind: train_in_subprocess(config(assets, root / f"ref-{kind}", steps=STEPS, **data(assets, kind)))
            for kind in ("pretrain", "documents", "sft")}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s["pp_schedule"] for s in SCHEDULES])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_matches_one_process(assets, reference, tmp_path, layout, schedule):
    settings, nproc, kind = LAYOUTS[layout]
    got = run(config(assets, tmp_path / "run", steps=STEPS, **data(assets, kind), **settings, **schedule), nproc)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_close(got, reference[kind])


@pytest.mark.slow
def test_lora_under_pp_matches_one_process_and_saves_only_adapters(assets, tmp_path):
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    want = train_in_subprocess(config(assets, tmp_path / "one", steps=STEPS, lora=lora))
    got = run(config(assets, tmp_path / "pp", steps=STEPS, lora=lora, pp=2), 2)
    assert_close(got, want)
    assert sorted(got) == list(range(1, STEPS + 1))
    stored = stored_tensors(latest_step_dir(tmp_path / "pp"))
    assert stored.keys() == stored_tensors(latest_step_dir(tmp_path / "one")).keys()
    assert stored and all(is_lora_param(name) for name in stored)


def resume_from(checkpoint: Path, step: int, out: Path) -> Path:
    """A new run directory holding only ``checkpoint``'s step ``step``."""
    name = f"step_{step:08d}"
    shutil.copytree(checkpoint / name, out / name)
    (out / "latest").write_text(f"{name}\n")
    return out


@pytest.mark.slow
def test_resume_across_pp_layouts_and_after_sigkill(assets, tmp_path):
    """A pp=2 run killed with SIGKILL resumes exactly at pp=2 and continues within 1e-5 at
    pp=1; a pp=1 checkpoint continues at pp=2; the checkpoints hold the same tensors whatever
    the layout, and the pp=2 one exports to the model it holds."""
    saving = {"steps": 10, "save_interval": 3, "keep_last": None}
    want = train_in_subprocess(config(assets, tmp_path / "one", **saving))

    cfg = config(assets, tmp_path / "pp2", pp=2, **saving)
    path = tmp_path / "pp2.json"
    path.write_text(cfg.model_dump_json())
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "llmflow.train",
         str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"},
    )
    before = []
    for line in proc.stdout:
        before.append(line)
        if line.startswith("step 5/"):
            for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
                process.send_signal(signal.SIGKILL)  # torchrun and its workers, each in a session of its own
            break
    proc.wait()
    assert (Path(cfg.out) / "latest").read_text().strip() == "step_00000003"
    killed = losses(before)
    assert sorted(killed) == [1, 2, 3, 4, 5]
    assert_close(killed, want)

    moved = resume_from(Path(cfg.out), 3, tmp_path / "to-pp1")
    resumed = run(cfg, 2)
    assert sorted(resumed) == list(range(4, 11))
    assert all(resumed[s] == killed[s] for s in (4, 5))  # bitwise, same layout
    assert_close(resumed, want)

    assert_close(train_in_subprocess(config(assets, moved, **saving)), want)
    assert_close(run(config(assets, resume_from(tmp_path / "one", 3, tmp_path / "to-pp2"), pp=2, **saving), 2), want)

    final = latest_step_dir(cfg.out)
    assert read_meta(final).layout == {"pp": 2, "dp": 1, "cp": 1, "tp": 1, "ep": 1}
    assert {k: (v.size, v.properties.dtype) for k, v in stored_tensors(final).items()} == {
        k: (v.size, v.properties.dtype) for k, v in stored_tensors(latest_step_dir(tmp_path / "one")).items()}
    exported = export(ExportConfig(ckpt=cfg.out, out=tmp_path / "hf"))
    ours, _ = load_model(cfg.out)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, attn_implementation="eager").eval()
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)[..., :vocab]).abs().max() <= 1e-5


LLAMA_2_7B = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
}


def worked_example() -> dict:
    """The training config of docs/training.md's worked example."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    (block,) = re.findall(r"```yaml\n# llama2-7b-pp2.yaml\n(.*?)```", text, re.DOTALL)
    return yaml.safe_load(block)


def test_the_worked_example_splits_llama_2_7b_as_documented(tmp_path):
    cfg = TrainConfig.model_validate(worked_example())
    model_config = ModelConfig.from_hf(LLAMA_2_7B)
    assert parallel_problems(8, cfg.tp, cfg.dp, model_config, cfg.pp) == []
    assert pipeline_problems(cfg, 4, model_config.num_hidden_layers) == []
    with torch.device("meta"):
        model = CausalLM(model_config)
    sizes = []
    for rank in range(cfg.pp):
        ((_, stage),) = split_model(model, rank, cfg.pp, num_layer_list=cfg.num_layer_list)
        sizes.append(round(sum(p.numel() for p in stage.parameters()) / 1e9, 2))
        assert list(stage.model.layers) == [str(i) for i in range(16 * rank, 16 * (rank + 1))]
    assert sizes == [3.37, 3.37]
    for other in ({"pp": 1, "num_layer_list": None}, {"pp": 4, "num_layer_list": [8, 8, 8, 8]}):
        moved = cfg.model_copy(update=other)
        assert pipeline_problems(moved, 8 // moved.pp, model_config.num_hidden_layers) == []
