"""The multiple-choice evaluation engine behind ``llmflow eval mmlu|ceval|cmmlu``: a benchmark's
questions, prompted and scored as lm-evaluation-harness does it.

Writes ``results.json`` (accuracy overall, per subject and per category, counts, settings)
and ``predictions.jsonl`` (one line per question: subject, index, the four scores, the
prediction and the answer) into ``out``, with ``manifest.json`` last. The data is read and
every prompt built before the model is loaded, so bad data fails fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from llmflow.artifacts import (
    MANIFEST,
    atomic_directory,
    file_record,
    manifest_payload,
    write_json_atomic,
)
from llmflow.data.templates import load_template
from llmflow.evaluate.benchmarks import Benchmark
from llmflow.evaluate.hub_data import local_data
from llmflow.evaluate.prompts import CONTINUATIONS
from llmflow.evaluate.questions import LETTERS, BenchmarkData, Question
from llmflow.evaluate.scoring import model_requests, score_requests
from llmflow.model_loading import load_model, tokenizer_dir
from llmflow.runtime import available_device, detect_device_type, resolve_dtype

DEFAULT_MAX_LENGTH = 2048


class EvalConfig(BaseModel):
    """Evaluate a model on a multiple-choice benchmark (lm-evaluation-harness's prompts and scoring)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: Path
    """Hugging Face model directory, training checkpoint (root or step directory) or LoRA checkpoint."""
    data: Path | str
    """The benchmark's data: a local directory in one of its published layouts, or a hub dataset
    (hf://cais/mmlu, hf://ceval/ceval-exam, hf://haonan-li/cmmlu, ms://org/name), downloaded
    into cache_dir first (only the files the evaluation reads)."""
    out: Path
    """Output directory: results.json, predictions.jsonl and manifest.json (replaced as a whole)."""
    shots: int = Field(default=5, ge=0, le=5)
    """Solved dev questions of the same subject before each question (the first ones, in file order)."""
    subjects: list[str] | None = None
    """Subjects to evaluate (default: all in the data)."""
    limit: int | None = Field(default=None, ge=1)
    """Evaluate only the first N questions of each subject."""
    batch_size: int = Field(default=8, ge=1)
    """Sequences per forward pass."""
    template: str = "none"
    """Chat template: "none" for the plain prompt, "tokenizer" for the tokenizer's own, or a
    named template; the prompt becomes the user message, followed by the assistant's turn header."""
    padding_side: Literal["right", "left"] = "right"
    """Where batches are padded (the scores do not depend on it)."""
    shared_prefix: bool = True
    """Run the prompt prefix a subject's questions share (description and few-shot examples)
    once, into a KV cache, and each question's own tokens on top of it; false runs every
    prompt in full. The scores are the same within fp32 rounding."""
    device: str = "auto"
    """cpu, cuda or npu; auto picks npu, then cuda, then cpu."""
    dtype: str = "auto"
    """Compute dtype: fp32, bf16, fp16, or auto (bf16 on accelerators that support it, fp32 on CPU)."""
    cache_dir: Path = Path("~/.cache/llmflow")
    """Where hub data is downloaded (cache_dir/hf/org/name, with a manifest; verified, not
    fetched again, on later runs)."""


def select_questions(benchmark: Benchmark, data: BenchmarkData, limit: int | None) -> list[Question]:
    """The questions to evaluate: every subject's in the evaluated split (its first ``limit``), subjects sorted."""
    split = data.splits[benchmark.eval_split]
    return [q for subject in sorted(split) for q in split[subject][:limit]]


def prompts_for(benchmark: Benchmark, questions: list[Question], data: BenchmarkData, shots: int) -> list[str]:
    """The plain-text prompt of every question."""
    fewshot = data.splits[benchmark.fewshot_split]
    return [benchmark.prompt.build_prompt(q, fewshot.get(q.subject, []), shots) for q in questions]


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


def _load(config: EvalConfig) -> tuple[Any, Any, int]:
    device_type = detect_device_type() if config.device == "auto" else config.device
    model, hf_config = load_model(config.model, device_type)
    model = model.to(resolve_dtype(config.dtype, device_type)).eval()
    tok_dir = tokenizer_dir(config.model)
    if tok_dir is None:
        raise FileNotFoundError(f"model {config.model}: no tokenizer (tokenizer.json) found with it")
    return model, tok_dir, int(hf_config.get("max_position_embeddings") or DEFAULT_MAX_LENGTH)


def _predictions_lines(questions: list[Question], scores: torch.Tensor, fast: list[bool]) -> list[str]:
    lines, index = [], {}
    for q, row, one_pass in zip(questions, scores.tolist(), fast):
        index[q.subject] = index.get(q.subject, -1) + 1
        prediction = max(range(len(row)), key=row.__getitem__)
        record = {"subject": q.subject, "index": index[q.subject], "scores": row, "prediction": LETTERS[prediction],
                  "answer": LETTERS[q.answer], "correct": prediction == q.answer, "single_pass": one_pass}
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    return lines


def evaluate(benchmark: Benchmark, config: EvalConfig) -> Path:
    """Evaluate ``config.model`` on ``benchmark``; writes the results into ``config.out`` and returns it."""
    if config.device != "auto":
        available_device(config.device)  # a device that is not there is refused before any download
    data_dir = local_data(config.data, config.cache_dir, benchmark.hub_include(config.subjects))
    data = benchmark.load(data_dir, config.subjects)
    questions = select_questions(benchmark, data, config.limit)
    prompts = prompts_for(benchmark, questions, data, config.shots)
    model, tok_dir, max_length = _load(config)
    if config.template != "none":
        template = load_template(tok_dir, config.template)
        prompts = [template.prompt(p) for p in prompts]
    start = time.monotonic()
    requests = model_requests(tok_dir, prompts, CONTINUATIONS)
    groups = [q.subject for q in questions] if config.shared_prefix else None
    scores, fast = score_requests(model, requests, config.batch_size, max_length, config.padding_side, groups)
    seconds = time.monotonic() - start
    results = {"benchmark": benchmark.name, **summarize(benchmark, questions, scores.argmax(dim=1).tolist())}
    results["settings"] = {**config.model_dump(mode="json"), "layout": data.layout, "data_dir": str(data_dir),
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
        metrics = {key: results[key] for key in ("accuracy", "questions", "questions_per_s")}
        write_json_atomic(work / MANIFEST, manifest_payload(benchmark.stage, config.model_dump(mode="json"), files, **metrics))
    return out
