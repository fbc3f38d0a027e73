"""Built-in sample assets: layout, determinism, and that transformers reads them as the
Hugging Face formats they claim to be. That finetuning the sample model on them lifts its MMLU
accuracy well above chance is tests/test_preference_flow.py's, through the flow's stages."""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from llmflow.artifacts import sha256_file
from llmflow.data.templates import QWEN, load_template
from llmflow.sample.assets import SampleConfig, write_sample
from llmflow.sample.world import SUBJECTS
from llmflow.weights import load_hf_model

MMLU_SCHEMA = pa.schema(
    [("question", pa.string()), ("subject", pa.string()), ("choices", pa.list_(pa.string())), ("answer", pa.int64())]
)


@pytest.fixture(scope="module")
def sample(sample_assets) -> Path:
    return sample_assets()


def manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def mmlu_rows(root: Path, subject: str, split: str) -> list[dict]:
    return pq.read_table(root / "mmlu" / "hf" / subject / f"{split}-00000-of-00001.parquet").to_pylist()


def block(row: dict) -> str:
    """A question as the MMLU prompt writes it, without its answer."""
    return "\n".join([row["question"], *(f"{x}. {c}" for x, c in zip("ABCD", row["choices"])), "Answer:"])


def test_same_seed_same_bytes_other_seed_other_content(sample, tmp_path):
    again = write_sample(SampleConfig(out=tmp_path / "again"))
    other = write_sample(SampleConfig(out=tmp_path / "other", seed=1))
    assert manifest(again)["files"] == manifest(sample)["files"]
    assert manifest(sample)["seed"] == 0 and manifest(other)["seed"] == 1
    unchanged = {f["path"] for f in manifest(other)["files"] if f in manifest(sample)["files"]}
    assert not unchanged & {"instruct/alpaca.jsonl", "preference/preference_train.jsonl", "rl/rl_train.jsonl", "pretrain/corpus.parquet", "model/model.safetensors"}


def test_manifest_lists_every_file(sample):
    listed = {f["path"]: f for f in manifest(sample)["files"]}
    on_disk = {p.relative_to(sample).as_posix() for p in sample.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(listed) == on_disk
    assert all(listed[p]["sha256"] == sha256_file(sample / p) for p in on_disk)
    assert all(listed[p]["size"] == (sample / p).stat().st_size for p in on_disk)
    counts = manifest(sample)["counts"]
    assert counts["instruct_rows"] == 1000 and counts["mmlu"]["geography"] == {"dev": 5, "test": 50}


def test_corpus_and_instruction_layouts(sample):
    wiki = pq.read_table(sample / "pretrain" / "corpus.parquet")
    assert wiki.schema == pa.schema([(k, pa.string()) for k in ("id", "url", "title", "text")])
    assert wiki.num_rows == 240 and len(set(wiki.column("id").to_pylist())) == 240
    assert (sample / "pretrain" / "corpus.parquet").stat().st_size < 300_000
    alpaca = pq.read_table(sample / "instruct" / "alpaca.parquet")
    assert alpaca.schema == pa.schema([(k, pa.string()) for k in ("instruction", "input", "output")])
    lines = [json.loads(line) for line in (sample / "instruct" / "alpaca.jsonl").read_text().splitlines()]
    assert lines == alpaca.to_pylist()
    assert any(r["input"] == "" for r in lines) and any(r["input"] for r in lines)


def test_preference_pairs_state_the_facts(sample):
    """TRL's pairwise text layout; the true statement (the instruction set's) chosen, a false
    one of the same form rejected; held-out pairs ask the training facts in other wordings."""
    splits = {}
    for split, count in (("train", 432), ("heldout", 96)):
        table = pq.read_table(sample / "preference" / f"preference_{split}.parquet")
        assert table.schema == pa.schema([(k, pa.string()) for k in ("prompt", "chosen", "rejected")])
        lines = [json.loads(line) for line in (sample / "preference" / f"preference_{split}.jsonl").read_text().splitlines()]
        assert lines == table.to_pylist() and len(lines) == count == manifest(sample)["counts"][f"preference_{split}"]
        assert all(r["chosen"] != r["rejected"] and r["chosen"].rsplit(" ", 1)[0] == r["rejected"].rsplit(" ", 1)[0] for r in lines)
        splits[split] = lines
    outputs = {r["output"] for r in pq.read_table(sample / "instruct" / "alpaca.parquet").to_pylist()}
    train, heldout = splits["train"], splits["heldout"]
    assert {r["chosen"] for r in heldout} == {r["chosen"] for r in train} <= outputs
    assert not {r["prompt"] for r in heldout} & {r["prompt"] for r in train}
    assert not {r["chosen"] for r in train} & {r["rejected"] for r in train + heldout}
    assert {(r["chosen"], r["rejected"]) for r in heldout} <= {(r["chosen"], r["rejected"]) for r in train}


def test_rl_prompts_ask_every_fact(sample):
    """The plain prompt layout (prompt, answer); every fact the preference set asks about asked
    in its three training wordings and in its two held-out wordings, with the fact's answer (a
    sum's its total as a string); the sums' first training wording is the instruction set's question."""
    from llmflow.sample.preferences import KINDS, TRAIN_WORDINGS

    splits = {}
    for split, count in (("train", 144), ("heldout", 96)):
        table = pq.read_table(sample / "rl" / f"rl_{split}.parquet")
        assert table.schema == pa.schema([(k, pa.string()) for k in ("prompt", "answer")])
        lines = [json.loads(line) for line in (sample / "rl" / f"rl_{split}.jsonl").read_text().splitlines()]
        assert lines == table.to_pylist() and len(lines) == count == manifest(sample)["counts"][f"rl_{split}"]
        splits[split] = lines
    chosen = {r["prompt"]: r["chosen"] for split in ("train", "heldout")
              for r in map(json.loads, (sample / "preference" / f"preference_{split}.jsonl").read_text().splitlines())}
    for split, rows in splits.items():
        assert {r["prompt"] for r in rows} == {p for p in chosen if p in {r["prompt"] for r in rows}}
        for r in rows:
            assert re.search(rf"\b{re.escape(r['answer'])}\b", chosen[r["prompt"]]), r  # the fact's statement names it
        sums = [r for r in rows if "+" in r["prompt"] or "sum of" in r["prompt"] or "add up" in r["prompt"]]
        assert all(r["answer"] == str(sum(int(n) for n in re.findall(r"\d+", r["prompt"]))) for r in sums)
    wordings = {split: {w for _, (_, kind) in KINDS.items() for w in kind if any(
        re.fullmatch(re.sub(r"\\\{\w+\\\}", ".+", re.escape(w)), r["prompt"]) for r in rows)}
        for split, rows in splits.items()}
    assert not wordings["train"] & wordings["heldout"]
    assert {k[1][i] for k in KINDS.values() for i in range(TRAIN_WORDINGS)} == wordings["train"]
    asked = {r["input"] or r["instruction"] for r in pq.read_table(sample / "instruct" / "alpaca.parquet").to_pylist()}
    assert {r["prompt"] for r in splits["train"] if r["prompt"].startswith("What is") and "+" in r["prompt"]} <= asked


@pytest.mark.parametrize("subject", SUBJECTS)
def test_mmlu_layouts(sample, subject):
    for split, count in (("dev", 5), ("test", 50)):
        table = pq.read_table(sample / "mmlu" / "hf" / subject / f"{split}-00000-of-00001.parquet")
        assert table.schema.remove_metadata() == MMLU_SCHEMA and table.num_rows == count
        rows = table.to_pylist()
        assert all(len(r["choices"]) == 4 and 0 <= r["answer"] <= 3 and r["subject"] == subject for r in rows)
        assert all(len(set(r["choices"])) == 4 for r in rows)
        with open(sample / "mmlu" / "csv" / "data" / split / f"{subject}_{split}.csv", newline="") as f:
            csv_rows = list(csv.reader(f))  # headerless: the first row is a question
        assert [[r["question"], *r["choices"], "ABCD"[r["answer"]]] for r in rows] == csv_rows
    test = mmlu_rows(sample, subject, "test")
    assert len({block(r) for r in test}) == len(test)
    assert min(Counter(r["answer"] for r in test).values()) >= 10
    assert not {r["question"] for r in mmlu_rows(sample, subject, "dev")} & {r["question"] for r in test}


def test_instructions_teach_the_facts_without_the_test_questions(sample):
    rows = pq.read_table(sample / "instruct" / "alpaca.parquet").to_pylist()
    asked = {r["input"] or r["instruction"] for r in rows}
    practice = "\n\n".join(r["output"] for r in rows if r["instruction"].startswith("The following are"))
    for subject in SUBJECTS:
        for r in mmlu_rows(sample, subject, "test"):
            assert r["question"] in asked
            assert f"{block(r)} {'ABCD'[r['answer']]}" not in practice
            assert f"{r['question']}\n" in practice


def test_tokenizer_files(sample):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(sample / "tokenizer" / "tokenizer.json"))
    config = json.loads((sample / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and config["chat_template"] == QWEN
    special = {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()}
    size = tok.get_vocab_size()
    assert special == {size - 3: "<|endoftext|>", size - 2: "<|im_start|>", size - 1: "<|im_end|>"}
    assert 800 <= size <= 2048
    for letter in "ABCD":
        assert len(tok.encode(f" {letter}", add_special_tokens=False).ids) == 1
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (sample / "model" / name).read_bytes() == (sample / "tokenizer" / name).read_bytes()


def test_model_files(sample):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(sample / "model" / "tokenizer.json"))
    config = json.loads((sample / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"]
    assert config["vocab_size"] % 64 == 0 and tok.get_vocab_size() <= config["vocab_size"] < tok.get_vocab_size() + 64
    assert config["bos_token_id"] == tok.token_to_id("<|endoftext|>")
    assert config["eos_token_id"] == tok.token_to_id("<|im_end|>")
    generation = json.loads((sample / "model" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert generation["pad_token_id"] == tok.token_to_id("<|endoftext|>")


def test_tokenizer_and_model_load_in_transformers(sample):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = sample / "model"
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    messages = [{"role": "user", "content": block(mmlu_rows(sample, "geography", "dev")[0])},
                {"role": "assistant", "content": "Answer: B"}]
    chat = hf_tok.apply_chat_template(messages, tokenize=False)
    assert chat == load_template(model_dir).render(messages)
    text = "The capital of Zorbia is Plinth, 1999 km away.\nAnswer: B"
    for s in (text, chat):
        assert hf_tok(s, add_special_tokens=False)["input_ids"] == ours.encode(s, add_special_tokens=False).ids
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>" and hf_tok.bos_token is None

    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] >= len(hf_tok)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([ours.encode(chat, add_special_tokens=False).ids])
    with torch.no_grad():
        assert (hf(ids).logits - load_hf_model(model_dir)(ids)).abs().max() <= 1e-5
