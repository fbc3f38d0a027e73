"""``llmflow eval mmlu``: MMLU accuracy of a model, scored as lm-evaluation-harness's default
``mmlu`` task scores it.

Writes ``results.json`` (accuracy overall, per subject and per category, counts, settings)
and ``predictions.jsonl`` (one line per question: subject, index, the four scores, the
prediction and the answer) into ``--out``, with ``manifest.json`` last.
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
from llmflow.data.tokenizer import load_tokenizer
from llmflow.evaluate.categories import CATEGORIES, category_of
from llmflow.evaluate.mmlu_data import LETTERS, MMLUData, Question, load_mmlu
from llmflow.evaluate.prompts import CONTINUATIONS, build_prompt, chat_prompt
from llmflow.evaluate.scoring import encode_requests, score_requests
from llmflow.model_loading import load_model, tokenizer_dir
from llmflow.runtime import detect_device_type, resolve_dtype

STAGE = "eval-mmlu"
DEFAULT_MAX_LENGTH = 2048


class MMLUConfig(BaseModel):
    """Evaluate a model on MMLU (lm-evaluation-harness's prompts and scoring)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: Path
    """Hugging Face model directory, training checkpoint (root or step directory) or LoRA checkpoint."""
    data: Path
    """MMLU directory: the cais/mmlu parquet layout or the original CSV layout (data/{dev,test}/*.csv)."""
    out: Path
    """Output directory: results.json, predictions.jsonl and manifest.json (replaced as a whole)."""
    shots: int = Field(default=5, ge=0, le=5)
    """Solved dev questions of the same subject before each question (the first ones, in file order)."""
    subjects: list[str] | None = None
    """Subjects to evaluate (default: all in the data)."""
    limit: int | None = Field(default=None, ge=1)
    """Evaluate only the first N test questions of each subject."""
    batch_size: int = Field(default=8, ge=1)
    """Sequences per forward pass."""
    template: str = "none"
    """Chat template: "none" for the plain prompt, "tokenizer" for the tokenizer's own, or a
    named template; the prompt becomes the user message, followed by the assistant's turn header."""
    padding_side: Literal["right", "left"] = "right"
    """Where batches are padded (the scores do not depend on it)."""
    device: str = "auto"
    """cpu, cuda or npu; auto picks npu, then cuda, then cpu."""
    dtype: str = "auto"
    """Compute dtype: fp32, bf16, fp16, or auto (bf16 on accelerators that support it, fp32 on CPU)."""


def select_questions(data: MMLUData, limit: int | None) -> list[Question]:
    """The test questions to evaluate: every subject's (its first ``limit``), subjects sorted."""
    return [q for subject in sorted(data.splits["test"]) for q in data.splits["test"][subject][:limit]]


def prompts_for(questions: list[Question], data: MMLUData, shots: int) -> list[str]:
    """The plain-text prompt of every question."""
    return [build_prompt(q, data.splits["dev"].get(q.subject, []), shots) for q in questions]


def _accuracy(correct: int, questions: int) -> dict[str, Any]:
    return {"accuracy": correct / questions if questions else 0.0, "correct": correct, "questions": questions}


def summarize(questions: list[Question], predictions: list[int]) -> dict[str, Any]:
    """Accuracy overall, per subject and per category (each over its questions)."""
    per_subject: dict[str, list[int]] = {}
    for q, p in zip(questions, predictions):
        per_subject.setdefault(q.subject, [0, 0])
        per_subject[q.subject][0] += int(p == q.answer)
        per_subject[q.subject][1] += 1
    subjects = {s: {**_accuracy(c, n), "category": category_of(s)} for s, (c, n) in sorted(per_subject.items())}
    categories = {}
    for category in CATEGORIES:
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


def _load(config: MMLUConfig) -> tuple[Any, Any, int]:
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


def evaluate_mmlu(config: MMLUConfig) -> Path:
    """Evaluate ``config.model`` on MMLU; writes the results into ``config.out`` and returns it."""
    data = load_mmlu(config.data, config.subjects)
    questions = select_questions(data, config.limit)
    prompts = prompts_for(questions, data, config.shots)
    model, tok_dir, max_length = _load(config)
    if config.template != "none":
        template = load_template(tok_dir, config.template)
        prompts = [chat_prompt(p, template) for p in prompts]
    start = time.monotonic()
    requests = encode_requests(load_tokenizer(tok_dir), prompts, CONTINUATIONS)
    scores, fast = score_requests(model, requests, config.batch_size, max_length, config.padding_side)
    seconds = time.monotonic() - start
    predictions = scores.argmax(dim=1).tolist()
    results = summarize(questions, predictions)
    results["settings"] = {**config.model_dump(mode="json"), "layout": data.layout, "max_length": max_length}
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
        write_json_atomic(work / MANIFEST, manifest_payload(STAGE, config.model_dump(mode="json"), files, **metrics))
    return out


class MMLUCommand(MMLUConfig):
    """Evaluate a model on MMLU with lm-evaluation-harness's prompts and scoring; writes
    results.json and predictions.jsonl into --out and prints the accuracy table."""

    def cli_cmd(self) -> None:
        out = evaluate_mmlu(MMLUConfig(**self.model_dump()))
        print(format_table(json.loads((out / "results.json").read_text())))
        print(f"wrote {out / 'results.json'} and {out / 'predictions.jsonl'}")
