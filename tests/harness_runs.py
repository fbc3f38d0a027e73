"""Running the real lm-evaluation-harness (``lm_eval --model hf``) and llmflow's ``llmflow eval``
side by side on the same local data and model, for the tests that compare them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path


def harness_task(out: Path, name: str, include: str, files: dict[str, Path]) -> None:
    """A task of lm-eval's own configuration ``include`` (a path inside the installed package)
    reading ``files`` (split -> parquet) instead of the Hub. JSON strings are YAML strings."""
    spec = importlib.util.find_spec("lm_eval")
    config = Path(spec.origin).parent / "tasks" / include
    data_files = "".join(f"    {split}: {json.dumps(str(path))}\n" for split, path in files.items())
    (out / f"{name}.yaml").write_text(f"task: {name}\ninclude: {json.dumps(str(config))}\ndataset_path: parquet\n"
                                      f"dataset_name: null\ndataset_kwargs:\n  data_files:\n{data_files}")


def run_harness(model: Path, tasks: str, include: Path, out: Path, shots: int | None) -> None:
    command = [str(Path(sys.executable).parent / "lm_eval"), "--model", "hf", "--model_args",
               f"pretrained={model},dtype=float32", "--tasks", tasks, "--include_path", str(include), "--device", "cpu",
               "--batch_size", "4", "--log_samples", "--output_path", str(out)]
    command += ["--num_fewshot", str(shots)] if shots is not None else []
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(out / "datasets-cache")}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def harness_samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def harness_results(out: Path) -> dict:
    (path,) = [p for p in out.rglob("results_*.json")]
    return json.loads(path.read_text())["results"]


def ours(tmp_path: Path, group: str, model: Path, data: Path, *args: str) -> tuple[dict, list[dict]]:
    out = tmp_path / f"llmflow-{group}"
    env = {**os.environ, "LLMFLOW_DEVICE": "cpu"}
    command = [sys.executable, "-m", "llmflow.cli", "eval", group, "--model", str(model), "--data", str(data),
               "--out", str(out), "--batch-size", "3", "--device", "cpu", *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote " in proc.stdout
    results = json.loads((out / "results.json").read_text())
    return results, [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
