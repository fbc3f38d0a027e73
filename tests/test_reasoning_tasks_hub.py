"""MATH-500, MATH, MMLU-Pro, GPQA Diamond and IFEval read from their Hub datasets (a loopback
Hub serving the sample's files in the published layouts, beside files the tasks must not
fetch): only the files a task reads are downloaded, and the evaluation equals the one of the
local copy."""

from __future__ import annotations

import json

import pytest

from llmflow.evaluate.generative_engine import GenerativeEvalConfig, evaluate_generative
from llmflow.evaluate.gpqa import GPQA_DIAMOND
from llmflow.evaluate.ifeval import IFEVAL
from llmflow.evaluate.minerva_math import MINERVA_MATH, MINERVA_MATH500
from llmflow.evaluate.mmlu_pro import MMLU_PRO

CASES = {
    # group, Hub dataset, tasks evaluated, the files those read
    "minerva-math500": (MINERVA_MATH500, "HuggingFaceH4/MATH-500", None, {"test.jsonl"}),
    "minerva-math": (MINERVA_MATH, "EleutherAI/hendrycks_math", ["minerva_math_algebra"],
                     {"algebra/test-00000-of-00001.parquet"}),
    "mmlu-pro": (MMLU_PRO, "TIGER-Lab/MMLU-Pro", ["mmlu_pro_history"],
                 {"data/test-00000-of-00001.parquet", "data/validation-00000-of-00001.parquet"}),
    "gpqa-diamond": (GPQA_DIAMOND, "Idavidrein/gpqa", None, {"gpqa_diamond.csv"}),
    "ifeval": (IFEVAL, "google/IFEval", None, {"ifeval_input_data.jsonl"}),
}


@pytest.mark.parametrize("benchmark", list(CASES))
def test_hub_sources_fetch_only_the_files_read(benchmark, hub, sample_assets, tmp_path):
    group, repo, tasks, needed = CASES[benchmark]
    sample = sample_assets()
    local = sample / benchmark
    hub.repos[("dataset", repo)] = {**{p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*")
                                       if p.is_file()},
                                    "README.md": b"never fetched", "other/train-00000-of-00001.parquet": b"never fetched"}
    common = {"model": sample / "model", "limit": 1, "max_new_tokens": 2, "tasks": tasks, "device": "cpu",
              "cache_dir": tmp_path / "cache"}
    fetched = evaluate_generative(group, GenerativeEvalConfig(data=f"hf://{repo}", out=tmp_path / "hub", **common))
    prefix = f"/datasets/{repo}/resolve/{hub.commit}/"
    assert {p[len(prefix):] for p in hub.file_gets() if p.startswith(prefix)} == needed
    same = evaluate_generative(group, GenerativeEvalConfig(data=local, out=tmp_path / "local", **common))
    assert (fetched / "predictions.jsonl").read_text() == (same / "predictions.jsonl").read_text()
    assert json.loads((fetched / "results.json").read_text())["tasks"] == json.loads(
        (same / "results.json").read_text())["tasks"]
