"""The multiple-choice evaluation engine behind ``llmflow eval mmlu|ceval|cmmlu``: a benchmark's
questions, prompted and scored as lm-evaluation-harness does it.

Writes ``results.json`` (accuracy overall, per subject and per category, counts, the
standard error and the macro average over subjects beside the micro headline, a hash of the
prompts, the model's identity and llmflow's version, settings)
and ``predictions.jsonl`` (one line per question: subject, index, the four scores, the
prediction and the answer) into ``out``, with ``manifest.json`` last. The data is read and
every prompt built before the model is loaded, so bad data fails fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from llmflow.artifacts import (
    MANIFEST,
    atomic_directory,
    file_record,
    manifest_payload,
    write_json_atomic,
)
from llmflow.evaluate.benchmarks import Benchmark
from llmflow.evaluate.chat_context import PLAIN_PROMPTS, PromptRenderer, check_loglikelihood
from llmflow.evaluate.hub_data import local_data
from llmflow.evaluate.prompts import continuations
from llmflow.evaluate.provenance import llmflow_version, model_identity, prompts_sha256
from llmflow.evaluate.questions import LETTERS, BenchmarkData, Question
from llmflow.evaluate.scoring import model_requests, score_requests
from llmflow.evaluate.settings import EvalSettings, load_for_eval
from llmflow.evaluate.statistics import stderr_of_mean
from llmflow.progress import Progress, no_progress
from llmflow.runtime import available_device


class EvalConfig(EvalSettings):
    """Evaluate a model on a multiple-choice benchmark (lm-evaluation-harness's prompts and scoring)."""

    shots: int = Field(default=5, ge=0, le=5)
    """Solved dev questions of the same subject before each question (the first ones, in file order)."""
    subjects: list[str] | None = None
    """Subjects to evaluate (default: all in the data)."""
    shared_prefix: bool = True
    """Run the prompt prefix a subject's questions share (description and few-shot examples)
    once, into a KV cache, and each question's own tokens on top of it; false runs every
    prompt in full. The scores are the same within fp32 rounding."""


def select_questions(benchmark: Benchmark, data: BenchmarkData, limit: int | None) -> list[Question]:
    """The questions to evaluate: every subject's in the evaluated split (its first ``limit``), subjects sorted."""
    split = data.splits[benchmark.eval_split]
    return [q for subject in sorted(split) for q in split[subject][:limit]]


def prompts_for(benchmark: Benchmark, questions: list[Question], data: BenchmarkData, shots: int,
                renderer: PromptRenderer = PLAIN_PROMPTS) -> list[str]:
    """The prompt of every question, rendered by ``renderer``."""
    fewshot = data.splits[benchmark.fewshot_split]
    return [benchmark.prompt.build_prompt(q, fewshot.get(q.subject, []), shots, renderer) for q in questions]


def _accuracy(correct: int, questions: int) -> dict[str, Any]:
    return {"accuracy": correct / questions if questions else 0.0, "correct": correct, "questions": questions}


def summarize(benchmark: Benchmark, questions: list[Question], predictions: list[int]) -> dict[str, Any]:
    """Accuracy overall, per subject and per category (each over its questions)."""
    per_subject: dict[str, list[int]] = {}
    for q, p in zip(questions, predictions):
        per_subject.setdefault(q.subject, [0, 0])
        per_subject[q.subject][0] += int(p == q.answer)
        per_subject[q.subject][1] += 1
    subjects = {s: {**_accuracy(c, n), "category": benchmark.category_of(s)} for s, (c, n) in sorted(per_subject.items())}
    categories = {}
    for category in benchmark.categories:
        members = [v for v in subjects.values() if v["category"] == category]
        if members:
            categories[category] = _accuracy(sum(v["correct"] for v in members), sum(v["questions"] for v in members))
    total = sum(v["correct"] for v in subjects.values())
    return {**_accuracy(total, len(questions)), "categories": categories, "subjects": subjects}


def format_table(results: dict[str, Any]) -> str:
    """Per-subject, per-category and overall accuracy as a text table."""
    rows = [("subject", "category", "questions", "accuracy")]
    rows += [(s, v["category"], str(v["questions"]), f"{v['accuracy']:.4f}") for s, v in results["subjects"].items()]
    rows += [(f"[{c}]", "", str(v["questions"]), f"{v['accuracy']:.4f}") for c, v in results["categories"].items()]
    rows.append(("[all]", "", str(results["questions"]), f"{results['accuracy']:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def _predictions_lines(questions: list[Question], scores: torch.Tensor, fast: list[bool]) -> list[str]:
    lines, index = [], {}
    for q, row, one_pass in zip(questions, scores.tolist(), fast):
        index[q.subject] = index.get(q.subject, -1) + 1
        prediction = max(range(len(row)), key=row.__getitem__)
        record = {"subject": q.subject, "index": index[q.subject], "scores": row, "prediction": LETTERS[prediction],
                  "answer": LETTERS[q.answer], "correct": prediction == q.answer, "single_pass": one_pass}
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    return lines


def evaluate(benchmark: Benchmark, config: EvalConfig, progress: Progress = no_progress) -> Path:
    """Evaluate ``config.model`` on ``benchmark``; writes the results into ``config.out`` and returns it.
    ``progress`` hears how many questions are scored."""
    if config.device != "auto":
        available_device(config.device)  # a device that is not there is refused before any download
    check_loglikelihood(config, benchmark.title)
    data_dir = local_data(config.data, config.cache_dir, benchmark.hub_include(config.subjects))
    data = benchmark.load(data_dir, config.subjects)
    questions = select_questions(benchmark, data, config.limit)
    renderer = PromptRenderer.for_model(config, config.model)
    prompts = prompts_for(benchmark, questions, data, config.shots, renderer)
    answers = continuations(renderer)
    model, tok_dir, max_length = load_for_eval(config)
    start = time.monotonic()
    requests = model_requests(tok_dir, prompts, [answers] * len(prompts))
    groups = [q.subject for q in questions] if config.shared_prefix else None
    scores, fast = score_requests(model, requests, config.batch_size, max_length, config.padding_side, groups,
                                  progress=progress)
    seconds = time.monotonic() - start
    predictions = scores.argmax(dim=1).tolist()
    results = {"benchmark": benchmark.name, **summarize(benchmark, questions, predictions)}
    correct = [float(p == q.answer) for p, q in zip(predictions, questions)]
    subjects = results["subjects"].values()
    results["accuracy_stderr"] = stderr_of_mean(correct)
    results["headline"] = {"metric": "accuracy", "average": "micro", "value": results["accuracy"],
                           "stderr": results["accuracy_stderr"]}
    results["macro_accuracy"] = sum(v["accuracy"] for v in subjects) / len(subjects)
    results["prompts_sha256"] = prompts_sha256(prompts, [answers] * len(prompts))
    results["first_prompt"] = prompts[0]
    results["fewshot"] = {"shots": config.shots, "split": benchmark.fewshot_split,
                          "sampler": "lm-evaluation-harness first_n (the subject's first questions, in file order)"}
    results["model"] = model_identity(config.model)
    results["llmflow_version"] = llmflow_version()
    results["settings"] = {**config.model_dump(mode="json"), "fewshot_as_multiturn": config.multiturn, "layout": data.layout, "data_dir": str(data_dir),
                           "split": benchmark.eval_split, "max_length": max_length}
    results["single_pass_questions"] = sum(fast)
    results["seconds"] = seconds
    results["questions_per_s"] = len(questions) / seconds
    out = Path(config.out).expanduser().resolve()
    with atomic_directory(out) as work:
        write_json_atomic(work / "results.json", results)
        with open(work / "predictions.jsonl", "w", encoding="utf-8") as f:
            f.writelines(_predictions_lines(questions, scores, fast))
        files = [file_record(work / name, work) for name in ("results.json", "predictions.jsonl")]
        metrics = {key: results[key] for key in ("accuracy", "accuracy_stderr", "questions", "questions_per_s")}
        write_json_atomic(work / MANIFEST, manifest_payload(benchmark.stage, config.model_dump(mode="json"), files, **metrics))
    return out
