"""The inference stage: outputs equal to ``Generator.run`` called directly (any batching, raw
text, chat template and conversations), bad prompt files named before any model loads, and
its Prefect task's MLflow run (params, metrics, sample table), Prefect table artifact and
cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmflow.artifacts import read_manifest, sha256_file
from llmflow.data.templates import load_template
from llmflow.infer.batch import (
    InferConfig,
    PromptFileError,
    read_prompts,
    run_inference,
)
from llmflow.infer.generate import GenerateConfig
from llmflow.infer.generator import load_generator

RECORDS = [
    {"prompt": "The capital of"},
    {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]},
    {"prompt": "Question: what is 2 + 3?\nAnswer:"},
    {"prompt": "x"},
    {"prompt": "漢字 and ü, then a longer prompt so that the batches hold prompts of other lengths"},
]
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def sample(sample_assets) -> Path:
    return sample_assets(test_questions=2, instruct_rows=20, documents=10)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    path.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n", encoding="utf-8")  # a blank line too
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def expected_lines(model: Path, records: list[dict], template: str | None) -> list[dict]:
    """Each prompt generated alone by ``Generator.run``, as the stage writes it."""
    gen = load_generator(model)
    config = GenerateConfig(max_new_tokens=MAX_NEW_TOKENS)
    chat = load_template(model, template)
    lines = []
    for i, record in enumerate(records):
        prompt = record.get("prompt", record.get("messages"))
        if isinstance(prompt, str) and template is None:
            (result,) = gen.run([prompt], config)
        else:
            conversation = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = chat.render(conversation, add_generation_prompt=True)
            (result,) = gen.run([gen.tokenizer.encode(text, add_special_tokens=False).ids], config)
        lines.append({"index": i, "prompt": prompt, "output": result.text, "prompt_tokens": len(result.prompt_tokens),
                      "generated_tokens": len(result.tokens), "finish_reason": result.finish_reason})
    return lines


def test_outputs_equal_generator_run_in_any_batching(sample, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", RECORDS)
    common = {"model": sample / "model", "prompts": prompts, "max_new_tokens": MAX_NEW_TOKENS}
    out = run_inference(InferConfig(out=tmp_path / "out", batch_size=2, **common))
    lines = read_jsonl(out / "generations.jsonl")
    assert lines == expected_lines(sample / "model", RECORDS, None)
    assert any(line["output"] for line in lines)
    one_by_one = run_inference(InferConfig(out=tmp_path / "one", batch_size=1, **common))
    assert (one_by_one / "generations.jsonl").read_bytes() == (out / "generations.jsonl").read_bytes()

    manifest = read_manifest(out)
    assert manifest["stage"] == "infer" and manifest["prompts"] == len(RECORDS)
    assert manifest["generated_tokens"] == sum(line["generated_tokens"] for line in lines)
    assert manifest["prompt_tokens"] == sum(line["prompt_tokens"] for line in lines)
    assert manifest["tokens_per_s"] > 0 and manifest["params"]["batch_size"] == 2
    assert manifest["files"] == [{"path": "generations.jsonl", "size": (out / "generations.jsonl").stat().st_size,
                                  "sha256": sha256_file(out / "generations.jsonl")}]

    chatml = run_inference(InferConfig(out=tmp_path / "chatml", template="chatml", batch_size=3, **common))
    assert read_jsonl(chatml / "generations.jsonl") == expected_lines(sample / "model", RECORDS, "chatml")

    one_line = [line for line in lines if isinstance(line["prompt"], str) and "\n" not in line["prompt"]]
    texts = [line["prompt"] for line in one_line]
    (tmp_path / "prompts.txt").write_text(texts[0] + "\n\n" + "\n".join(texts[1:]) + "\n", encoding="utf-8")
    plain = run_inference(InferConfig(out=tmp_path / "txt", batch_size=4, **{**common, "prompts": tmp_path / "prompts.txt"}))
    assert [(line["prompt"], line["output"]) for line in read_jsonl(plain / "generations.jsonl")] == [
        (line["prompt"], line["output"]) for line in one_line]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a"}\n\n{"text": "b"}\n', r'line 3: expected a "prompt" string or a "messages" list .*got \{"text": "b"\}'),
        ('{"prompt": "a"}\n{"prompt": 5}\n', r'line 2: expected a "prompt" string'),
        ('{"messages": [{"role": "user"}]}\n', r'line 1: expected a "prompt" string or a "messages" list'),
        ('{"prompt": "a"}\nprompt: b\n', r"line 2: not JSON"),
        ("\n\n", r"prompts file .*prompts.jsonl: no prompts"),
    ],
)
def test_bad_prompt_files_fail_before_the_model_loads(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content, encoding="utf-8")
    config = InferConfig(model=tmp_path / "no-model", prompts=path, out=tmp_path / "out")
    with pytest.raises(PromptFileError, match=message) as info:
        run_inference(config)
    assert str(path) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_missing_prompts_file_and_generate_reader(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(FileNotFoundError, match=rf"prompts file {missing}: no such file"):
        run_inference(InferConfig(model=tmp_path / "no-model", prompts=missing, out=tmp_path / "out"))
    # `llmflow generate --prompts` reads with the same reader, prompt strings only.
    path = write_jsonl(tmp_path / "prompts.jsonl", RECORDS)
    with pytest.raises(PromptFileError, match=rf'{path} line 2: expected a "prompt" string, got'):
        read_prompts(path)
    assert read_prompts(path, messages=True) == [r.get("prompt", r.get("messages")) for r in RECORDS]


def test_infer_task_tracks_metrics_samples_and_is_cached(prefect_env, sample, tmp_path):
    from mlflow import MlflowClient
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from llmflow.tasks.infer import SAMPLE_TABLE, infer_task, sample_rows

    @flow(name="test-infer-stage")
    def infer_flow(config: InferConfig):
        return infer_task(config, return_state=True)

    prompts = write_jsonl(tmp_path / "prompts.jsonl", RECORDS)
    config = InferConfig(model=sample / "model", prompts=prompts, out=tmp_path / "out", max_new_tokens=MAX_NEW_TOKENS)
    state = infer_flow(config)
    assert state.name == "Completed"
    artifact = state.result()
    assert artifact.stage == "infer" and artifact.manifest == read_manifest(tmp_path / "out")
    lines = read_jsonl(tmp_path / "out" / "generations.jsonl")

    client = MlflowClient(prefect_env["mlflow_uri"])
    experiment = client.get_experiment_by_name(prefect_env["experiment"])
    (run,) = client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'infer'")
    assert run.info.status == "FINISHED"
    assert run.data.params["prompts"] == str(prompts) and run.data.params["max_new_tokens"] == str(MAX_NEW_TOKENS)
    metrics = run.data.metrics
    assert metrics["prompts"] == len(RECORDS) and metrics["tokens_per_s"] > 0
    assert metrics["generated_tokens"] == sum(line["generated_tokens"] for line in lines)
    table = client.load_table(experiment.experiment_id, SAMPLE_TABLE, run_ids=[run.info.run_id])
    assert table["output"].tolist() == [line["output"] for line in lines]
    assert table["prompt"].tolist()[0] == RECORDS[0]["prompt"]
    assert json.loads(table["prompt"].tolist()[1]) == RECORDS[1]["messages"]

    with get_client(sync_client=True) as prefect:
        (published,) = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["infer-samples"])), sort=ArtifactSort.CREATED_DESC, limit=1
        )
    assert json.loads(published.data) == sample_rows(tmp_path / "out")
    assert len(sample_rows(tmp_path / "out", rows=2)) == 2

    assert infer_flow(config).name == "Cached"
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "changed in place"}) + "\n")
    assert infer_flow(config).name == "Completed"
    assert read_manifest(tmp_path / "out")["prompts"] == 1
    assert len(client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'infer'")) == 2
