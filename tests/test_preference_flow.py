"""The finetune-and-eval flow with an alignment run (method dpo) on the sample assets: the
preference pairs tokenized, the SFT model's reference log-probs computed by their own stage
and read by the alignment run, the held-out reward accuracy measured before and after, and a
rerun served from cache; and the parameter checks that refuse a bad alignment setting before
any stage runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from prefect_helpers import flow_run_logs, mlflow_runs, task_states
from pydantic import ValidationError

from llmflow.flows.finetune_eval import FinetuneEvalParams, finetune_eval
from llmflow.train.reference import LOGPS


@pytest.fixture(autouse=True)
def worker_env(monkeypatch):
    """Workers on CPU, one thread each."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LLMFLOW_DEVICE", "cpu")


def dpo_params(workspace: Path, **overrides) -> FinetuneEvalParams:
    """A short SFT run (a short warmup: the facts learnt in 100 steps), then the DPO run of the
    flow's defaults on rows of 128 tokens (every sample pair fits; fewer steps leave the held-out
    accuracy at the mercy of the seed); MMLU only (a few questions), no prompts, no registry."""
    base = {
        "workspace": str(workspace),
        "version": "test",
        "method": "dpo",
        "train": {"steps": 100, "micro_batch_size": 16, "global_batch_size": 16, "save_interval": None,
                  "optim": {"lr": 5e-3, "min_lr": 5e-4, "warmup_steps": 5, "decay": "linear"}},
        "preference": {"seq_length": 128, "train": {"save_interval": None}},
        "evaluation": {"limit": 4},
        "prompts": [],
        "registered_model": None,
    }
    return FinetuneEvalParams.model_validate(base | overrides)


@pytest.mark.slow
def test_dpo_after_sft_raises_the_heldout_reward_accuracy_and_reruns_from_cache(prefect_env, tmp_path):
    params = dpo_params(tmp_path / "ws")
    state = finetune_eval(**dict(params), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    flow_run_id = state.state_details.flow_run_id
    states = task_states(flow_run_id)
    assert states == {
        "sample": ["Completed"], "convert": ["Completed"], "tokenize-instruction": ["Completed"],
        "eval-mmlu": ["Completed", "Completed"], "train": ["Completed", "Completed"],
        "export": ["Completed", "Completed"], "tokenize-preference": ["Completed", "Completed"],
        # the reference (training pairs, SFT model), then the held-out pairs before and after
        "reference-logps": ["Completed", "Completed", "Completed"],
    }

    # The held-out reward accuracy: zero before (the SFT model against itself), above chance after.
    assert result["method"] == "dpo" and result["heldout_pairs"] == 96
    assert result["reward_accuracy_before"] == 0.0 and result["reward_margin_before"] == 0.0
    assert result["reward_accuracy_after"] > 0.5 and result["reward_accuracy_after"] > result["reward_accuracy_before"]
    assert result["reward_margin_after"] > 0
    parent = MlflowClient(prefect_env["mlflow_uri"]).get_run(result["mlflow_run"])
    for key in ("reward_accuracy_before", "reward_accuracy_after", "reward_margin_before", "reward_margin_after"):
        assert parent.data.metrics[key] == pytest.approx(result[key], abs=1e-6), key
    summary = Path(MlflowClient(prefect_env["mlflow_uri"]).download_artifacts(result["mlflow_run"], "summary.md", str(tmp_path)))
    assert f"| reward accuracy | 0.0000 | {result['reward_accuracy_after']:.4f} |" in summary.read_text()

    # The stages' outputs: the reference log-probs of the training pairs under the SFT model,
    # read (not computed again) by the alignment run; the aligned model is the flow's model.
    reference = Path(result["reference"])
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["model"] == result["sft_model"] and manifest["pairs"] == 432
    assert np.load(reference / LOGPS).shape[0] == 432
    aligned_run = Path(result["checkpoint"])
    config = json.loads((aligned_run / "train_config.json").read_text())
    assert (config["method"], config["data"]["kind"]) == ("dpo", "preference")
    assert Path(config["preference"]["reference"]) == reference and Path(config["model"]) == Path(result["sft_model"])
    assert (aligned_run / "latest").read_text().strip() == "step_00000150"
    assert not (aligned_run / "reference").exists()
    assert any(line.startswith(f"reference log-probs from {reference}") for line in flow_run_logs(flow_run_id))
    assert (Path(result["model"]) / "config.json").is_file() and result["model"] != result["sft_model"]
    heldout = sorted((tmp_path / "ws" / "logps").glob("*-heldout-*/reference/logps.npy"))
    assert len(heldout) == 2 and all(np.load(f).shape[0] == 96 for f in heldout)
    assert len(mlflow_runs(prefect_env, "reference-logps")) == 3

    # The same parameters again: every stage from cache, the reference log-probs untouched.
    stamp = (reference / "manifest.json").stat().st_mtime_ns
    again = finetune_eval(**dict(params), return_state=True)
    assert again.is_completed(), again.message
    assert {s for runs in task_states(again.state_details.flow_run_id).values() for s in runs} == {"Cached"}
    assert (reference / "manifest.json").stat().st_mtime_ns == stamp
    assert {k: again.result()[k] for k in ("reward_accuracy_before", "reward_accuracy_after", "model")} == {
        k: result[k] for k in ("reward_accuracy_before", "reward_accuracy_after", "model")}


def test_a_bad_alignment_setting_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValidationError, match=r"preference\.train\.preference\.beta\n.*greater than 0"):
        dpo_params(tmp_path, preference={"train": {"preference": {"beta": 0}}})
    with pytest.raises(ValidationError, match=r"preference\.train\.preference\n.*label_smoothing is used by loss_type robust"):
        dpo_params(tmp_path, preference={"train": {"preference": {"loss_type": "ipo", "label_smoothing": 0.1}}})
    with pytest.raises(ValidationError, match=r"loss_type='ipo' is a dpo loss; method=simpo"):
        dpo_params(tmp_path, method="simpo", preference={"train": {"preference": {"loss_type": "ipo"}}})
    # The reference log-probs are the flow's own stage: no directory is taken.
    with pytest.raises(ValidationError, match=r"preference\.train\.preference\.reference\n.*Extra inputs"):
        dpo_params(tmp_path, preference={"train": {"preference": {"reference": str(tmp_path)}}})
    with pytest.raises(ValidationError, match=r"preference\.train\n.*nproc=3 is not a multiple of tp=2"):
        dpo_params(tmp_path, preference={"train": {"nproc": 3, "tp": 2}})
    with pytest.raises(ValidationError, match=r"preference\.train\.cp: seq_length=100 is not divisible by cp=8"):
        dpo_params(tmp_path, preference={"seq_length": 100, "train": {"nproc": 8, "cp": 8}})
    with pytest.raises(ValidationError, match=r"method\n.*'sft', 'dpo', 'simpo' or 'orpo'"):
        dpo_params(tmp_path, method="ppo")
    assert dpo_params(tmp_path, method="orpo").preference.train.preference.beta == 0.1


def test_an_impossible_alignment_layout_stops_the_flow_before_any_heavy_stage(prefect_env, tmp_path):
    from llmflow.mesh import LayoutError

    # The SFT layout fits the sample model; the alignment's tp=3 splits none of its heads.
    params = dpo_params(tmp_path / "ws", preference={"train": {"nproc": 3, "tp": 3}})
    state = finetune_eval(**dict(params), return_state=True)
    assert state.is_failed()
    with pytest.raises(LayoutError, match="num_attention_heads=.* is not divisible by tp=3"):
        state.result()
    assert set(task_states(state.state_details.flow_run_id)) == {"sample"}
