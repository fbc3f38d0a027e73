"""Running the real lm-evaluation-harness (what ``lm_eval --model hf`` runs) and llmflow's
``llmflow eval`` side by side on the same local data and model, for the tests that compare
them; both in the test's process, which has already imported torch and transformers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any
from unittest.mock import patch

from harness_exemplars import harness_tasks

from llmflow.cli import main


def harness_task(out: Path, name: str, include: str, files: dict[str, Path], dataset_path: str = "parquet") -> None:
    """A task of lm-eval's own configuration ``include`` (a path inside the installed package)
    reading ``files`` (split -> file) instead of the Hub: parquet, or ``dataset_path`` json or
    csv. JSON strings are YAML strings."""
    config = harness_tasks() / include
    data_files = "".join(f"    {split}: {json.dumps(str(path))}\n" for split, path in files.items())
    (out / f"{name}.yaml").write_text(f"task: {name}\ninclude: {json.dumps(str(config))}\ndataset_path: {dataset_path}\n"
                                      f"dataset_name: null\ndataset_kwargs:\n  data_files:\n{data_files}")


def run_harness(model: Path, tasks: str, include: Path, out: Path, shots: int | None = None, limit: int | None = None,
                max_gen_toks: int | None = None, chat: dict[str, Any] | None = None,
                model_extra: dict[str, Any] | None = None) -> None:
    """What ``lm_eval --model hf --model_args pretrained=MODEL,dtype=float32 --tasks TASKS
    --include_path INCLUDE --device cpu --batch_size 4 --log_samples --output_path OUT`` runs
    (``--num_fewshot``, ``--limit``, ``--gen_kwargs max_gen_toks=N`` where given), through the
    harness's Python API in this process: ``simple_evaluate`` with the command's settings and
    seeds, the results and samples saved by its ``EvaluationTracker`` as the command saves
    them. Its task manager indexes INCLUDE only: the command would also index the thousands
    of tasks the harness ships (10 s a run on two cores) and import the harness again.
    ``chat``: the chat settings (``apply_chat_template``, ``fewshot_as_multiturn``,
    ``system_instruction``); ``model_extra``: further ``--model_args`` (``think_end_token``,
    ``enable_thinking``)."""
    import datasets
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    model_args = {"pretrained": str(model), "dtype": "float32", **(model_extra or {})}
    tracker = EvaluationTracker(output_path=str(out))
    # Offline (tests/conftest.py sets HF_HUB_OFFLINE), with the datasets cache in ``out``.
    with patch.object(datasets.config, "HF_DATASETS_CACHE", out / "datasets-cache"):
        results = simple_evaluate(
            model="hf", model_args=model_args, tasks=tasks.split(","), num_fewshot=shots, batch_size=4, device="cpu",
            limit=limit, log_samples=True, evaluation_tracker=tracker, metadata=model_args,
            gen_kwargs=None if max_gen_toks is None else {"max_gen_toks": max_gen_toks}, **(chat or {}),
            task_manager=TaskManager(include_path=str(include), include_defaults=False, metadata=model_args))
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])


def harness_samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def harness_results(out: Path) -> dict:
    (path,) = [p for p in out.rglob("results_*.json")]
    return json.loads(path.read_text())["results"]


def ours(tmp_path: Path, group: str, model: Path, data: Path, *args: str) -> tuple[dict, list[dict]]:
    """``llmflow eval GROUP --model MODEL --data DATA --out OUT --batch-size 3 --device cpu ARGS``,
    run by the command line's ``main`` in this process; its results and predictions."""
    out = tmp_path / f"llmflow-{group}"
    stdout = io.StringIO()
    with patch.dict(os.environ, {"LLMFLOW_DEVICE": "cpu"}), contextlib.redirect_stdout(stdout):
        main(["eval", group, "--model", str(model), "--data", str(data), "--out", str(out), "--batch-size", "3",
              "--device", "cpu", *args])
    assert "wrote " in stdout.getvalue()
    return outputs(out)


def outputs(out: Path) -> tuple[dict, list[dict]]:
    """An evaluation's results.json and predictions.jsonl records."""
    results = json.loads((out / "results.json").read_text())
    return results, [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


def parrot_model(model: Path, out: Path, text: str, added_tokens: tuple[str, ...] = ()) -> Path:
    """The sample model rebuilt to answer every prompt with ``text`` and its eos: every layer
    adds nothing (its output projections are zero), so the last token's embedding alone picks
    the next token, and the embeddings chain ``text``'s tokens (whose ids must differ, and
    differ from the prompts' last token). ``added_tokens`` join its tokenizer first (ordinary
    tokens, as ``tokenizer.add_tokens`` adds them), so that a text whose pieces repeat, or
    hold the prompts' last token, can still be a chain: a whole answer as one token."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (model / name).is_file():
            shutil.copyfile(model / name, out / name)
    if added_tokens:
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        tokenizer.add_tokens(list(added_tokens))
        tokenizer.save_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    chain = tokenizer.encode(text, add_special_tokens=False)
    assert len(set(chain)) == len(chain) and tokenizer.eos_token_id not in chain
    config = json.loads((model / "config.json").read_text())
    config.update(tie_word_embeddings=False, vocab_size=max(config["vocab_size"], len(tokenizer)))
    parrot = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))
    rest = parrot.config.hidden_size - 1  # the direction of every token outside the chain
    with torch.no_grad():
        for p in parrot.parameters():
            p.zero_()
        parrot.model.norm.weight.fill_(1.0)
        embed, head = parrot.model.embed_tokens.weight, parrot.lm_head.weight
        embed[:, rest] = 10.0
        head[chain[0], rest] = 1.0
        for i, token in enumerate(chain):
            embed[token] = 0.0
            embed[token, i] = 10.0
            head[chain[i + 1] if i + 1 < len(chain) else tokenizer.eos_token_id, i] = 1.0
    parrot.save_pretrained(out)
    return out
