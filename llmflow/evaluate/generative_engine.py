"""The engine behind ``llmflow eval gsm8k|bbh|humaneval``: prompts continued by greedy
generation, the texts scored as lm-evaluation-harness's ``hf`` backend, task filters and
metrics do it.

Each prompt is encoded with the tokenizer's default special tokens and cut from the left to
leave room for the generated tokens (the model's length minus ``max_new_tokens``); rows are
generated in batches, longest first, and stop at the model's eos tokens or once the text holds
a stop string (the task's ``until`` and the tokenizer's eos text). The text is the generated
tokens decoded by the model's transformers tokenizer without special tokens, cut before the
first stop string. Greedy decoding applies the repetition_penalty of the model's
generation_config.json, as transformers does for the harness. A task that samples (humaneval_64)
generates its ``repeats`` (or the config's ``samples``) texts per document at its temperature
and top_p; each batch draws from its own generator seeded with ``seed`` plus the batch's
number, so a run with the same seed and batch size repeats its samples exactly.

Each filter's extracted answer is scored by exact match, or a task's scorer scores the texts
(HumanEval: its programs run in the sandbox, ``workers`` at a time); each metric is reported as
a mean with the harness's standard error; a group reports each task and its micro
(size-weighted, the harness's group score) and macro averages. Writes ``results.json``,
``predictions.jsonl`` (per document: task, index, generated text and its score: extracted
answers, gold, correct per filter, or the scorer's record) and ``manifest.json`` last. Every
document is read and every prompt built before the model is loaded.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from llmflow.data.tokenizer import hf_tokenizer
from llmflow.evaluate.chat_context import PLAIN_PROMPTS, PromptRenderer
from llmflow.evaluate.generative_tasks import Doc, GenerativeGroup, GenerativeTask, Scored
from llmflow.evaluate.hub_data import local_data
from llmflow.evaluate.provenance import prompts_sha256
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.reporting import group_results, headline, run_record, write_outputs
from llmflow.evaluate.scoring import encode_texts
from llmflow.evaluate.settings import EvalSettings, context_length, eval_model
from llmflow.evaluate.statistics import stderr_of_mean
from llmflow.evaluate.task_selection import check_task_directories, select_tasks
from llmflow.infer.generate import FinishReason, GenerateConfig
from llmflow.infer.generator import Generator, make_generator
from llmflow.progress import Progress, no_progress
from llmflow.runtime import available_device


class GenerativeEvalConfig(EvalSettings):
    """Evaluate a model on generative chain-of-thought tasks."""

    shots: int | None = Field(default=None, ge=0)
    """Worked exemplars before each question (the task's fixed ones, in order); default: the
    harness's num_fewshot (8 for gsm8k_cot, 3 for BBH), which is all of them."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Most tokens generated per question; default: the harness's (256 for gsm8k_cot, its hf
    backend's default; 1024 for BBH, its max_gen_toks)."""
    tasks: list[str] | None = None
    """Tasks of the group to evaluate, by the harness's names (bbh_cot_fewshot_navigate, ...;
    default: all)."""
    padding_side: Literal["left"] = "left"
    """Generation pads batches on the left, as the harness does (the text does not depend on it)."""
    workers: int | None = Field(default=None, ge=1)
    """Generated programs run at once in the sandbox, by tasks that execute them (humaneval);
    default: the CPU count."""
    samples: int | None = Field(default=None, ge=1)
    """Texts sampled per document by tasks that sample (humaneval_64: 64 by default); pass@k
    is reported for the task's k up to this number."""
    seed: int = 1234
    """Seed of sampling tasks' draws (the harness seeds torch with 1234)."""


@dataclass
class TaskRun:
    """One task's documents and their prompts."""

    task: GenerativeTask
    docs: list[Doc]
    contexts: list[str]


@dataclass(frozen=True)
class Generation:
    """One prompt's continuation as the harness sees it."""

    text: str
    """Decoded without special tokens, cut before the first stop string."""
    finish_reason: FinishReason
    prompt_tokens: int
    """Tokens of the prompt the model saw (after any cut from the left)."""
    truncated: bool
    """Whether the prompt lost tokens from the left to leave room for the generation."""


def task_settings(tasks: list[GenerativeTask], config: GenerativeEvalConfig) -> tuple[int, int]:
    """The shots and new tokens of every task: the config's, else the harness's defaults (which
    a group's tasks share); an error for samples too few for a sampling task's metrics."""
    first = tasks[0]
    default = first.fewshot.shots if first.fewshot is not None else len(first.exemplars)
    shots = config.shots if config.shots is not None else default
    for task in tasks:
        if task.fewshot is None and shots > len(task.exemplars):
            raise ValueError(f"shots={shots}: {task.name} has {len(task.exemplars)} exemplars (lm-evaluation-harness's "
                             "fixed chain-of-thought examples); use at most that many")
        if task.temperature > 0 and config.samples is not None and config.samples < task.min_repeats:
            raise ValueError(f"samples={config.samples}: {task.name}'s metrics take at least {task.min_repeats} "
                             "samples per document; draw at least that many")
    return shots, config.max_new_tokens or tasks[0].max_gen_toks


def build_runs(group: GenerativeGroup, tasks: list[GenerativeTask], root: Path, shots: int, limit: int | None,
               renderer: PromptRenderer = PLAIN_PROMPTS) -> list[TaskRun]:
    """Every task's documents (its first ``limit``) with their prompts, rendered by ``renderer``."""
    if any(task.subdir for task in group.tasks):
        check_task_directories(group.title, root, tasks, lambda task: root / task.subdir, "subtask")
    runs = []
    for task in tasks:
        docs = task.read(root / task.subdir)[:limit]
        if not docs:
            raise BenchmarkDataError(f"{task.name} data {root / task.subdir}: no documents")
        exemplars = task.fewshot(root / task.subdir, docs, shots) if task.fewshot is not None else [None] * len(docs)
        runs.append(TaskRun(task, docs, [task.prompt(doc, shots, renderer, e) for doc, e in zip(docs, exemplars)]))
    return runs


def harness_cut(text: str, stops: Sequence[str]) -> str:
    """``text`` before the first of ``stops`` (the harness's postprocess_generated_text)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


def stop_strings(task: GenerativeTask, eos_text: str | None) -> list[str]:
    """The task's stop strings and the tokenizer's eos text (handle_stop_sequences)."""
    return [*task.until, *([eos_text] if eos_text is not None and eos_text not in task.until else [])]


def repetition_penalty(tok_dir: Path) -> float:
    """The repetition_penalty of the model's generation_config.json (transformers applies it
    to the harness's greedy decoding too); 1.0 when it sets none."""
    path = tok_dir / "generation_config.json"
    return float(json.loads(path.read_text()).get("repetition_penalty") or 1.0) if path.is_file() else 1.0


def answer_text(hf: Any, tokens: Sequence[int], think_end_token: str | None) -> str:
    """The generated tokens as the harness's text: decoded without special tokens, less the
    reasoning up to the last ``think_end_token`` (text, or digits for a token id)."""
    if think_end_token is not None and think_end_token.isdigit():
        end = int(think_end_token)
        last = max((i for i, t in enumerate(tokens) if t == end), default=None)
        text = hf.decode(tokens if last is None else tokens[last + 1 :], skip_special_tokens=True)
        return text.lstrip()
    text = hf.decode(tokens, skip_special_tokens=True)
    return text.split(think_end_token)[-1].lstrip() if think_end_token else text


def generate(generator: Generator, prompts: list[str], config: GenerateConfig, max_length: int,
             batch_size: int, on_batch: Callable[[int, int], None] | None = None,
             think_end_token: str | None = None) -> list[Generation]:
    """Continuations of ``prompts`` as the harness's hf backend makes them (see the module); a
    sampling ``config``'s seed is the first batch's, each later batch's one more. ``on_batch``
    is called with the number of continuations of each batch and the tokens they hold once it
    is generated. A ``think_end_token`` removes the reasoning before the stop strings cut the
    text."""
    hf = hf_tokenizer(generator.tokenizer_dir)
    ids = encode_texts(generator.tokenizer, prompts, hf.bos_token)
    keep = max_length - config.max_new_tokens
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out: list[Generation | None] = [None] * len(ids)
    for number, start in enumerate(range(0, len(order), batch_size)):
        rows = order[start : start + batch_size]
        batch_config = config.model_copy(update={"seed": config.seed + number})
        results = generator.run([ids[i][-keep:] for i in rows], batch_config)
        for i, result in zip(rows, results):
            text = harness_cut(answer_text(hf, result.tokens, think_end_token), config.stop)
            out[i] = Generation(text, result.finish_reason, len(result.prompt_tokens), len(ids[i]) > keep)
        if on_batch is not None:
            on_batch(len(rows), sum(len(r.tokens) for r in results))
    return out


def generations_per_doc(task: GenerativeTask, samples: int | None) -> int:
    """One greedy text, or ``samples`` (else the task's repeats) when the task samples."""
    return (samples or task.repeats) if task.temperature > 0 else 1


def generate_samples(generator: Generator, task: GenerativeTask, prompts: list[str], config: GenerateConfig,
                     samples: int | None, max_length: int, batch_size: int,
                     on_batch: Callable[[int, int], None] | None = None,
                     think_end_token: str | None = None) -> list[list[Generation]]:
    """Each prompt's generations (``generations_per_doc``), sampled at the task's temperature
    and top_p when it samples."""
    repeats = generations_per_doc(task, samples)
    if task.temperature > 0:
        config = config.model_copy(update={"temperature": task.temperature, "top_p": task.top_p})
    flat = generate(generator, [p for p in prompts for _ in range(repeats)], config, max_length, batch_size, on_batch,
                    think_end_token)
    return [flat[i : i + repeats] for i in range(0, len(flat), repeats)]


def doc_outcome(generations: list[Generation], scored: Scored) -> dict[str, Any]:
    """The generated text(s) and the score, as predictions.jsonl records them."""
    if len(generations) == 1:
        (g,) = generations
        return {"generated": g.text, "finish_reason": g.finish_reason, "prompt_tokens": g.prompt_tokens,
                "truncated": g.truncated, **scored.record}
    return {"generated": [g.text for g in generations], "finish_reason": [g.finish_reason for g in generations],
            "prompt_tokens": generations[0].prompt_tokens, "truncated": generations[0].truncated, **scored.record}


def task_results(run: TaskRun, generations: list[list[Generation]], scores: list[Scored], shots: int,
                 config: GenerateConfig) -> dict[str, Any]:
    """A task's metrics (means over its documents) with their standard errors, its size and
    what fixes its prompts and generations."""
    results: dict[str, Any] = {"version": run.task.version, "samples": len(scores)}
    aggregate = getattr(run.task.scorer, "aggregate", None)
    if aggregate is not None:  # IFEval's instruction-level accuracies pool every prompt's instructions
        results.update(aggregate(scores))
    else:
        for metric in scores[0].values:
            values = [s.values[metric] for s in scores]
            results[metric] = sum(values) / len(values)
            results[f"{metric}_stderr"] = stderr_of_mean(values)
    results["prompts_sha256"] = prompts_sha256(run.contexts, [config.stop] * len(run.contexts))
    results["first_prompt"] = run.contexts[0]
    sampler = run.task.fewshot.sampler if run.task.fewshot else "first_n (the task's fixed exemplars, in order)"
    results["fewshot"] = {"shots": shots, "sampler": sampler}
    results["generation"] = {"until": config.stop, "max_new_tokens": config.max_new_tokens,
                             "truncated_prompts": sum(g[0].truncated for g in generations)}
    if run.task.temperature > 0:
        results["generation"].update(samples_per_doc=len(generations[0]), temperature=run.task.temperature,
                                     top_p=run.task.top_p, seed=config.seed)
    return results


def evaluate_generative(group: GenerativeGroup, config: GenerativeEvalConfig, progress: Progress = no_progress) -> Path:
    """Evaluate ``config.model`` on ``group``'s tasks; writes the results into ``config.out`` and returns it.
    ``progress`` hears how many texts are generated (a task's scoring, such as HumanEval's
    programs, runs after its texts)."""
    if config.device != "auto":
        available_device(config.device)  # a device that is not there is refused before any download
    tasks = select_tasks(group.title, group.tasks, config.tasks or list(group.default_tasks))
    shots, max_new_tokens = task_settings(tasks, config)
    root = local_data(config.data, config.cache_dir, [p for t in tasks for p in t.hub_include])
    renderer = PromptRenderer.for_model(config, config.model)
    runs = build_runs(group, tasks, root, shots, config.limit, renderer)
    model, hf_config = eval_model(config)
    generator = make_generator(config.model, model, hf_config)
    max_length = context_length(hf_config)
    if max_new_tokens >= max_length:
        raise ValueError(f"max_new_tokens={max_new_tokens}: the model takes {max_length} tokens in all, prompt "
                         "included; generate fewer")
    hf = hf_tokenizer(generator.tokenizer_dir)
    eos_text = hf.decode([hf.eos_token_id]) if hf.eos_token_id is not None else None
    penalty = repetition_penalty(generator.tokenizer_dir)
    workers = config.workers or os.cpu_count() or 1
    total = sum(len(run.docs) * generations_per_doc(run.task, config.samples) for run in runs)
    done = tokens = 0

    def generated(count: int, new_tokens: int) -> None:
        nonlocal done, tokens
        done, tokens = done + count, tokens + new_tokens
        progress(done, total, f"{tokens / max(time.monotonic() - start, 1e-9):.1f} tokens/s")

    progress(0, total)
    start = time.monotonic()
    tasks_out, lines = {}, []
    for run in runs:
        generate_config = GenerateConfig(max_new_tokens=max_new_tokens, stop=stop_strings(run.task, eos_text),
                                         repetition_penalty=penalty, seed=config.seed)
        generations = generate_samples(generator, run.task, run.contexts, generate_config, config.samples, max_length,
                                       config.batch_size, generated, config.think_end_token)
        scores = run.task.score(run.docs, [[g.text for g in doc] for doc in generations], workers)
        tasks_out[run.task.name] = task_results(run, generations, scores, shots, generate_config)
        lines += [json.dumps({"task": run.task.name, "index": i, **doc_outcome(g, s)}, ensure_ascii=False) + "\n"
                  for i, (g, s) in enumerate(zip(generations, scores))]
    seconds = time.monotonic() - start
    results: dict[str, Any] = {"benchmark": group.name, "harness_task": group.harness_name, "tasks": tasks_out}
    group_out = group_results(tasks_out) if group.aggregate and len(group.tasks) > 1 else None
    if group_out is not None:
        results["group"] = group_out
    results["headline"] = headline(group.headline_metric(tasks[0]), tasks_out, group_out)
    results.update(run_record(config, seconds, len(lines), data_dir=str(root), max_length=max_length, shots=shots,
                              max_new_tokens=max_new_tokens, repetition_penalty=penalty, workers=workers))
    return write_outputs(config.out, group.stage, config.model_dump(mode="json"), results, lines)
