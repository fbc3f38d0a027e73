"""Running the real lm-evaluation-harness (what ``lm_eval --model hf`` runs) and llmflow's
``llmflow eval`` side by side on the same local data and model, for the tests that compare
them; both in the test's process, which has already imported torch and transformers."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from unittest.mock import patch

from harness_exemplars import harness_tasks

from llmflow.cli import main


def harness_task(out: Path, name: str, include: str, files: dict[str, Path]) -> None:
    """A task of lm-eval's own configuration ``include`` (a path inside the installed package)
    reading ``files`` (split -> parquet) instead of the Hub. JSON strings are YAML strings."""
    config = harness_tasks() / include
    data_files = "".join(f"    {split}: {json.dumps(str(path))}\n" for split, path in files.items())
    (out / f"{name}.yaml").write_text(f"task: {name}\ninclude: {json.dumps(str(config))}\ndataset_path: parquet\n"
                                      f"dataset_name: null\ndataset_kwargs:\n  data_files:\n{data_files}")


def run_harness(model: Path, tasks: str, include: Path, out: Path, shots: int | None = None, limit: int | None = None,
                max_gen_toks: int | None = None) -> None:
    """What ``lm_eval --model hf --model_args pretrained=MODEL,dtype=float32 --tasks TASKS
    --include_path INCLUDE --device cpu --batch_size 4 --log_samples --output_path OUT`` runs
    (``--num_fewshot``, ``--limit``, ``--gen_kwargs max_gen_toks=N`` where given), through the
    harness's Python API in this process: ``simple_evaluate`` with the command's settings and
    seeds, the results and samples saved by its ``EvaluationTracker`` as the command saves
    them. Its task manager indexes INCLUDE only: the command would also index the thousands
    of tasks the harness ships (10 s a run on two cores) and import the harness again."""
    import datasets
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    model_args = {"pretrained": str(model), "dtype": "float32"}
    tracker = EvaluationTracker(output_path=str(out))
    # Offline (tests/conftest.py sets HF_HUB_OFFLINE), with the datasets cache in ``out``.
    with patch.object(datasets.config, "HF_DATASETS_CACHE", out / "datasets-cache"):
        results = simple_evaluate(
            model="hf", model_args=model_args, tasks=tasks.split(","), num_fewshot=shots, batch_size=4, device="cpu",
            limit=limit, log_samples=True, evaluation_tracker=tracker, metadata=model_args,
            gen_kwargs=None if max_gen_toks is None else {"max_gen_toks": max_gen_toks},
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
    results = json.loads((out / "results.json").read_text())
    return results, [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
