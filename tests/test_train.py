"""Training: the data addressing, the schedule, bad input, and — through real torchrun
launches on gloo — loss parity across (dp, tp) layouts, exact resume after SIGKILL and
resume onto another layout."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import SINGLE_THREAD, assert_close, config, losses, run, train_in_subprocess, training_assets

from llmflow.cli import main
from llmflow.data.indexed import IndexedDatasetWriter
from llmflow.models import LoraConfig, apply_lora, is_lora_param, lora_state_dict
from llmflow.train.config import load_train_config
from llmflow.train.data import PretrainSamples, blend_assignments
from llmflow.train.loop import learning_rate, train
from llmflow.weights import latest_step_dir, load_checkpoint, load_hf_model, load_model, read_meta
from llmflow.weights.export import ExportConfig, export
from llmflow.weights.training_checkpoint import stored_tensors


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory) -> dict[str, Path]:
    """Sample model and data, tokenized for pretraining and (packed) finetuning."""
    return training_assets(sample_assets(instruct_rows=300, documents=60), tmp_path_factory.mktemp("train"))


# --- pieces ---------------------------------------------------------------------------------------


def test_pretrain_samples_cut_the_token_stream(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "d_text_document", np.uint16)
    docs = [np.arange(n, dtype=np.uint16) + 100 * i for i, n in enumerate([5, 17, 3, 40, 9])]
    writer.add_documents(docs)
    writer.finalize()
    stream = np.concatenate(docs)
    samples = PretrainSamples(tmp_path / "d", seq_length=8, seed=3, document_attention=True)
    assert samples.num_samples == (len(stream) - 1) // 8
    seen = set()
    for g in range(samples.num_samples):
        s = samples[g]
        start = int(re.search(r"tokens (\d+)", s.source).group(1))
        seen.add(start)
        assert s.input_ids.tolist() == stream[start : start + 8].tolist()
        assert s.targets.tolist() == stream[start + 1 : start + 9].tolist()
        doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])[start : start + 8]
        assert s.document_ids.tolist() == (doc_of - doc_of[0]).tolist()
    assert seen == {8 * i for i in range(samples.num_samples)}  # one epoch visits every sample once
    again = PretrainSamples(tmp_path / "d", seq_length=8, seed=3)
    assert [again[g].input_ids.tolist() for g in range(12)] == [samples[g].input_ids.tolist() for g in range(12)]


def test_blend_follows_the_weights():
    chosen, within = blend_assignments([0.7, 0.2, 0.1], 1000)
    counts = np.bincount(chosen, minlength=3)
    assert counts.tolist() == [700, 200, 100]
    for d in range(3):
        assert within[chosen == d].tolist() == list(range(counts[d]))


def test_learning_rate_schedule(assets, tmp_path):
    cfg = config(assets, tmp_path, steps=10, optim={"lr": 1.0, "min_lr": 0.1, "warmup_steps": 2})
    lrs = [learning_rate(cfg, s) for s in range(1, 11)]
    assert lrs[:2] == [0.5, 1.0] and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))


def test_config_file_and_overrides(tmp_path, assets):
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {assets['model']}\nout: {tmp_path / 'o'}\ndata: {{paths: [{assets['wiki']}]}}\nsteps: 3\nseq_length: 32\n")
    cfg = load_train_config(path, ["optim.lr=1e-4", "tp=2", 'data.paths=["a", "b"]', "data.weights=[1, 3]"])
    assert cfg.optim.lr == 1e-4 and cfg.tp == 2 and cfg.data.weights == [1, 3] and cfg.data.paths == ["a", "b"]
    with pytest.raises(ValueError, match="data.weights has 1 entries for 2 data.paths"):
        load_train_config(path, ['data.paths=["a", "b"]', "data.weights=[1]"])
    with pytest.raises(ValueError, match="expected key=value"):
        load_train_config(path, ["steps"])


def llmflow_train_error(*args: str) -> str:
    """The message ``llmflow train ARGS`` exits with (run in-process, as the console script runs it)."""
    with pytest.raises(SystemExit) as stopped:
        main(["train", *args])
    return str(stopped.value.code)


def config_file(tmp_path: Path, assets) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {assets['model']}\nout: {tmp_path / 'o'}\ndata: {{paths: [{assets['wiki']}]}}\nsteps: 3\n")
    return path


def test_command_line_overrides_keep_their_commas(tmp_path, assets):
    path = config_file(tmp_path, assets)
    # As `llmflow train c.yaml data.paths='[a,b]' ...` hands them over after the shell's quoting.
    message = llmflow_train_error(str(path), "data.paths=[a,b]", "pp=2", "num_layer_list=[3,2]", "--nproc", "2")
    assert "data a: no pretraining dataset" in message and "data b: no pretraining dataset" in message
    assert "num_layer_list [3, 2] sums to 5 layers but the model has 4" in message


@pytest.mark.parametrize("argument, problem", [
    ("num_layer_list=[3", "override num_layer_list=[3: not valid YAML (expected ',' or ']', but got '<stream end>')"),
    ("steps=abc", "steps: Input should be a valid integer, unable to parse string as an integer (got 'abc')"),
    ("steps", "override 'steps': expected key=value"),
    ("--nprocs", "unknown option --nprocs"),
    ("--nproc=0", "--nproc: Input should be greater than or equal to 1 (got '0')"),
    ("--slurm.poll-s=abc", "--slurm.poll-s: Input should be a valid number, unable to parse string as a number (got 'abc')"),
])
def test_unreadable_override_is_one_line_naming_it(tmp_path, assets, argument, problem):
    message = llmflow_train_error(str(config_file(tmp_path, assets)), argument)
    assert message.startswith("llmflow train ") and problem in message and "\n" not in message


def test_unreadable_config_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: [a\n")
    message = llmflow_train_error(str(path))
    assert f": training config {path}: not valid YAML (expected ',' or ']'" in message and "\n" not in message


def test_batch_that_does_not_divide_is_refused(assets, tmp_path):
    with pytest.raises(ValueError, match="global_batch_size 6 is not a multiple of micro_batch_size \\* dp = 4 \\* 1"):
        train(config(assets, tmp_path / "o", micro_batch_size=4, global_batch_size=6))


def test_out_of_vocabulary_id_names_the_sample(assets, tmp_path):
    vocab = json.loads((assets["model"] / "config.json").read_text())["vocab_size"]
    writer = IndexedDatasetWriter(tmp_path / "bad_text_document", np.int32)
    writer.add_documents([np.arange(50) % 7, np.array([1, 2, vocab + 5, 3] * 20)])
    writer.finalize()
    cfg = config(assets, tmp_path / "o", seq_length=16, global_batch_size=8, micro_batch_size=8)
    cfg.data.paths = [str(tmp_path / "bad")]
    with pytest.raises(ValueError, match=rf"bad_text_document sample \d+ .*token id {vocab + 5} .*outside the model vocabulary \(vocab_size {vocab}\)"):
        train(cfg)


# --- distributed (torchrun, gloo) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(assets) -> dict[str, dict[int, float]]:
    """Single-process losses of 10 pretraining and 10 packed-SFT steps (the latter's step-6
    checkpoint kept)."""
    root = assets["root"]
    return {
        "pretrain": train_in_subprocess(config(assets, root / "ref-pretrain")),
        "sft": train_in_subprocess(config(assets, root / "ref-sft", kind="sft", seq_length=None, save_interval=6)),
    }


@pytest.fixture(scope="module")
def odd_checkpoint(assets) -> Path:
    """The sample model converted once with its vocabulary padded to 897 rows: a size no
    tensor-parallel degree above 1 divides."""
    from llmflow.weights.convert import ConvertConfig, convert

    return convert(ConvertConfig(hf=assets["model"], out=assets["root"] / "ckpt-897", pad_vocab_to_multiple=897))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pretrain", "sft"])
@pytest.mark.parametrize("layout", [{"dp": 2}, {"tp": 2}, {"cp": 2}, {"cp": 2, "cp_algo": "ring"}],
                         ids=["dp2", "tp2", "cp2", "cp2-ring"])
def test_loss_matches_one_process(assets, reference, odd_checkpoint, tmp_path, kind, layout):
    """dp=2, tp=2 and cp=2 (Ulysses and ring) give the single process's losses (cp on packed
    SFT rows: documents cross the ranks' shards); the tensor-parallel runs train the converted
    checkpoint, whose padding does not depend on tp (one checkpoint, any layout)."""
    model = {"model": str(odd_checkpoint)} if "tp" in layout else {}
    cfg = config(assets, tmp_path / "run", kind=kind, seq_length=64 if kind == "pretrain" else None, **layout, **model)
    got = run(cfg, nproc=2)
    assert sorted(got) == list(range(1, 11))
    assert_close(got, reference[kind])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"cp": 2, "tp": 2}, {"cp": 2, "pp": 2}], ids=["cp2xtp2", "cp2xpp2"])
def test_context_parallel_composes_with_tp_and_pp(assets, reference, tmp_path, layout):
    """Four ranks: cp=2 with tp=2 (each tensor-parallel rank's 2 heads split again over cp,
    its one key/value head repeated) and with pp=2 give the single process's packed-SFT losses."""
    got = run(config(assets, tmp_path / "run", kind="sft", seq_length=None, **layout), nproc=4)
    assert sorted(got) == list(range(1, 11))
    assert_close(got, reference["sft"])


@pytest.mark.slow
def test_lora_under_context_parallelism_matches_one_process(assets, tmp_path):
    """LoRA adapters trained by two context-parallel ranks on packed SFT rows: one process's losses."""
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    settings = {"kind": "sft", "seq_length": None, "steps": 4, "lora": lora, "optim": {"lr": 1e-2}}
    want = train_in_subprocess(config(assets, tmp_path / "one", **settings))
    got = run(config(assets, tmp_path / "cp2", cp=2, **settings), nproc=2)
    assert sorted(got) == [1, 2, 3, 4]
    assert_close(got, want)


def resume_copy(step_dir: Path, out: Path) -> Path:
    """A run directory holding only ``step_dir``, the checkpoint its next launch resumes from."""
    shutil.copytree(step_dir, out / step_dir.name)
    (out / "latest").write_text(f"{step_dir.name}\n")
    return out


@pytest.mark.slow
def test_context_parallel_checkpoints_resume_at_another_cp(assets, reference, tmp_path):
    """A cp=2 run's step-6 checkpoint resumed by one process, and the one-process run's by
    two context-parallel ranks, continue with the single process's packed-SFT losses."""
    sft = {"kind": "sft", "seq_length": None}
    by_cp = config(assets, tmp_path / "cp2", cp=2, save_interval=6, **sft)
    assert_close(run(by_cp, nproc=2), reference["sft"])
    step_6 = "step_00000006"
    resumed = train_in_subprocess(config(assets, resume_copy(Path(by_cp.out) / step_6, tmp_path / "to-cp1"), **sft))
    assert sorted(resumed) == list(range(7, 11))
    assert_close(resumed, reference["sft"])
    alone = assets["root"] / "ref-sft" / step_6
    resumed = run(config(assets, resume_copy(alone, tmp_path / "to-cp2"), cp=2, **sft), nproc=2)
    assert sorted(resumed) == list(range(7, 11))
    assert_close(resumed, reference["sft"])


@pytest.mark.slow
def test_sigkill_then_resume_is_exact_and_resumes_onto_another_layout(assets, reference, tmp_path):
    cfg = config(assets, tmp_path / "run", save_interval=3)
    path = tmp_path / "run.json"
    path.write_text(cfg.model_dump_json())
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmflow.train", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **SINGLE_THREAD, "LLMFLOW_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"},
    )
    before = []
    for line in proc.stdout:
        before.append(line)
        if line.startswith("step 7/"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (Path(cfg.out) / "latest").read_text().strip() == "step_00000006"
    other = resume_copy(Path(cfg.out) / "step_00000006", tmp_path / "other")

    resumed = train_in_subprocess(cfg)
    assert sorted(resumed) == list(range(7, 11))
    assert all(resumed[s] == reference["pretrain"][s] for s in resumed)  # bitwise, same layout

    # The step-6 checkpoint again, resumed by two tensor-parallel ranks.
    got = run(config(assets, other, tp=2), nproc=2)
    assert sorted(got) == list(range(7, 11))
    assert_close(got, reference["pretrain"])



# --- what training produces, read back by transformers ------------------------------------------------


def hf_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def test_export_of_a_trained_checkpoint_matches_our_model(assets, tmp_path):
    cfg = config(assets, tmp_path / "run", steps=2)
    train(cfg)
    exported = export(ExportConfig(ckpt=cfg.out, out=tmp_path / "hf"))
    ours, _ = load_model(cfg.out)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids)[..., : json.loads((assets["model"] / "config.json").read_text())["vocab_size"]]
    assert (hf_logits(exported, ids) - want).abs().max() <= 1e-5


def test_lora_trains_only_adapters_and_merged_export_matches(assets, tmp_path):
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    cfg = config(assets, tmp_path / "run", steps=3, lora=lora, optim={"lr": 1e-2})
    train(cfg)
    step_dir = latest_step_dir(cfg.out)
    stored = stored_tensors(step_dir)
    assert stored and all(is_lora_param(name) for name in stored)
    assert read_meta(step_dir).lora["rank"] == 4

    ours = load_hf_model(assets["model"])
    base = {k: v.clone() for k, v in ours.state_dict().items()}
    apply_lora(ours, LoraConfig(**lora))
    adapters = lora_state_dict(ours)
    load_checkpoint(step_dir, {"model": adapters})
    assert all(adapters[k].abs().sum() > 0 for k in adapters if "lora_B" in k)  # trained away from zero
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in base.items())  # base untouched

    merged = export(ExportConfig(ckpt=cfg.out, out=tmp_path / "merged", merge_lora=True))
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ours.eval()(ids)
    assert (hf_logits(merged, ids) - want).abs().max() <= 1e-5


def test_a_checkpoint_with_nested_optimizer_state_still_resumes(assets, tmp_path, monkeypatch):
    """Checkpoints written before the optimizer state was flattened (one param_groups entry
    listing the parameter names) resume exactly; the next save is flattened."""
    from llmflow.train.run import Run
    from llmflow.weights.dcp import read_dcp_metadata

    flattened = Run.state
    monkeypatch.setattr(Run, "state", lambda run, flatten=True: flattened(run, False))
    cfg = config(assets, tmp_path / "run", steps=4, save_interval=2, keep_last=None)
    want = train(cfg)["loss"]
    assert "optimizer.param_groups.0.lr" in read_dcp_metadata(tmp_path / "run" / "step_00000002").state_dict_metadata
    monkeypatch.setattr(Run, "state", flattened)

    shutil.rmtree(tmp_path / "run" / "step_00000004")
    (tmp_path / "run" / "latest").write_text("step_00000002\n")
    assert train(cfg)["loss"] == want
    metadata = read_dcp_metadata(tmp_path / "run" / "step_00000004").state_dict_metadata
    assert "optimizer.param_groups.0.lr" not in metadata
    assert "optimizer.param_groups.model.norm.weight.lr" in metadata


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_loss(assets, tmp_path, mode):
    plain = train(config(assets, tmp_path / "plain", steps=2, lora={"rank": 4}))
    recomputed = train(config(assets, tmp_path / "ac", steps=2, lora={"rank": 4}, activation_checkpointing=mode))
    assert recomputed["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert stored_tensors(latest_step_dir(tmp_path / "ac")).keys() == stored_tensors(latest_step_dir(tmp_path / "plain")).keys()


def test_the_first_and_last_steps_are_reported_whatever_the_interval(assets, tmp_path, capsys):
    """Step 1 is the sanity check of a fresh run (ln(vocabulary) from random weights): a run
    shorter than its log interval still shows it."""
    train(config(assets, tmp_path / "run", steps=5, log_interval=2))
    assert sorted(losses(capsys.readouterr().out.splitlines())) == [1, 2, 4, 5]
