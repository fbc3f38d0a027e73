"""MMLU evaluation: both data layouts, lm-evaluation-harness's prompts character for
character, and one-pass letter scoring against full log-likelihood scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from llmflow.cli import main
from llmflow.evaluate.benchmarks import MMLU
from llmflow.evaluate.chat_context import ChatSettings, PromptRenderer
from llmflow.evaluate.engine import EvalConfig, evaluate, prompts_for, select_questions, summarize
from llmflow.evaluate.mmlu_data import load_mmlu
from llmflow.evaluate.prompts import continuations
from llmflow.evaluate.questions import BenchmarkDataError, Question
from llmflow.evaluate.scoring import (
    model_requests,
    score_loglikelihood,
    score_requests,
)
from llmflow.weights import load_model


@pytest.fixture(scope="module")
def sample(sample_assets):
    """The built-in sample assets, small: 3 subjects x (5 dev + 6 test) questions."""
    return sample_assets(test_questions=6, instruct_rows=40, documents=20)


@pytest.fixture(scope="module")
def model(sample):
    return load_model(sample / "model")[0].eval()


def lm_eval_prompt(doc: dict, dev: list[dict], k: int) -> str:
    """lm-evaluation-harness's default mmlu task, written from its documented configuration:
    description + k x (doc_to_text + target_delimiter + choice + fewshot_delimiter) + doc_to_text."""
    subject = doc["subject"]
    description = f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"

    def doc_to_text(d: dict) -> str:
        c = d["choices"]
        return f"{d['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"

    shots = [doc_to_text(d) + " " + ["A", "B", "C", "D"][d["answer"]] for d in dev[:k]]
    return description + "".join(s + "\n\n" for s in shots) + doc_to_text(doc)


def as_doc(q: Question) -> dict:
    return {"question": q.question, "subject": q.subject, "choices": list(q.choices), "answer": q.answer}


@pytest.mark.parametrize("shots", [0, 5])
def test_prompts_equal_lm_eval_template(sample, shots):
    data = load_mmlu(sample / "mmlu" / "hf")
    questions = select_questions(MMLU, data, None)
    prompts = prompts_for(MMLU, questions, data, shots)
    for q, prompt in zip(questions, prompts):
        dev = [as_doc(d) for d in data.splits["dev"][q.subject]]
        assert prompt == lm_eval_prompt(as_doc(q), dev, shots)
    assert prompts[0].startswith("The following are multiple choice questions (with answers) about elementary arithmetic.\n\n")
    assert prompts[0].endswith("\nD. " + questions[0].choices[3] + "\nAnswer:")
    assert prompts[0].count("\nAnswer:") == shots + 1


def test_question_with_surrounding_whitespace():
    q = Question("college_physics", "  Why?\n", ("a", " b", "c", "d"), 1)
    dev = [Question("college_physics", "How? ", ("1", "2", "3", "4"), 3)]
    assert MMLU.prompt.build_prompt(q, dev, 1) == lm_eval_prompt(as_doc(q), [as_doc(d) for d in dev], 1)


def test_layouts_read_the_same_questions(sample, tmp_path):
    hf, csv = load_mmlu(sample / "mmlu" / "hf"), load_mmlu(sample / "mmlu" / "csv")
    assert (hf.layout, csv.layout) == ("cais/mmlu", "csv")
    assert hf.splits == csv.splits
    assert load_mmlu(sample / "mmlu" / "csv" / "data").splits == csv.splits
    # cais/mmlu's all/ folder and top-level split files: one table with a subject column per split.
    (tmp_path / "full" / "all").mkdir(parents=True)
    (tmp_path / "flat").mkdir()
    for split in ("dev", "test"):
        tables = [pq.read_table(p) for p in sorted((sample / "mmlu" / "hf").glob(f"*/{split}-*.parquet"))]
        pq.write_table(pa.concat_tables(tables), tmp_path / "full" / "all" / f"{split}-00000-of-00001.parquet")
        pq.write_table(pa.concat_tables(tables), tmp_path / "flat" / f"{split}-00000-of-00001.parquet")
    (tmp_path / "full" / "geography").mkdir()  # per-subject folders beside all/ are not read twice
    pq.write_table(tables[0], tmp_path / "full" / "geography" / "test-00000-of-00001.parquet")
    assert load_mmlu(tmp_path / "full").splits == hf.splits
    assert load_mmlu(tmp_path / "flat").splits == hf.splits
    picked = load_mmlu(sample / "mmlu" / "csv", ["geography"])
    assert list(picked.splits["test"]) == ["geography"] and list(picked.splits["dev"]) == ["geography"]


def test_bad_layouts_are_named(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "questions.txt").write_text("what?")
    with pytest.raises(BenchmarkDataError, match=r"found \[questions.txt\].*cais/mmlu layout.*original CSV layout"):
        load_mmlu(tmp_path / "a")
    (tmp_path / "b").mkdir()
    pq.write_table(pa.table({"prompt": ["q"], "label": [1]}), tmp_path / "b" / "test.parquet")
    with pytest.raises(BenchmarkDataError, match=r"columns \['prompt', 'label'\] lack \['question', 'choices', 'answer'\]"):
        load_mmlu(tmp_path / "b")
    (tmp_path / "c" / "data" / "dev").mkdir(parents=True)
    (tmp_path / "c" / "data" / "test").mkdir()
    (tmp_path / "c" / "data" / "dev" / "law_dev.csv").write_text("q,a,b,c,d,A\n")
    (tmp_path / "c" / "data" / "test" / "law_test.csv").write_text("q,a,b,c,d,E\n")
    with pytest.raises(BenchmarkDataError, match="law_test.csv row 1: expected 6 fields"):
        load_mmlu(tmp_path / "c")
    (tmp_path / "c" / "data" / "test" / "law_test.csv").write_text("q,a,b,c,d,B\n")
    assert load_mmlu(tmp_path / "c").splits["test"]["law"][0].answer == 1
    with pytest.raises(BenchmarkDataError, match=r"no subjects \['nope'\]"):
        load_mmlu(tmp_path / "c" / "data", ["nope"])


@torch.no_grad()
def reference_scores(model, requests) -> torch.Tensor:
    """lm-evaluation-harness's log-likelihood: one unbatched full forward per (context,
    continuation) request, continuation log-probs summed."""
    scores = torch.empty(len(requests), 4)
    for i, r in enumerate(requests):
        for j, cont in enumerate(r.continuations):
            tokens = torch.tensor([r.context + cont])
            log_probs = torch.log_softmax(model(tokens[:, :-1]).float(), dim=-1)[0, -len(cont):]
            scores[i, j] = log_probs.gather(1, torch.tensor(cont)[:, None]).sum()
    return scores


def sample_requests(sample, shots: int, limit: int = 2, chat: bool = False):
    data = load_mmlu(sample / "mmlu" / "hf")
    renderer = PromptRenderer(ChatSettings(apply_chat_template=chat), sample / "model")
    prompts = prompts_for(MMLU, select_questions(MMLU, data, limit), data, shots, renderer)
    return model_requests(sample / "model", prompts, [continuations(renderer)] * len(prompts))


def test_single_pass_scores_equal_loglikelihood(sample, model):
    requests = sample_requests(sample, shots=1)
    assert all(r.single_token for r in requests)
    expected = reference_scores(model, requests)
    fast, one_pass = score_requests(model, requests, batch_size=5, max_length=1024)
    assert all(one_pass)
    full = score_loglikelihood(model, requests, batch_size=7, max_length=1024)
    torch.testing.assert_close(fast, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=1e-4)
    assert fast.argmax(1).tolist() == expected.argmax(1).tolist()


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_batched_equals_unbatched(sample, model, padding_side):
    requests = sample_requests(sample, shots=1, limit=3)
    one, _ = score_requests(model, requests, batch_size=1, max_length=1024)
    many, fast = score_requests(model, requests, batch_size=5, max_length=1024, padding_side=padding_side)
    assert all(fast)
    torch.testing.assert_close(many, one, atol=1e-4, rtol=1e-4)
    assert many.argmax(1).tolist() == one.argmax(1).tolist()


def test_multi_token_continuations_fall_back_to_loglikelihood(sample, model):
    # The chat prompt ends in a newline, which (as lm-evaluation-harness does) moves into the
    # continuation: "\nA" is more than one token.
    requests = sample_requests(sample, shots=0, limit=1, chat=True)
    assert not any(r.single_token for r in requests)
    scores, fast = score_requests(model, requests, batch_size=3, max_length=1024)
    assert not any(fast)
    torch.testing.assert_close(scores, reference_scores(model, requests), atol=1e-4, rtol=1e-4)


def test_truncation_keeps_the_end_of_the_context(sample, model):
    requests = sample_requests(sample, shots=5, limit=1)
    fast, _ = score_requests(model, requests, batch_size=2, max_length=40)
    full = score_loglikelihood(model, requests, batch_size=2, max_length=40)
    torch.testing.assert_close(fast, full, atol=1e-4, rtol=1e-4)


def test_layouts_give_identical_results_and_cli(sample, tmp_path, capsys):
    common = {"model": sample / "model", "shots": 1, "limit": 2, "batch_size": 4}
    hf = evaluate(MMLU, EvalConfig(data=sample / "mmlu" / "hf", out=tmp_path / "hf", **common))
    main(["eval", "mmlu", "--model", str(sample / "model"), "--data", str(sample / "mmlu" / "csv"), "--shots", "1",
          "--limit", "2", "--batch-size", "2", "--padding-side", "left", "--out", str(tmp_path / "csv")])
    printed = capsys.readouterr().out
    assert "[all]" in printed and "geography" in printed
    csv = tmp_path / "csv"
    a, b = json.loads((hf / "results.json").read_text()), json.loads((csv / "results.json").read_text())
    for key in ("accuracy", "correct", "questions", "subjects", "categories", "single_pass_questions"):
        assert a[key] == b[key]
    assert a["questions"] == 6 and a["settings"]["layout"] == "cais/mmlu" and b["settings"]["layout"] == "csv"
    rows_a = [json.loads(line) for line in (hf / "predictions.jsonl").read_text().splitlines()]
    rows_b = [json.loads(line) for line in (csv / "predictions.jsonl").read_text().splitlines()]
    assert [(r["subject"], r["index"], r["prediction"], r["answer"]) for r in rows_a] == [
        (r["subject"], r["index"], r["prediction"], r["answer"]) for r in rows_b]
    torch.testing.assert_close(torch.tensor([r["scores"] for r in rows_a]), torch.tensor([r["scores"] for r in rows_b]),
                               atol=1e-4, rtol=1e-4)
    assert sum(r["correct"] for r in rows_a) == a["correct"]
    manifest = json.loads((hf / "manifest.json").read_text())
    assert manifest["stage"] == "eval-mmlu" and manifest["accuracy"] == a["accuracy"]
    assert {f["path"] for f in manifest["files"]} == {"results.json", "predictions.jsonl"}


def test_summary_groups_subjects_into_categories():
    questions = [Question(s, "q", ("a", "b", "c", "d"), 0) for s in
                 ("abstract_algebra", "abstract_algebra", "philosophy", "sociology", "virology", "geography")]
    results = summarize(MMLU, questions, [0, 1, 0, 0, 1, 0])
    assert results["accuracy"] == pytest.approx(4 / 6)
    assert {c: (v["correct"], v["questions"]) for c, v in results["categories"].items()} == {
        "stem": (1, 2), "humanities": (1, 1), "social_sciences": (1, 1), "other": (1, 2)}
    assert results["subjects"]["geography"]["category"] == "other"


@pytest.mark.slow
def test_evaluate_task_logs_accuracy_and_table(prefect_env, sample, tmp_path):
    from mlflow import MlflowClient
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from llmflow.tasks.evaluate import EVAL_TASKS

    @flow
    def eval_flow(config: EvalConfig):
        return EVAL_TASKS["mmlu"](config)

    config = EvalConfig(model=sample / "model", data=sample / "mmlu" / "hf", out=tmp_path / "eval", shots=0, limit=2)
    artifact = eval_flow(config)
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert artifact.stage == "eval-mmlu" and artifact.manifest["accuracy"] == results["accuracy"]

    client = MlflowClient(prefect_env["mlflow_uri"])
    experiment = client.get_experiment_by_name(prefect_env["experiment"])
    (run,) = client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'eval-mmlu'")
    metrics = run.data.metrics
    assert metrics["accuracy"] == pytest.approx(results["accuracy"]) and metrics["questions"] == 6
    assert metrics["accuracy/geography"] == pytest.approx(results["subjects"]["geography"]["accuracy"])
    assert metrics["accuracy/other"] == pytest.approx(results["accuracy"])
    logged = json.loads((Path(run.info.artifact_uri.removeprefix("file://")) / "mmlu_subjects.json").read_text())
    assert logged["columns"] == ["subject", "category", "questions", "accuracy"] and len(logged["data"]) == 4

    with get_client(sync_client=True) as client:
        (table,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["mmlu-accuracy"])), sort=ArtifactSort.CREATED_DESC, limit=1
        )
    rows = json.loads(table.data)
    assert [r["subject"] for r in rows] == [*results["subjects"], "all"]


def hub_files(hub, repo: str) -> set[str]:
    """The files of ``repo`` the loopback hub has served so far."""
    prefix = f"/datasets/{repo}/resolve/{hub.commit}/"
    return {p[len(prefix):] for p in hub.file_gets() if p.startswith(prefix)}


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def test_hub_data_is_downloaded_once_with_only_the_files_needed(hub, sample, tmp_path):
    local = sample / "mmlu" / "hf"
    files = {p.relative_to(local).as_posix(): p.read_bytes() for p in sorted(local.rglob("*.parquet"))}
    for split in ("dev", "test"):  # cais/mmlu holds every subject again in all/
        tables = [pq.read_table(p) for p in sorted(local.glob(f"*/{split}-*.parquet"))]
        files[f"all/{split}-00000-of-00001.parquet"] = parquet_bytes(pa.concat_tables(tables))
    files["all/auxiliary_train-00000-of-00001.parquet"] = b"never fetched"
    files["geography/validation-00000-of-00001.parquet"] = b"never fetched"
    hub.repos[("dataset", "cais/mmlu")] = files
    common = {"model": sample / "model", "shots": 1, "limit": 2, "cache_dir": tmp_path / "cache"}

    out = evaluate(MMLU, EvalConfig(data="hf://cais/mmlu", subjects=["geography"], out=tmp_path / "hub", **common))
    assert hub_files(hub, "cais/mmlu") == {"geography/dev-00000-of-00001.parquet", "geography/test-00000-of-00001.parquet"}
    cached = tmp_path / "cache" / "hf" / "cais" / "mmlu"
    assert {f["path"] for f in json.loads((cached / "manifest.json").read_text())["files"]} == hub_files(hub, "cais/mmlu")
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["data_dir"] == str(cached) and results["questions"] == 2
    same = evaluate(MMLU, EvalConfig(data=local, subjects=["geography"], out=tmp_path / "local", **common))
    assert (out / "predictions.jsonl").read_text() == (same / "predictions.jsonl").read_text()

    hub.requests.clear()  # a rerun checks the cached files against the manifest and fetches nothing
    evaluate(MMLU, EvalConfig(data="hf://cais/mmlu", subjects=["geography"], out=tmp_path / "again", **common))
    assert hub.requests == []

    out = evaluate(MMLU, EvalConfig(data="hf://cais/mmlu", out=tmp_path / "all", **common))
    assert hub_files(hub, "cais/mmlu") == {"all/dev-00000-of-00001.parquet", "all/test-00000-of-00001.parquet"}
    assert json.loads((out / "results.json").read_text())["questions"] == 6


def test_unknown_data_source_fails_before_the_model_loads(tmp_path):
    config = EvalConfig(model=tmp_path / "no-model", data="s3://bucket/mmlu", out=tmp_path / "out")
    with pytest.raises(ValueError, match=r"source 's3://bucket/mmlu': unknown scheme"):
        evaluate(MMLU, config)
    assert not (tmp_path / "out").exists()
