"""The engine behind ``llmflow eval boolq`` and ``llmflow eval agieval``: documents with their
own choices, prompted, scored and aggregated as lm-evaluation-harness does it.

A prompt is the few-shot examples (each its text, " ", its right choice and "\\n\\n"), then the
document's text; every choice is scored as the continuation " " + choice. ``acc`` takes the
choice of highest log-likelihood, ``acc_norm`` the highest log-likelihood per character of the
choice; each comes with the harness's standard error of the mean (sample deviation, n - 1).
A group's score is the mean over all its documents (micro, weighted by task size: the harness's
``agieval_en`` headline), reported beside the mean of its tasks' scores (macro), with the
harness's pooled standard error.

Writes ``results.json``, ``predictions.jsonl`` (per document: task, index, scores,
predictions, gold, few-shot indices) and ``manifest.json`` last. Every document is read and
every prompt built before the model is loaded.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from llmflow.evaluate.chat_context import (
    PLAIN_PROMPTS,
    TARGET_DELIMITER,
    Example,
    PromptRenderer,
    check_loglikelihood,
)
from llmflow.evaluate.choice_tasks import ChoiceTask, Doc, TaskGroup
from llmflow.evaluate.fewshot import HARNESS_SEED, fewshot_indices
from llmflow.evaluate.hub_data import is_hub_source, local_data
from llmflow.evaluate.provenance import prompts_sha256
from llmflow.evaluate.reporting import group_results, headline, run_record, write_outputs
from llmflow.evaluate.scoring import model_requests, score_requests
from llmflow.evaluate.settings import EvalSettings, load_for_eval
from llmflow.evaluate.statistics import stderr_of_mean
from llmflow.evaluate.task_selection import check_task_directories, select_tasks
from llmflow.progress import Progress, no_progress
from llmflow.runtime import available_device


class ChoiceEvalConfig(EvalSettings):
    """Evaluate a model on log-likelihood tasks whose documents carry their own choices."""

    shots: int = Field(default=0, ge=0)
    """Few-shot examples before each document, drawn as lm-evaluation-harness draws them (seeded,
    from the task's few-shot split); the harness's default for these tasks is 0."""
    fewshot_seed: int = HARNESS_SEED
    """Seed of the few-shot draws (lm-evaluation-harness's --fewshot_random_seed)."""
    tasks: list[str] | None = None
    """Tasks of the group to evaluate, by the harness's names (default: all)."""


@dataclass
class TaskRun:
    """One task's documents, their prompts and, once scored, their log-likelihoods."""

    task: ChoiceTask
    docs: list[Doc]
    shots: list[list[int]]
    contexts: list[str]


def group_data(group: TaskGroup, tasks: list[ChoiceTask], data: str | Path, cache_dir: Path) -> Path:
    """The group's local data directory: ``data`` itself, or the download of its hub source."""
    if not is_hub_source(data):
        return Path(data).expanduser()
    if len(group.tasks) == 1:
        return local_data(data, cache_dir, list(group.tasks[0].hub_include))
    if str(data).rstrip("/") != group.hub_root:
        raise ValueError(f"{group.title} data {data}: expected a local directory or {group.hub_root} "
                         f"(every task's dataset, {', '.join(t.hub_repo for t in group.tasks)})")
    for task in tasks:
        local_data(f"hf://{task.hub_repo}", cache_dir, list(task.hub_include))
    return Path(cache_dir).expanduser() / "hf" / group.hub_root.removeprefix("hf://")


def build_runs(group: TaskGroup, tasks: list[ChoiceTask], root: Path, config: ChoiceEvalConfig,
               renderer: PromptRenderer = PLAIN_PROMPTS) -> list[TaskRun]:
    """Every task's documents (its first ``limit``) with their few-shot prompts, rendered by ``renderer``."""
    if len(group.tasks) > 1:
        check_task_directories(group.title, root, tasks, lambda task: group.local_dir(root, task), "dataset")
    runs = []
    for task in tasks:
        where = group.local_dir(root, task)
        if config.shots and task.fewshot_split is None:
            raise ValueError(f"{task.name}: shots={config.shots}, but lm-evaluation-harness runs it zero-shot "
                             "only (its documents have no split to draw examples from); use shots=0")
        docs = task.read(where, task.eval_split)[: config.limit]
        pool = task.read(where, task.fewshot_split) if config.shots else []
        try:
            shots = fewshot_indices(docs, pool, config.shots, config.fewshot_seed)
        except ValueError as e:
            raise ValueError(f"{task.name} data {where}: {e}") from None
        contexts = [renderer.prompt("", [Example(pool[i].text, pool[i].choices[pool[i].gold[0]]) for i in picked],
                                    doc.text, task.name) for doc, picked in zip(docs, shots)]
        runs.append(TaskRun(task, docs, shots, contexts))
    return runs


def continuations(doc: Doc, renderer: PromptRenderer = PLAIN_PROMPTS) -> list[str]:
    """What is scored after the prompt: each choice after the target delimiter (none under a
    chat template)."""
    return [renderer.continuation_delimiter(TARGET_DELIMITER) + choice for choice in doc.choices]


def doc_outcome(doc: Doc, lls: list[float]) -> dict[str, Any]:
    """The document's predictions and metrics from its choices' log-likelihoods."""
    pred = max(range(len(lls)), key=lls.__getitem__)
    normed = [ll / len(choice) for ll, choice in zip(lls, doc.choices)]
    pred_norm = max(range(len(normed)), key=normed.__getitem__)
    return {"scores": lls, "prediction": pred, "prediction_norm": pred_norm, "gold": list(doc.gold),
            "acc": float(pred in doc.gold), "acc_norm": float(pred_norm in doc.gold)}


def task_results(run: TaskRun, outcomes: list[dict[str, Any]], shots: int, seed: int,
                 renderer: PromptRenderer) -> dict[str, Any]:
    """A task's metrics with their standard errors, its size and what fixes its prompts."""
    results: dict[str, Any] = {"version": run.task.version, "samples": len(outcomes)}
    for metric in run.task.metrics:
        values = [o[metric] for o in outcomes]
        results[metric] = sum(values) / len(values)
        results[f"{metric}_stderr"] = stderr_of_mean(values)
    results["prompts_sha256"] = prompts_sha256(run.contexts, [continuations(d, renderer) for d in run.docs])
    results["first_prompt"] = run.contexts[0]
    results["fewshot"] = {"shots": shots, "split": run.task.fewshot_split if shots else None,
                          "sampler": "lm-evaluation-harness default (seeded, n + 1 drawn per document, "
                                     "the document itself left out)",
                          "seed": seed if shots else None}
    return results


def evaluate_choices(group: TaskGroup, config: ChoiceEvalConfig, progress: Progress = no_progress) -> Path:
    """Evaluate ``config.model`` on ``group``'s tasks; writes the results into ``config.out`` and returns it.
    ``progress`` hears how many documents are scored."""
    if config.device != "auto":
        available_device(config.device)  # a device that is not there is refused before any download
    check_loglikelihood(config, group.title)
    tasks = select_tasks(group.title, group.tasks, config.tasks)
    root = group_data(group, tasks, config.data, config.cache_dir)
    renderer = PromptRenderer.for_model(config, config.model)
    runs = build_runs(group, tasks, root, config, renderer)
    model, tok_dir, max_length = load_for_eval(config)
    contexts = [c for run in runs for c in run.contexts]
    start = time.monotonic()
    requests = model_requests(tok_dir, contexts, [continuations(d, renderer) for run in runs for d in run.docs])
    scores, _ = score_requests(model, requests, config.batch_size, max_length, config.padding_side, progress=progress)
    seconds = time.monotonic() - start
    rows = iter(scores.tolist())
    tasks_out, lines = {}, []
    for run in runs:
        outcomes = [doc_outcome(doc, next(rows)[: len(doc.choices)]) for doc in run.docs]
        tasks_out[run.task.name] = task_results(run, outcomes, config.shots, config.fewshot_seed, renderer)
        for index, (outcome, picked) in enumerate(zip(outcomes, run.shots)):
            lines.append(json.dumps({"task": run.task.name, "index": index, **outcome, "fewshot": picked}) + "\n")
    results: dict[str, Any] = {"benchmark": group.name, "tasks": tasks_out}
    group_out = group_results(tasks_out) if len(group.tasks) > 1 else None
    if group_out is not None:
        results["group"] = group_out
    results["headline"] = headline("acc", tasks_out, group_out)
    results.update(run_record(config, seconds, len(lines), data_dir=str(root), max_length=max_length))
    return write_outputs(config.out, group.stage, config.model_dump(mode="json"), results, lines)
