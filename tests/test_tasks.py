"""The Prefect task layer: stage tasks run inside flows against a temporary Prefect server,
return artifact records, log one MLflow run each, are served from cache on a rerun with the
same inputs (and only then), and fail cleanly on bad input.

The server (``prefect_server`` in conftest) starts once per session (15-25 s here); every
test asks for ``prefect_env``, which points Prefect and MLflow at temporary stores.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prefect import flow
from prefect_helpers import flow_run_artifacts, mlflow_runs, outcome

from llmflow.artifacts import read_manifest, sha256_file
from llmflow.data.tokenize_instruction import InstructionTokenizeConfig
from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, output_paths
from llmflow.download import DownloadConfig
from llmflow.evaluate.choice_engine import ChoiceEvalConfig
from llmflow.tasks.common import StageArtifact
from llmflow.tasks.download import download_task
from llmflow.tasks.evaluate import EVAL_TASKS
from llmflow.tasks.tokenize import tokenize_instruction_task, tokenize_pretrain_task

pytestmark = pytest.mark.usefixtures("prefect_env")

WORDS = ["the", "model", "learns", "tokens", "from", "text", "and", "data", "flows", "through", "every", "stage", "of", "the", "pipeline", "café", "数据"]


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE (~300 ids) trained on the test corpus, as a tokenizer directory
    (tokenizer.json + tokenizer_config.json naming the eos token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(make_docs(200, seed=1), trainer=trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


def token_count(tokenizer_dir: Path, docs: list[str]) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))


def write_parquet(path: Path, docs: list[str], key: str = "text") -> Path:
    pq.write_table(pa.table({key: docs, "id": list(range(len(docs)))}), path)
    return path


# --- flows: each runs one stage task and reports its final state ---------------------------


@flow(name="test-download-stage")
def download_flow(config: DownloadConfig) -> dict[str, Any]:
    return outcome(download_task(config, return_state=True))


@flow(name="test-tokenize-pretrain-stage")
def tokenize_flow(config: PretrainTokenizeConfig) -> dict[str, Any]:
    return outcome(tokenize_pretrain_task(config, return_state=True))


@flow(name="test-eval-boolq-stage")
def boolq_flow(config: ChoiceEvalConfig) -> dict[str, Any]:
    from prefect.runtime import flow_run

    return {**outcome(EVAL_TASKS["boolq"](config, return_state=True)), "flow_run_id": flow_run.id}


@flow(name="test-tokenize-instruction-stage")
def instruction_flow(config: InstructionTokenizeConfig) -> dict[str, Any]:
    return outcome(tokenize_instruction_task(config, return_state=True))


def snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime_ns) of every file under ``directory``."""
    return {
        p.relative_to(directory).as_posix(): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# --- download ---------------------------------------------------------------------------------


@pytest.fixture
def source_dir(tmp_path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"vocab_size": 300}')
    (src / "sub" / "weights.bin").write_bytes(os.urandom(3000))
    return src


def test_download_task_returns_artifact_and_logs_mlflow_run(prefect_env, source_dir, tmp_path):
    out = tmp_path / "out"
    config = DownloadConfig(source=str(source_dir), out=out)
    result = download_flow(config)

    assert result["name"] == "Completed" and result["completed"]
    artifact = result["result"]
    assert isinstance(artifact, StageArtifact)
    assert artifact.stage == "download" and Path(artifact.path) == out.resolve()
    assert artifact.manifest == read_manifest(out)
    listed = {f["path"]: f for f in artifact.manifest["files"]}
    assert set(listed) == {"config.json", "sub/weights.bin"}
    for rel, record in listed.items():
        assert (out / rel).read_bytes() == (source_dir / rel).read_bytes()
        assert record["sha256"] == sha256_file(source_dir / rel)

    (run,) = mlflow_runs(prefect_env, "download")
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "source": str(source_dir),
        "out": str(out),
        "revision": "None",
        "include": "[]",
        "repo_type": "model",
    }
    metrics = run.data.metrics
    assert metrics["files"] == 2
    assert metrics["bytes"] == sum(f["size"] for f in listed.values()) == 3000 + len('{"vocab_size": 300}')
    assert metrics["seconds"] >= 0


def test_download_rerun_is_served_from_cache(prefect_env, source_dir, tmp_path):
    out = tmp_path / "out"
    config = DownloadConfig(source=str(source_dir), out=out, include=["*.json"])
    first = download_flow(config)
    assert first["name"] == "Completed"
    before = snapshot(out)
    assert set(before) == {"config.json", "manifest.json"}

    second = download_flow(DownloadConfig(source=str(source_dir), out=out, include=["*.json"]))
    assert second["name"] == "Cached" and second["completed"]
    assert second["result"] == first["result"]  # the stored artifact record, read back
    assert snapshot(out) == before  # nothing rewritten, not even the manifest
    assert len(mlflow_runs(prefect_env, "download")) == 1  # the task body did not run

    # The source changed in place (same path, same config): not a cache hit, the task runs.
    (source_dir / "config.json").write_text('{"vocab_size": 512, "changed": true}')
    third = download_flow(config)
    assert third["name"] == "Completed"
    assert len(mlflow_runs(prefect_env, "download")) == 2


def test_download_copies_a_local_source_changed_in_place(prefect_env, source_dir, tmp_path):
    out = tmp_path / "out"
    config = DownloadConfig(source=str(source_dir), out=out)
    assert download_flow(config)["name"] == "Completed"
    (source_dir / "config.json").write_text('{"vocab_size": 512, "changed": true}')
    result = download_flow(config)
    assert result["name"] == "Completed"
    assert (out / "config.json").read_text() == '{"vocab_size": 512, "changed": true}'
    assert result["result"].manifest == read_manifest(out)


# --- tokenize ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_tokenize_task_logs_metrics_and_reruns_only_on_new_inputs(prefect_env, tiny_tokenizer, tmp_path):
    docs = make_docs(60, seed=2)
    corpus = write_parquet(tmp_path / "a.parquet", docs)
    out = tmp_path / "data" / "corpus"
    config = PretrainTokenizeConfig(input=[corpus], tokenizer=tiny_tokenizer, out=out, batch_size=16)

    result = tokenize_flow(config)
    assert result["name"] == "Completed"
    artifact = result["result"]
    assert isinstance(artifact, StageArtifact) and artifact.stage == "tokenize-pretrain"
    assert Path(artifact.path) == out
    tokens = token_count(tiny_tokenizer, docs)
    assert artifact.manifest["documents"] == 60 and artifact.manifest["tokens"] == tokens
    assert artifact.manifest == read_manifest(out)
    assert output_paths(out)["bin"].stat().st_size == 2 * tokens  # uint16 tokens

    (run,) = mlflow_runs(prefect_env, "tokenize-pretrain")
    assert run.info.status == "FINISHED"
    assert run.data.params["input"] == str([str(corpus)]) and run.data.params["batch_size"] == "16"
    assert run.data.metrics["documents"] == 60 and run.data.metrics["tokens"] == tokens
    assert run.data.metrics["tokens_per_s"] > 0

    # Same inputs: served from cache, the stage does not run again.
    assert tokenize_flow(config)["name"] == "Cached"
    assert len(mlflow_runs(prefect_env, "tokenize-pretrain")) == 1

    # The input file rewritten in place (same path, same config): runs again.
    changed_docs = make_docs(40, seed=5)
    write_parquet(corpus, changed_docs)
    result = tokenize_flow(config)
    assert result["name"] == "Completed"
    assert result["result"].manifest["documents"] == read_manifest(out)["documents"] == 40
    assert result["result"].manifest["tokens"] == token_count(tiny_tokenizer, changed_docs)
    write_parquet(corpus, docs)  # back to the first corpus for what follows

    # Another input file: runs again.
    other_docs = make_docs(25, seed=3)
    other = write_parquet(tmp_path / "b.parquet", other_docs)
    result = tokenize_flow(config.model_copy(update={"input": [other]}))
    assert result["name"] == "Completed"
    assert result["result"].manifest["documents"] == 25
    assert result["result"].manifest["tokens"] == token_count(tiny_tokenizer, other_docs)

    # A changed parameter: runs again.
    result = tokenize_flow(config.model_copy(update={"append_eod": True}))
    assert result["name"] == "Completed"
    assert result["result"].manifest["tokens"] == tokens + 60
    runs = mlflow_runs(prefect_env, "tokenize-pretrain")
    assert [r.data.metrics["documents"] for r in runs] == [60, 40, 25, 60]
    assert [r.data.params["append_eod"] for r in runs] == ["False", "False", "False", "True"]


def test_tokenize_bad_input_fails_task_and_mlflow_run(prefect_env, tiny_tokenizer, tmp_path):
    corpus = write_parquet(tmp_path / "bad.parquet", make_docs(10, seed=4), key="content")
    out_dir = tmp_path / "data"
    out_dir.mkdir()
    config = PretrainTokenizeConfig(input=[corpus], tokenizer=tiny_tokenizer, out=out_dir / "corpus")

    result = tokenize_flow(config)
    assert result["failed"] and not result["completed"]
    assert f"{corpus}: no column 'text'" in result["message"]
    assert "columns are ['content', 'id']" in result["message"]
    assert f"{corpus}: no column 'text'" in str(result["result"])  # the exception itself
    assert read_manifest(out_dir / "corpus") is None
    assert list(out_dir.iterdir()) == []

    (run,) = mlflow_runs(prefect_env, "tokenize-pretrain")
    assert run.info.status == "FAILED"
    assert run.info.end_time is not None

    # A failure is never cached: once the input is fixed (same path, same config) the stage runs.
    write_parquet(corpus, make_docs(10, seed=4))
    result = tokenize_flow(config)
    assert result["name"] == "Completed"
    assert read_manifest(out_dir / "corpus")["documents"] == 10
    assert [r.info.status for r in mlflow_runs(prefect_env, "tokenize-pretrain")] == ["FAILED", "FINISHED"]


def test_instruction_task_logs_counts_and_is_cached(prefect_env, tiny_tokenizer, tmp_path):
    docs = make_docs(30, seed=6)
    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps({"instruction": d, "input": "", "output": d[::-1]}) + "\n" for d in docs))
    config = InstructionTokenizeConfig(
        input=[data], tokenizer=tiny_tokenizer, out=tmp_path / "sft", format="alpaca", template="chatml", seq_length=512, pack=True
    )
    result = instruction_flow(config)
    assert result["name"] == "Completed"
    manifest = result["result"].manifest
    assert manifest["samples"] == manifest["written"] == 30 and manifest["rows"] < 30
    (run,) = mlflow_runs(prefect_env, "tokenize-instruction")
    assert run.data.metrics["written"] == 30 and run.data.metrics["rows"] == manifest["rows"]
    assert run.data.metrics["trained_tokens"] == manifest["trained_tokens"] > 0
    assert instruction_flow(config)["name"] == "Cached"
    assert len(mlflow_runs(prefect_env, "tokenize-instruction")) == 1


# --- evaluation ---------------------------------------------------------------------------------


def test_evaluation_progress_reaches_the_prefect_ui(sample_assets, tmp_path):
    from prefect.client.orchestration import get_client

    sample = sample_assets()
    config = ChoiceEvalConfig(model=sample / "model", data=sample / "boolq", out=tmp_path / "eval", limit=3,
                              batch_size=1, device="cpu")
    result = boolq_flow(config)
    assert result["completed"], result["message"]
    (progress,) = flow_run_artifacts(result["flow_run_id"], "progress")
    with get_client(sync_client=True) as client:
        task_run = client.read_task_run(progress.task_run_id)
    assert progress.key == "eval-boolq-progress" and progress.data == 100.0
    assert task_run.name.startswith("eval-boolq") and str(config.model) in progress.description
