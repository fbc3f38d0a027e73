"""Preference tokenization: every layout checked against transformers' ``apply_chat_template``,
the pair layout the trainer reads (chosen and rejected as documents 2j and 2j+1), packing,
overlong pairs, and bad rows refused before any output is touched."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.artifacts import read_manifest
from llmflow.cli import main
from llmflow.data import tokenize_preference as preference
from llmflow.data.indexed import IndexedDatasetError
from llmflow.data.instruction_dataset import InstructionDataset
from llmflow.data.preference_dataset import PreferenceDataset
from llmflow.data.readers import InputError
from llmflow.data.tokenize_instruction import IGNORE_INDEX, dataset_files, output_paths
from llmflow.data.tokenize_preference import PreferenceTokenizeConfig, tokenize_preference
from llmflow.data.tokenizer import TokenizeError

WORDS = ["what", "is", "the", "capital", "of", "country", "city", "red", "blue", "green", "flag", "animal", "fox", "owl", "answer", "tell", "me"]
FORMATS = ["text", "conversational", "implicit", "alpaca", "sharegpt"]


@pytest.fixture(scope="module")
def tokenizer_dir(sample_assets) -> Path:
    return sample_assets() / "tokenizer"


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def sentence(rng: random.Random, lo: int = 2, hi: int = 10) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize()


def make_pairs(n: int, seed: int = 0, multi_turn: bool = True) -> list[tuple[list[dict], str, str]]:
    """(prompt messages, chosen, rejected): a system message now and then, and history turns
    when ``multi_turn``."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = [{"role": "system", "content": sentence(rng)}] if multi_turn and rng.random() < 0.3 else []
        for _ in range(rng.randint(0, 2) if multi_turn else 0):
            prompt += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
        prompt.append({"role": "user", "content": sentence(rng)})
        chosen = sentence(rng, 1, 8)
        rejected = sentence(rng, 1, 8)
        while rejected == chosen:
            rejected = sentence(rng, 1, 8)
        pairs.append((prompt, chosen, rejected))
    return pairs


def as_records(fmt: str, pairs) -> list[dict]:
    records = []
    for prompt, chosen, rejected in pairs:
        replies = [[{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]]
        if fmt == "text":
            assert len(prompt) == 1
            records.append({"prompt": prompt[0]["content"], "chosen": chosen, "rejected": rejected})
        elif fmt == "conversational":
            records.append({"prompt": prompt, "chosen": replies[0], "rejected": replies[1]})
        elif fmt == "implicit":
            records.append({"chosen": prompt + replies[0], "rejected": prompt + replies[1]})
        elif fmt == "alpaca":
            system = prompt[0]["content"] if prompt[0]["role"] == "system" else ""
            turns = prompt[1:] if system else prompt
            history = [[turns[i]["content"], turns[i + 1]["content"]] for i in range(0, len(turns) - 1, 2)]
            records.append({"instruction": turns[-1]["content"], "input": "", "chosen": chosen, "rejected": rejected,
                            "system": system, "history": history})
        else:
            names = {"user": "human", "assistant": "gpt", "system": "system"}
            records.append({"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in prompt],
                            "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected}})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def run(tokenizer_dir, inputs, out, **kw) -> dict:
    kw.setdefault("format", "pairwise")
    kw.setdefault("seq_length", 512)
    return tokenize_preference(PreferenceTokenizeConfig(input=inputs, tokenizer=tokenizer_dir, out=out, **kw))


def chat_ids(hf_tok, messages, add_generation_prompt: bool = False) -> list[int]:
    """transformers' reference: the rendered conversation's ids."""
    return list(hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt)["input_ids"])


def expected(hf_tok, pair) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """(ids, labels) of the chosen and rejected sequences: prompt + response as
    ``apply_chat_template`` encodes them, -100 on exactly the prompt's tokens."""
    prompt, chosen, rejected = pair
    n = len(chat_ids(hf_tok, prompt, add_generation_prompt=True))
    sides = []
    for response in (chosen, rejected):
        ids = chat_ids(hf_tok, [*prompt, {"role": "assistant", "content": response}])
        assert len(ids) > n + 1
        sides.append((ids, [IGNORE_INDEX] * n + ids[n:]))
    return sides[0], sides[1]


def rows_of(data: PreferenceDataset, pad_id: int):
    """Every pair of every row, (chosen, rejected) (ids, labels), checking the row layout on
    the way: documents 2j and 2j+1 back to back, each with a target, then padding."""
    out = []
    for i in range(len(data)):
        row = data[i]
        docs, n_pairs = row["document_ids"], data.pairs(i)
        assert all(v.shape == (data.seq_length,) for v in row.values())
        end = 0
        for d in range(2 * n_pairs):
            span = np.flatnonzero(docs == d)
            assert span[0] == end and np.all(np.diff(span) == 1)
            assert (row["targets"][span] != IGNORE_INDEX).any()
            end = span[-1] + 1
        pad = docs == 2 * n_pairs
        assert pad[end:].all() and not pad[:end].any()
        assert (row["input_ids"][pad] == pad_id).all() and (row["targets"][pad] == IGNORE_INDEX).all()
        for j in range(n_pairs):
            out.append(tuple((row["input_ids"][docs == d].tolist(), row["labels"][docs == d].tolist()) for d in (2 * j, 2 * j + 1)))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_layout_matches_apply_chat_template(tmp_path, tokenizer_dir, hf_tok, fmt):
    pairs = make_pairs(24, seed=1, multi_turn=fmt != "text")
    src = write_jsonl(tmp_path / "p.jsonl", as_records(fmt, pairs))
    layout = {"text": "pairwise", "conversational": "pairwise", "implicit": "pairwise"}.get(fmt, fmt)
    manifest = run(tokenizer_dir, [src], tmp_path / "pref", format=layout, seq_length=320)
    assert manifest["stage"] == preference.STAGE == "tokenize-preference"
    assert manifest["pairs"] == manifest["written"] == manifest["rows"] == len(pairs)
    assert manifest["seq_length"] == 320 and manifest["template"] == "tokenizer" and manifest["pad_id"] == hf_tok.pad_token_id
    data = PreferenceDataset(tmp_path / "pref")
    want = [expected(hf_tok, p) for p in pairs]
    assert rows_of(data, hf_tok.pad_token_id) == want
    assert manifest["tokens"] == sum(len(s[0]) for pair in want for s in pair)
    assert manifest["trained_tokens"] == sum(sum(t != IGNORE_INDEX for t in s[1]) for pair in want for s in pair)
    if fmt != "text":
        assert any(sum(m["role"] == "assistant" for m in p[0]) for p in pairs)  # history in the prompt, masked


def test_packed_pairs_stay_whole_and_in_order(tmp_path, tokenizer_dir, hf_tok):
    pairs = make_pairs(60, seed=2)
    src = write_jsonl(tmp_path / "p.jsonl", as_records("conversational", pairs))
    manifest = run(tokenizer_dir, [src], tmp_path / "packed", pack=True, seq_length=512)
    data = PreferenceDataset(tmp_path / "packed")
    got = rows_of(data, hf_tok.pad_token_id)
    assert sorted(got) == sorted(expected(hf_tok, p) for p in pairs)
    assert len(data) == manifest["rows"] < len(pairs) and manifest["written"] == len(pairs)
    assert max(data.pairs(i) for i in range(len(data))) > 1
    lengths = [data.input_ids.sequence_lengths[list(data.input_ids.document_sequences(i))].sum() for i in range(len(data))]
    assert max(lengths) <= 512 and manifest["packing_efficiency"] == pytest.approx(sum(lengths) / (512 * len(lengths)))
    row = data[next(i for i in range(len(data)) if data.pairs(i) > 1)]
    assert set(np.unique(row["document_ids"])) >= {0, 1, 2, 3}


def test_same_output_for_any_worker_count(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "p.jsonl", as_records("sharegpt", make_pairs(80, seed=3)))
    outs = [tmp_path / f"w{w}" for w in (1, 2)]
    for w, out in zip((1, 2), outs):
        run(tokenizer_dir, [src], out, format="sharegpt", workers=w, batch_size=8, pack=True)
    for a, b in zip(*(dataset_files(o) for o in outs)):
        assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_overlong_pairs_are_counted(tmp_path, tokenizer_dir, hf_tok, overlong):
    pairs = make_pairs(40, seed=4)
    want = [expected(hf_tok, p) for p in pairs]
    lengths = [len(c[0]) + len(r[0]) for c, r in want]
    prompts = [len(chat_ids(hf_tok, p[0], add_generation_prompt=True)) for p in pairs]
    n = int(np.median(lengths))
    longer = [length > n for length in lengths]
    no_room = [2 * prompt + 2 > n for prompt in prompts]  # not even one response token each
    assert any(longer) and any(no_room) and any(lg and not nr for lg, nr in zip(longer, no_room))
    src = write_jsonl(tmp_path / "p.jsonl", as_records("conversational", pairs))
    manifest = run(tokenizer_dir, [src], tmp_path / overlong, seq_length=n, overlong=overlong)
    got = rows_of(PreferenceDataset(tmp_path / overlong), hf_tok.pad_token_id)
    assert manifest["pairs"] == len(pairs) and manifest["truncated"] + manifest["dropped_overlong"] == sum(longer)
    assert manifest["written"] == len(got) == len(pairs) - manifest["dropped_overlong"]
    if overlong == "drop":
        assert manifest["truncated"] == 0
        assert got == [w for w, lg in zip(want, longer) if not lg]
        return
    assert manifest["dropped_overlong"] == sum(no_room)
    kept = [(w, prompt) for w, prompt, nr in zip(want, prompts, no_room) if not nr]
    for pair, (full, prompt) in zip(got, kept):
        assert len(pair[0][0]) + len(pair[1][0]) <= n
        for (ids, labels), (full_ids, full_labels) in zip(pair, full):
            assert ids == full_ids[: len(ids)] and labels == full_labels[: len(ids)]  # the ends are cut
            assert len(ids) > prompt  # the prompt whole, and a response token


def test_alpaca_input_key_map_and_command_line(tmp_path, tokenizer_dir, hf_tok):
    rows = [{"q": "What is the capital", "ctx": "of the red country", "good": "Blue city", "bad": "Green city"},
            {"q": "Tell me the animal", "ctx": "", "good": "The fox", "bad": "The owl"}]
    src = tmp_path / "a.parquet"
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), src)
    main(["tokenize", "preference", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "a"),
          "--format", "alpaca", "--seq-length", "128", "--pack",
          "--map-keys", '{"instruction": "q", "input": "ctx", "chosen": "good", "rejected": "bad"}'])
    pairs = [([{"role": "user", "content": "What is the capital\n\nof the red country"}], "Blue city", "Green city"),
             ([{"role": "user", "content": "Tell me the animal"}], "The fox", "The owl")]
    assert rows_of(PreferenceDataset(tmp_path / "a"), hf_tok.pad_token_id) == [expected(hf_tok, p) for p in pairs]
    assert read_manifest(tmp_path / "a")["pack"] is True


def test_the_datasets_read_only_their_own_stage(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "p.jsonl", as_records("text", make_pairs(3, multi_turn=False)))
    run(tokenizer_dir, [src], tmp_path / "pref")
    with pytest.raises(IndexedDatasetError, match="no finished instruction dataset .* from tokenize-instruction"):
        InstructionDataset(tmp_path / "pref")
    both = InstructionDataset(tmp_path / "pref", stages=("tokenize-instruction", preference.STAGE))
    assert both.stage == preference.STAGE and len(both) == 3


def test_manifest_is_written_last(tmp_path, tokenizer_dir, monkeypatch):
    src = write_jsonl(tmp_path / "p.jsonl", as_records("text", make_pairs(40, multi_turn=False)))
    out = tmp_path / "pref"
    run(tokenizer_dir, [src], out, batch_size=8)
    manifest = output_paths(out)["manifest"]
    assert all(f.stat().st_mtime_ns <= manifest.stat().st_mtime_ns for f in dataset_files(out))

    calls = []
    encode = preference.encode_pairs

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return encode(*args)

    monkeypatch.setattr(preference, "encode_pairs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tokenizer_dir, [src], out, batch_size=8)
    assert not manifest.exists() and read_manifest(out) is None
    assert not any(f.exists() for f in dataset_files(out))


def test_the_sample_preference_set(tmp_path, sample_assets, hf_tok):
    sample = sample_assets()
    for split in ("train", "heldout"):
        argv = ["tokenize", "preference", "--input", str(sample / "preference" / f"preference_{split}.jsonl"),
                "--tokenizer", str(sample / "model"), "--out", str(tmp_path / split), "--format", "pairwise", "--seq-length", "256"]
        main(argv)
        records = [json.loads(line) for line in (sample / "preference" / f"preference_{split}.jsonl").read_text().splitlines()]
        manifest = read_manifest(tmp_path / split)
        assert manifest["pairs"] == manifest["written"] == manifest["rows"] == len(records)
        data = PreferenceDataset(tmp_path / split)
        pair = [([{"role": "user", "content": records[0]["prompt"]}], records[0]["chosen"], records[0]["rejected"])]
        assert rows_of(data, hf_tok.pad_token_id)[:1] == [expected(hf_tok, p) for p in pair]


# --- bad input: a clear error naming the file and row, before any output is touched ------------------


def _bad(tmp_path, tokenizer_dir, inputs, error, match, **kw):
    out = tmp_path / "bad" / "pref"
    with pytest.raises(error, match=match):
        run(tokenizer_dir, inputs, out, **kw)
    assert not read_manifest(out)
    assert not any(f.exists() for f in dataset_files(out))
    assert not (out.parent.exists() and any(out.parent.iterdir()))


def test_bad_rows_are_named(tmp_path, tokenizer_dir):
    good = as_records("conversational", make_pairs(300, seed=5))

    def jsonl(name: str, bad: dict, fmt: str = "conversational", at: int = 299) -> Path:
        records = as_records(fmt, make_pairs(300, seed=5, multi_turn=fmt != "text")) if fmt != "conversational" else list(good)
        records[at] = bad
        return write_jsonl(tmp_path / name, records)

    # a bad row far after the first batch, and the output of an earlier run left as it was
    first = tmp_path / "first"
    run(tokenizer_dir, [jsonl("ok.jsonl", good[0])], first)
    before = {f: f.read_bytes() for f in [*dataset_files(first), output_paths(first)["manifest"]]}
    with pytest.raises(InputError, match=r"empty\.jsonl: line 300: 'chosen' is an empty response"):
        run(tokenizer_dir, [jsonl("empty.jsonl", {**good[0], "chosen": [{"role": "assistant", "content": " "}]})], first)
    assert {f: f.read_bytes() for f in before} == before

    _bad(tmp_path, tokenizer_dir, [jsonl("same.jsonl", {**good[0], "rejected": good[0]["chosen"]}, at=1)], InputError,
         r"same\.jsonl: line 2: 'chosen' and 'rejected' are the same response")
    _bad(tmp_path, tokenizer_dir, [jsonl("text.jsonl", {"prompt": "Hi", "chosen": "", "rejected": "No"}, "text", at=4)], InputError,
         r"text\.jsonl: line 5: 'chosen' is an empty response")
    _bad(tmp_path, tokenizer_dir, [jsonl("key.jsonl", {"prompt": "Hi", "chosen": "Yes"}, at=7)], InputError,
         r"key\.jsonl: line 8: no key 'rejected'")
    _bad(tmp_path, tokenizer_dir, [jsonl("role.jsonl", {**good[0], "rejected": [{"role": "user", "content": "x"}]})], InputError,
         r"role\.jsonl: line 300: 'rejected' must be an assistant message, got role 'user'")
    _bad(tmp_path, tokenizer_dir, [jsonl("two.jsonl", {**good[0], "chosen": good[0]["chosen"] * 2})], InputError,
         r"two\.jsonl: line 300: 'chosen' must be text or a list of one assistant message")
    ends = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], "chosen": "A", "rejected": "B"}
    _bad(tmp_path, tokenizer_dir, [jsonl("ends.jsonl", ends)], InputError,
         r"ends\.jsonl: line 300: the prompt must end with a user message \(got user -> assistant\)")
    implicit = as_records("implicit", make_pairs(1, seed=6))[0]
    other = {"chosen": implicit["chosen"], "rejected": [{"role": "user", "content": "Other"}, *implicit["rejected"][-1:]]}
    _bad(tmp_path, tokenizer_dir, [jsonl("implicit.jsonl", other, "implicit")], InputError,
         r"implicit\.jsonl: line 300: without 'prompt', 'chosen' and 'rejected' must share every message but the last")
    _bad(tmp_path, tokenizer_dir, [jsonl("noprompt.jsonl", {"chosen": "A", "rejected": "B"}, "implicit")], InputError,
         r"noprompt\.jsonl: line 300: no 'prompt', so 'chosen' and 'rejected' must be conversations")
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}],
                "chosen": {"from": "gpt", "value": "A"}, "rejected": {"from": "gpt", "value": "B"}}
    _bad(tmp_path, tokenizer_dir, [jsonl("sharegpt.jsonl", sharegpt, "sharegpt")], InputError,
         r"sharegpt\.jsonl: line 300: the prompt must end with a user message", format="sharegpt")
    sharegpt = {**sharegpt, "conversations": sharegpt["conversations"][:1], "rejected": "B"}
    _bad(tmp_path, tokenizer_dir, [jsonl("sharegpt2.jsonl", sharegpt, "sharegpt")], InputError,
         r"sharegpt2\.jsonl: line 300: rejected must be an object with 'from' and 'value', got 'B'", format="sharegpt")
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"instruction": ["a", "b"], "chosen": ["x", "y"], "rejected": ["z", "y"]}), table)
    _bad(tmp_path, tokenizer_dir, [table], InputError, r"t\.parquet: row 1: 'chosen' and 'rejected' are the same", format="alpaca")
    _bad(tmp_path, tokenizer_dir, [table], InputError, r"t\.parquet: no column 'conversations'", format="sharegpt")
    _bad(tmp_path, tokenizer_dir, [table], InputError, r"--map-keys: \['output'\] are not keys of the alpaca format",
         format="alpaca", map_keys={"output": "chosen"})
    _bad(tmp_path, tokenizer_dir, [tmp_path / "ok.jsonl"], TokenizeError,
         r"seq_length 20 is below the minimum of \d+ tokens for chat template 'tokenizer': .* a row holds 2 of them", seq_length=20)
    with pytest.raises(ValueError, match="pairwise.*alpaca.*sharegpt"):
        PreferenceTokenizeConfig(input=[table], tokenizer=tokenizer_dir, out=tmp_path / "o", format="messages", seq_length=64)
