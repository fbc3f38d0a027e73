"""Built-in sample assets: layout, determinism, and that transformers reads them as the
Hugging Face formats they claim to be."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from llmflow.artifacts import sha256_file
from llmflow.data.templates import load_template
from llmflow.models import load_hf_model
from llmflow.sample import SampleConfig, write_sample


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return write_sample(SampleConfig(out=tmp_path_factory.mktemp("s") / "sample"))


def test_same_seed_same_bytes_other_seed_other_content(sample, tmp_path):
    again = write_sample(SampleConfig(out=tmp_path / "again"))
    other = write_sample(SampleConfig(out=tmp_path / "other", seed=1))
    files = sorted(p.relative_to(sample) for p in sample.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert files and all(sha256_file(sample / f) == sha256_file(again / f) for f in files)
    assert sha256_file(sample / "instruct" / "alpaca.jsonl") != sha256_file(other / "instruct" / "alpaca.jsonl")


def test_manifest_lists_every_file(sample):
    manifest = json.loads((sample / "manifest.json").read_text())
    listed = {f["path"]: f for f in manifest["files"]}
    on_disk = {p.relative_to(sample).as_posix() for p in sample.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(listed) == on_disk
    assert all(listed[p]["sha256"] == sha256_file(sample / p) for p in on_disk)


def test_data_layouts(sample):
    wiki = pq.read_table(sample / "pretrain" / "corpus.parquet")
    assert wiki.column_names == ["id", "url", "title", "text"] and wiki.num_rows > 0
    alpaca = pq.read_table(sample / "instruct" / "alpaca.parquet")
    assert alpaca.column_names == ["instruction", "input", "output"]
    lines = [json.loads(line) for line in (sample / "instruct" / "alpaca.jsonl").read_text().splitlines()]
    assert lines == alpaca.to_pylist()
    for subject_dir in sorted((sample / "mmlu" / "hf").iterdir()):
        for split in ("dev", "test"):
            table = pq.read_table(subject_dir / f"{split}-00000-of-00001.parquet")
            assert table.schema.field("choices").type == pa.list_(pa.string())
            rows = table.to_pylist()
            assert all(len(r["choices"]) == 4 and 0 <= r["answer"] <= 3 and r["subject"] == subject_dir.name for r in rows)
            with open(sample / "mmlu" / "csv" / "data" / split / f"{subject_dir.name}_{split}.csv", newline="") as f:
                csv_rows = list(csv.reader(f))
            assert [[r["question"], *r["choices"], "ABCD"[r["answer"]]] for r in rows] == csv_rows
        assert pq.read_table(subject_dir / "dev-00000-of-00001.parquet").num_rows == 5


def test_tokenizer_and_model_load_in_transformers(sample):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = sample / "model"
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "The capital of Zorbia is Plinth.\nAnswer: B"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_special_tokens=False).ids
    for letter in "ABCD":
        assert len(ours.encode(f" {letter}", add_special_tokens=False).ids) == 1
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    assert hf_tok.apply_chat_template(messages, tokenize=False) == load_template(model_dir).render(messages)

    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] >= len(hf_tok)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([ours.encode(text, add_special_tokens=False).ids])
    with torch.no_grad():
        assert (hf(ids).logits - load_hf_model(model_dir)(ids)).abs().max() <= 1e-5
