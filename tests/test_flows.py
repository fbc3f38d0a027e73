"""The finetune-and-eval flow end to end on the sample assets, against the temporary Prefect
server: every stage, its MLflow run nested under the flow's, the registry gate refusing the
model (nothing registered, the reason in the summary and tags); a rerun served from cache; a
run failing in its last evaluation, rerun, executing only what failed and registering the
model (no gate); a run killed mid-training leaving no worker behind, its rerun resuming from
the checkpoint. Each flow run trains briefly (a torchrun launch each), so there are few.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect_helpers import (
    FlowProcess,
    checkpoint_after_cancel,
    flow_run_logs,
    metric_history,
    mlflow_runs,
    task_states,
    wait_for,
)
from train_helpers import losses

from llmflow.flows.comparison import REGRESSION_TAG
from llmflow.flows.finetune_eval import FinetuneEvalParams, finetune_eval
from llmflow.tasks.register import GATE_TAG, REASON_TAG
from llmflow.tracking import FLOW_RUN_TAG
from llmflow.weights import read_meta

pytestmark = pytest.mark.usefixtures("prefect_env")

# A flow run in its own process, as a worker or serve() runs it: cancelling it sends SIGTERM.
FLOW_SCRIPT = """
import sys

from llmflow.flows.finetune_eval import FinetuneEvalParams, finetune_eval

finetune_eval(**dict(FinetuneEvalParams.model_validate_json(open(sys.argv[1]).read())))
"""


@pytest.fixture(autouse=True)
def worker_env(monkeypatch):
    """Workers on CPU, one thread each; system metrics sampled often enough to show up."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LLMFLOW_DEVICE", "cpu")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")


def flow_params(workspace: Path, **overrides) -> FinetuneEvalParams:
    base = {
        "workspace": str(workspace),
        "version": "test",
        "train": {"steps": 8, "save_interval": 4, "micro_batch_size": 8, "global_batch_size": 8},
        "evaluation": {"limit": 8},
        "registered_model": "test-finetuned",
    }
    return FinetuneEvalParams.model_validate(base | overrides)


def run_flow(params: FinetuneEvalParams):
    """The flow run's final state and the state names of its stages, in order."""
    state = finetune_eval(**dict(params), return_state=True)
    states = task_states(state.state_details.flow_run_id)
    return state, states


def run_flow_command(prefect_server, prefect_env, options: dict) -> tuple[dict, str]:
    """``llmflow flow finetune-eval`` in a process of its own against the session's Prefect
    server, each of ``options`` given as ``--key value`` (nested settings as JSON or dotted);
    the flow's result it printed and its flow run id."""
    env = {**os.environ, **{setting.name: str(value) for setting, value in prefect_server.settings.items()}}
    proc = subprocess.run([sys.executable, "-m", "llmflow.cli", "flow", "finetune-eval",
                           *(arg for key, value in options.items() for arg in (f"--{key}", str(value)))],
                          check=False, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    result = json.loads("\n".join(lines[lines.index("{"):]))  # the flow's result, printed last
    return result, MlflowClient(prefect_env["mlflow_uri"]).get_run(result["mlflow_run"]).data.tags[FLOW_RUN_TAG]


@pytest.mark.slow
def test_finetune_eval_runs_every_stage_tracks_it_and_reruns_from_cache(prefect_env, prefect_server,
                                                                      sample_tokenizer_model, tmp_path):
    """A Qwen3 (q and k norms, an explicit head_dim, tied embeddings) through every stage, run
    by ``llmflow flow finetune-eval`` (nested settings as JSON), then again in-process with the
    same parameters: every stage from the command line's cache."""
    model = sample_tokenizer_model("qwen3", num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    # A gain no finetune can make: the registry gate fails whatever the scores.
    params = flow_params(tmp_path / "ws", model=str(model), register_min_gain=2.0)
    given = params.model_dump(mode="json", exclude_unset=True)
    result, flow_run_id = run_flow_command(prefect_server, prefect_env, {
        key.replace("_", "-"): value if isinstance(value, str) else json.dumps(value) for key, value in given.items()})
    states = task_states(flow_run_id)
    assert {name: set(runs) for name, runs in states.items()} == {
        "sample": {"Completed"}, "convert": {"Completed"}, "tokenize-instruction": {"Completed"},
        "eval-mmlu": {"Completed"}, "train": {"Completed"}, "export": {"Completed"}, "infer": {"Completed"},
    }
    assert len(states["eval-mmlu"]) == 2
    assert 0 <= result["mmlu_before"] <= 1 and 0 <= result["mmlu_after"] <= 1
    exported = json.loads((Path(result["model"]) / "config.json").read_text())
    assert (exported["model_type"], exported["head_dim"], exported["tie_word_embeddings"]) == ("qwen3", 32, True)
    assert (Path(result["model"]) / "tokenizer.json").is_file()
    answers = [json.loads(line) for line in next((tmp_path / "ws" / "generations").glob("*/generations.jsonl")).open()]
    assert [a["prompt"] for a in answers] == list(params.prompts) and all(a["output"] for a in answers)

    # MLflow: one parent run for the flow run, every stage nested under it.
    client = MlflowClient(prefect_env["mlflow_uri"])
    parent = client.get_run(result["mlflow_run"])
    assert parent.data.tags[FLOW_RUN_TAG] == flow_run_id
    assert parent.data.metrics["mmlu_after"] == pytest.approx(result["mmlu_after"], abs=1e-6)
    assert any(key.startswith("system/") for key in parent.data.metrics), parent.data.metrics
    assert "summary.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    for stage in ("sample", "convert", "tokenize-instruction", "train", "export", "infer", "eval-mmlu"):
        runs = mlflow_runs(prefect_env, stage)
        assert runs and all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in runs), stage
    (train_run,) = mlflow_runs(prefect_env, "train")
    assert "loss_curve.png" in {a.path for a in client.list_artifacts(train_run.info.run_id)}

    # The gate failed: the run completed, registered nothing and says why, in MLflow and its summary.
    gain = result["mmlu_after"] - result["mmlu_before"]
    reason = (f"MMLU {result['mmlu_before']:.4f} -> {result['mmlu_after']:.4f} ({gain:+.4f}) is below the minimum "
              "gain +2.0000: not registered")
    assert result["registered"] is None and result["gate"] == {"passed": False, "reason": reason, "rule": "min_gain=2"}
    assert mlflow_runs(prefect_env, "register") == [] and client.search_model_versions("name = 'test-finetuned'") == []
    assert parent.data.tags[GATE_TAG] == "failed" and parent.data.tags[REASON_TAG] == reason
    summary = client.download_artifacts(parent.info.run_id, "summary.md", str(tmp_path))
    assert f"- registry gate (min_gain=2): failed: {reason}\n" in Path(summary).read_text()

    # Prefect artifacts: the summary, the evaluation tables and the training progress.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as prefect_client:
        artifacts = prefect_client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    kinds = {(a.key, a.type) for a in artifacts}
    assert ("finetune-eval-summary", "markdown") in kinds
    (markdown,) = [a for a in artifacts if a.key == "finetune-eval-summary"]
    assert f"registry gate (min_gain=2): failed: {reason}" in markdown.data
    assert ("mmlu-accuracy", "table") in kinds
    assert ("finetune-eval-comparison", "table") in kinds
    assert ("infer-samples", "table") in kinds
    progress = [a for a in artifacts if a.type == "progress"]
    assert progress and progress[0].data == 100.0

    # The same parameters again: every stage comes from cache, the scores are the same.
    again, states = run_flow(params)
    assert again.is_completed()
    assert {state for runs in states.values() for state in runs} == {"Cached"}
    assert {k: again.result()[k] for k in ("mmlu_before", "mmlu_after", "model")} == {
        k: result[k] for k in ("mmlu_before", "mmlu_after", "model")
    }
    # ... and are held against the previous run's: the first run had none, this one the first.
    (first,) = result["comparison"]
    assert first["previous"] is None and first["registered"] is None and not first["regression"]
    (row,) = again.result()["comparison"]  # its figures rounded to 6 decimals
    assert row["previous"] == pytest.approx(result["mmlu_after"], abs=1e-6) and row["change"] == 0.0 and row["after_stderr"] > 0
    assert row["change_stderr"] == pytest.approx(2**0.5 * row["after_stderr"], abs=2e-6) and not row["regression"]
    assert client.get_run(again.result()["mlflow_run"]).data.tags[REGRESSION_TAG] == "none"


@pytest.mark.slow
def test_finetune_eval_starts_from_a_megatron_checkpoint_and_exports_one(prefect_env, sample_assets, tmp_path):
    """model: megatron:///path (the sample model as a tp=2 torch_dist checkpoint) with
    megatron_hf naming the Hugging Face model it holds; megatron_export writes the finetuned
    model back as a legacy tp=2 checkpoint, which reads back as the exported model."""
    import torch
    from test_convert import hf_tensors

    from llmflow.weights.convert import ConvertConfig, convert
    from llmflow.weights.export import ExportConfig, export

    sample = sample_assets() / "model"
    convert(ConvertConfig(hf=sample, out=tmp_path / "ckpt"))
    megatron = export(ExportConfig(ckpt=tmp_path / "ckpt", megatron=tmp_path / "megatron", tp=2))
    params = flow_params(tmp_path / "ws", model=f"megatron://{megatron}", megatron_hf=str(sample), prompts=[],
                         registered_model=None, megatron_export={"tp": 2, "megatron_format": "legacy"})
    state, states = run_flow(params)
    assert state.is_completed(), state.message
    assert states["convert"] == ["Completed"] and states["export"] == ["Completed", "Completed"]
    result = state.result()
    checkpoint = next((tmp_path / "ws" / "checkpoints").iterdir())
    assert json.loads((checkpoint / "manifest.json").read_text())["megatron"]["format"] == "torch_dist"
    assert (Path(result["megatron_model"]) / "iter_0000008" / "mp_rank_01" / "model_optim_rng.pt").is_file()
    back = convert(ConvertConfig(hf=sample, megatron=Path(result["megatron_model"]), out=tmp_path / "back"))
    again = hf_tensors(export(ExportConfig(ckpt=back, out=tmp_path / "again")))
    assert all(torch.equal(again[name], tensor) for name, tensor in hf_tensors(Path(result["model"])).items())
    with pytest.raises(ValueError, match="a megatron:// model needs megatron_hf"):
        flow_params(tmp_path / "ws", model=f"megatron://{megatron}")


# Qwen3.5-MoE: Gated DeltaNet layers 0-2, gated attention on layer 3, a shared expert. (A Qwen3-MoE
# goes through the same flow at ep=2 from the Prefect UI form: tests/test_browser.py.)
QWEN3_5_MOE = {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 48}


@pytest.mark.slow
def test_finetune_eval_finetunes_a_mixture_of_experts_at_ep2_from_the_command_line(prefect_env, prefect_server,
                                                                                   sample_tokenizer_model, tmp_path):
    """A Qwen3.5-MoE (tiny, the sample's tokenizer) through every stage, run by ``llmflow flow
    finetune-eval`` with dotted options, finetuned by two expert-parallel ranks; the training run
    logs the experts' load, the export is the per-expert layout transformers loads as
    ``Qwen3_5MoeForCausalLM``, and the finetune is registered."""
    from transformers import AutoModelForCausalLM

    family = "qwen3_5_moe_text"
    model = sample_tokenizer_model(family, **QWEN3_5_MOE)
    result, flow_run_id = run_flow_command(prefect_server, prefect_env, {
        "workspace": tmp_path / "ws", "model": model, "version": "test", "prompts": '["What is the capital of France?"]',
        "train.steps": 2, "train.save-interval": 2, "train.micro-batch-size": 4, "train.global-batch-size": 8,
        "train.nproc": 2, "train.ep": 2, "evaluation.limit": 4, "registered-model": f"test-{family}",
        "register-min-gain": "null"})
    states = task_states(flow_run_id)
    assert all(set(runs) == {"Completed"} for runs in states.values()) and "register" in states
    # No gate (register-min-gain null): registered whatever the scores, pointing at the export,
    # tagged with the scores.
    assert result["gate"]["passed"] and result["gate"]["rule"] == "always"
    client = MlflowClient(prefect_env["mlflow_uri"])
    assert client.get_run(result["mlflow_run"]).data.tags[GATE_TAG] == "off"
    (version,) = client.search_model_versions(f"name = 'test-{family}'")
    assert result["registered"] == {"name": f"test-{family}", "version": "1", "source": result["model"]}
    assert version.source == result["model"]
    assert float(version.tags["mmlu_after"]) == pytest.approx(result["mmlu_after"], rel=1e-5)
    exported = AutoModelForCausalLM.from_pretrained(result["model"])
    assert type(exported).__name__ == "Qwen3_5MoeForCausalLM"
    (train_run,) = mlflow_runs(prefect_env, "train")
    metrics = train_run.data.metrics
    assert {"moe_aux_loss", "moe_max_expert_load", "expert_tokens/0", "expert_tokens/3"} <= set(metrics)
    (run,) = (tmp_path / "ws" / "runs").iterdir()
    assert json.loads((run / "train_config.json").read_text())["ep"] == 2


@pytest.mark.slow
def test_a_killed_run_leaves_no_worker_and_its_rerun_resumes_training(prefect_env, prefect_server, tmp_path):
    """SIGTERM to a flow run's process (what cancelling it sends) mid-training on two
    context-parallel ranks (train.cp=2): no torchrun process is left, the flow run crashed and
    the train stage's MLflow run failed; the rerun resumes from the last checkpoint, and a
    third run is served from cache."""
    workspace = tmp_path / "ws"
    params = flow_params(workspace, train={"steps": 16, "save_interval": 4, "micro_batch_size": 4,
                                           "global_batch_size": 8, "nproc": 2, "cp": 2})
    params_path = tmp_path / "params.json"
    params_path.write_text(params.model_dump_json())
    script = tmp_path / "flow.py"
    script.write_text(FLOW_SCRIPT)
    flow_process = FlowProcess([str(script), str(params_path)], prefect_server.settings)
    try:
        wait_for(flow_process.lines, "saved checkpoint", timeout_s=240)
        assert len(flow_process.training_workers()) == 3  # torchrun and two ranks
        assert flow_process.terminate() == []
    finally:
        flow_process.close()
    (run_dir,) = workspace.glob("runs/*")
    (cancelled,) = mlflow_runs(prefect_env, "train")
    parent = MlflowClient(prefect_env["mlflow_uri"]).get_run(cancelled.data.tags["mlflow.parentRunId"])
    saved = checkpoint_after_cancel(prefect_env, parent.data.tags[FLOW_RUN_TAG], run_dir, 16)

    state, states = run_flow(params)
    assert state.is_completed(), state.message
    assert states["sample"] == ["Cached"] and states["convert"] == ["Cached"] and states["train"] == ["Completed"]
    logs = flow_run_logs(state.state_details.flow_run_id)
    assert any(line.startswith(f"resumed from {run_dir / f'step_{saved:08d}'} at step {saved}") for line in logs)
    # Every step the resumed run reports (each log interval's and the last) comes after the checkpoint.
    logged = sorted(losses(logs))
    assert logged and logged[0] > saved and logged[-1] == 16, (saved, logged)
    assert (run_dir / "latest").read_text().strip() == "step_00000016"
    assert read_meta(run_dir / "step_00000016").layout == {"pp": 1, "dp": 1, "cp": 2, "tp": 1, "ep": 1}
    resumed = mlflow_runs(prefect_env, "train")[1]
    assert sorted(metric_history(prefect_env, resumed, "loss")) == logged
    assert run_flow(params)[1]["train"] == ["Cached"]


@pytest.mark.slow
def test_pretrain_then_evaluate_its_checkpoint(prefect_env, tmp_path):
    from llmflow.flows.evaluate import EvaluateParams, evaluate
    from llmflow.flows.pretrain import PretrainParams, pretrain

    workspace = tmp_path / "ws"
    params = PretrainParams.model_validate({
        "workspace": str(workspace), "version": "test", "seq_length": 64, "evaluation": {"limit": 4},
        "train": {"steps": 4, "micro_batch_size": 4, "global_batch_size": 4, "save_interval": None},
    })
    state = pretrain(**dict(params), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert set(task_states(state.state_details.flow_run_id)) == {
        "sample", "convert", "tokenize-pretrain", "train", "export", "eval-mmlu"
    }
    (train_run,) = mlflow_runs(prefect_env, "train")
    assert train_run.data.params["data.kind"] == "pretrain" and train_run.data.params["seq_length"] == "64"

    # The same score from the training checkpoint as from its export (same weights, same tokenizer).
    scored = evaluate(**dict(EvaluateParams.model_validate(
        {"workspace": str(workspace), "model": result["checkpoint"], "evaluation": {"limit": 4}})))
    assert scored["mmlu"] == result["mmlu"]
    assert Path(scored["evaluation"]) != Path(result["evaluation"])

    # From scratch: the model's config and tokenizer, random weights, the same later stages.
    scratch = pretrain(**dict(params.model_copy(update={"init": "random"})), return_state=True)
    assert scratch.is_completed(), scratch.message
    assert scratch.result()["checkpoint"] != result["checkpoint"]
    assert task_states(scratch.state_details.flow_run_id)["tokenize-pretrain"] == ["Cached"]


def test_an_impossible_layout_stops_the_flow_before_any_heavy_stage(prefect_env, tmp_path):
    from llmflow.mesh import LayoutError

    params = flow_params(tmp_path / "ws", train={"nproc": 3, "tp": 3})
    state, states = run_flow(params)
    assert state.is_failed()
    with pytest.raises(LayoutError, match="num_attention_heads=.* is not divisible by tp=3"):
        state.result()
    assert set(states) == {"sample"}
    with pytest.raises(ValueError, match="nproc=4 is not a multiple of tp=3"):
        flow_params(tmp_path / "ws", train={"nproc": 4, "tp": 3})


def test_pipeline_layouts_are_checked_with_the_parameters_and_against_the_model(sample_assets, tmp_path):
    from llmflow.flows.checks import check_layout
    from llmflow.flows.params import TrainParams
    from llmflow.mesh import LayoutError

    with pytest.raises(ValueError, match="pp_schedule 1F1B needs at least pp=2 micro-batches per step"):
        flow_params(tmp_path / "ws", train={"nproc": 2, "pp": 2})
    with pytest.raises(ValueError, match="pp_schedule Interleaved1F1B needs virtual_stages"):
        flow_params(tmp_path / "ws", train={"nproc": 2, "pp": 2, "micro_batch_size": 4, "pp_schedule": "Interleaved1F1B"})
    model = sample_assets() / "model"
    check_layout(model, TrainParams(nproc=4, pp=4, micro_batch_size=4))
    with pytest.raises(LayoutError, match="pp=8 stages but the model has 4 layers; each stage needs one"):
        check_layout(model, TrainParams(nproc=8, pp=8, micro_batch_size=2))
    with pytest.raises(LayoutError, match=r"num_layer_list \[3, 3\] sums to 6 layers but the model has 4"):
        check_layout(model, TrainParams(nproc=2, pp=2, micro_batch_size=4, num_layer_list=[3, 3]))


def test_context_parallel_layouts_are_checked_with_the_parameters_and_against_the_model(sample_assets, tmp_path):
    from llmflow.flows.checks import check_layout
    from llmflow.flows.params import TrainParams
    from llmflow.mesh import LayoutError

    with pytest.raises(ValueError, match="train.cp: seq_length=100 is not divisible by cp=8"):
        flow_params(tmp_path / "ws", seq_length=100, train={"nproc": 8, "cp": 8})
    with pytest.raises(ValueError, match=r"nproc=2 is not a multiple of cp\*tp = 2\*2 = 4"):
        TrainParams(nproc=2, cp=2, tp=2)
    model = sample_assets() / "model"
    check_layout(model, TrainParams(nproc=4, cp=2, tp=2))
    with pytest.raises(LayoutError, match="model num_attention_heads=4 is not divisible by cp=8"):
        check_layout(model, TrainParams(nproc=8, cp=8))
    check_layout(model, TrainParams(nproc=8, cp=8, cp_algo="ring"))  # ring splits no heads
    with pytest.raises(ValueError, match="train.cp: seq_length=100 is not divisible by 2\\*cp=8"):
        flow_params(tmp_path / "ws", seq_length=100, train={"nproc": 4, "cp": 4, "cp_algo": "ring"})


def test_nodes_are_counted_in_the_layout_and_only_an_engine_places_several(sample_assets):
    from llmflow.cluster.launcher import LaunchSettings
    from llmflow.flows.checks import check_layout
    from llmflow.flows.params import TrainParams
    from llmflow.mesh import LayoutError

    model = sample_assets() / "model"
    # 2 nodes x 1 worker: two pipeline stages, which one node of one worker cannot hold.
    two_nodes = TrainParams(nproc=1, nnodes=2, pp=2, micro_batch_size=4)
    check_layout(model, two_nodes, LaunchSettings(launcher="slurm"))
    with pytest.raises(LayoutError, match="nnodes=2 with the local launcher needs master_addr"):
        check_layout(model, two_nodes, LaunchSettings(launcher="local"))
    with pytest.raises(ValueError, match="nproc=1 is not a multiple of pp\\*tp"):
        TrainParams(nproc=1, pp=2, micro_batch_size=4)


@pytest.mark.slow
def test_precision_flow_dumps_both_runs_and_compares_them(prefect_env, tmp_path):
    """bf16 against fp32, as bench/gpu.py's precision section runs it on a device: one layout,
    so no noise floor; bf16's rounding breaks msprobe's rules and the advisor names where.
    (pp=2 against one process, every value equal, and tp=2 against tp=1 with merged shards
    and partial sums, are compared at the stage level: test_probe_pipeline.py, test_probe.py.)"""
    from llmflow.flows.precision import PrecisionParams, precision

    params = PrecisionParams.model_validate({"workspace": str(tmp_path / "ws"), "target": {"dtype": "bf16"},
                                             "bench": {"dtype": "fp32"}, "steps": 1, "seq_length": 32, "batch_size": 2})
    state = precision(**dict(params), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    folders = sorted((tmp_path / "ws" / "precision").glob("*/dump/step0"))
    assert len(folders) == 2 and all(list(f.glob("rank*/dump.json")) for f in folders)
    (run,) = mlflow_runs(prefect_env, "probe-compare")
    rows, passed = run.data.metrics["rows"], run.data.metrics.get("rows_pass", 0)
    assert rows > 1000 and passed < rows
    assert "Suspect Nodes:" in result["advice"] and "Noise floor on" not in result["advice"]
    assert (Path(result["comparison"]) / "advisor.txt").read_text() == result["advice"]


def test_precision_runs_take_a_cp_degree_that_splits_their_sequences():
    from llmflow.flows.params import PrecisionParams

    assert PrecisionParams(target={"cp": 2}, seq_length=64).target.cp == 2
    with pytest.raises(ValueError, match="bench.cp: seq_length=64 is not divisible by cp=3"):
        PrecisionParams(bench={"cp": 3}, seq_length=64)


def test_a_retried_flow_run_reopens_its_mlflow_parent_run(prefect_env, tmp_path):
    """A retry keeps the Prefect flow-run id; its stages nest under the first attempt's run."""
    from llmflow import tracking

    tracking.configure(tmp_path / "ws", tracking.experiment_name("finetune-eval"))
    with tracking.flow_run("finetune-eval", "flow-run-1", {"a": 1}) as first:
        pass
    with tracking.flow_run("finetune-eval", "flow-run-1", {"a": 1}) as retried, tracking.stage_run("export", {"b": 2}) as stage:
        pass
    with tracking.flow_run("finetune-eval", "flow-run-2", {"a": 1}) as other:
        pass
    assert retried == first and other != first
    client = MlflowClient(prefect_env["mlflow_uri"])
    assert client.get_run(stage).data.tags["mlflow.parentRunId"] == first
    assert client.get_run(first).data.params == {"a": "1"}
