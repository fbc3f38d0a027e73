"""Instruction tokenization: labels checked against transformers' assistant-token mask,
every layout, packing, overlong handling, worker independence, and bad input."""

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
from llmflow.data.indexed import IndexedDataset
from llmflow.data.instruction_dataset import InstructionDataset, next_token_targets
from llmflow.data.readers import InputError
from llmflow.data.templates import NAMED_TEMPLATES, TemplateError, load_template
from llmflow.data.tokenize_instruction import (
    IGNORE_INDEX,
    InstructionTokenizeConfig,
    dataset_files,
    output_paths,
    tokenize_instruction,
)
from llmflow.data.tokenizer import TokenizeError

# Qwen2-Instruct's template with transformers' {% generation %} markers around what the
# assistant says, so transformers computes the reference assistant-token mask.
QWEN_GENERATION = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["what", "is", "the", "capital", "of", "country", "city", "red", "blue", "green", "sum", "of", "two", "and", "three", "answer", "question", "please", "tell", "me"]


def sentence(rng: random.Random, lo: int = 2, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([sentence(rng) for _ in range(300)], trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"]
    )
    hf.chat_template = QWEN_GENERATION
    path = tmp_path_factory.mktemp("tok") / "chat"
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def conversations(n: int, seed: int = 0, max_turns: int = 3) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, max_turns)):
            messages += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng, 1, 8)}]
        out.append(messages)
    return out


def as_records(fmt: str, convs: list[list[dict]]) -> list[dict]:
    records = []
    for messages in convs:
        if fmt == "messages":
            records.append({"messages": messages})
        elif fmt == "sharegpt":
            names = {"user": "human", "assistant": "gpt", "system": "system"}
            records.append({"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]})
        else:
            system = messages[0]["content"] if messages[0]["role"] == "system" else ""
            turns = messages[1:] if system else messages
            history = [[turns[i]["content"], turns[i + 1]["content"]] for i in range(0, len(turns) - 2, 2)]
            records.append({"instruction": turns[-2]["content"], "input": "", "output": turns[-1]["content"], "system": system, "history": history})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def run(tokenizer_dir, inputs, out, **kw) -> Path:
    kw.setdefault("format", "messages")
    kw.setdefault("seq_length", 256)
    return tokenize_instruction(InstructionTokenizeConfig(input=inputs, tokenizer=tokenizer_dir, out=out, **kw))


def samples(out: Path) -> list[tuple[list[int], list[int]]]:
    paths = output_paths(out)
    ids, labels = IndexedDataset(paths["input_ids"]), IndexedDataset(paths["labels"])
    return [(ids[i].tolist(), labels[i].tolist()) for i in range(len(ids))]


def reference(hf_tok, messages) -> tuple[list[int], list[int]]:
    """transformers: the rendered conversation's ids and its assistant-token labels."""
    enc = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = list(enc["input_ids"])
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, enc["assistant_masks"])]


@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt", "messages"])
@pytest.mark.parametrize("pack", [False, True])
def test_labels_match_transformers_assistant_mask(tmp_path, tokenizer_dir, hf_tok, fmt, pack):
    convs = conversations(40, seed=1)
    src = write_jsonl(tmp_path / "d.jsonl", as_records(fmt, convs))
    out = run(tokenizer_dir, [src], tmp_path / "sft", format=fmt, pack=pack, seq_length=320)
    got = samples(out)
    want = [reference(hf_tok, m) for m in convs]
    assert (sorted(got) == sorted(want)) if pack else (got == want)  # packing reorders samples
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in convs)  # multi-turn covered

    data = InstructionDataset(out)
    m = read_manifest(out)
    assert m["written"] == len(convs) and m["pack"] is pack and m["template"] == "tokenizer"
    assert (len(data) < len(convs)) if pack else (len(data) == len(convs))
    seen = []
    for i in range(len(data)):
        row = data[i]
        assert all(v.shape == (320,) for v in row.values())
        docs = row["document_ids"]
        n_samples = len(data.input_ids.document_sequences(i))
        pad = docs == n_samples
        assert (row["input_ids"][pad] == hf_tok.pad_token_id).all() and (row["labels"][pad] == IGNORE_INDEX).all()
        seen_end = 0
        for d in range(n_samples):
            span = np.flatnonzero(docs == d)
            assert span[0] == seen_end and np.all(np.diff(span) == 1)
            seen_end = span[-1] + 1
            seen.append((row["input_ids"][span].tolist(), row["labels"][span].tolist()))
        assert not pad[:seen_end].any() and pad[seen_end:].all()
    assert seen == got


def test_named_templates_train_only_the_responses(tmp_path, tokenizer_dir, hf_tok):
    convs = conversations(10, seed=2)
    src = write_jsonl(tmp_path / "d.jsonl", as_records("messages", convs))
    for name in NAMED_TEMPLATES:
        out = run(tokenizer_dir, [src], tmp_path / name, template=name, seq_length=2048)
        template = load_template(tokenizer_dir, name)
        for (ids, labels), messages in zip(samples(out), convs):
            pieces = template.segments(messages)
            assert hf_tok.decode(ids) == "".join(text for text, _ in pieces)
            trained = [hf_tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])]
            assert trained == ["".join(text for text, is_trained in pieces if is_trained)]
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            assert all(r.strip() in trained[0] for r in replies)
        assert read_manifest(out)["template"] == name


def test_alpaca_input_and_key_map(tmp_path, tokenizer_dir, hf_tok):
    rows = [{"q": "what is the sum", "ctx": "two and three", "a": "three"}, {"q": "tell me", "ctx": "", "a": "red"}]
    src = tmp_path / "a.parquet"
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), src)
    argv = [
        "tokenize", "instruction", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "a"),
        "--format", "alpaca", "--seq-length", "128", "--map-keys", '{"instruction": "q", "input": "ctx", "output": "a"}',
    ]
    main(argv)
    want = [
        [{"role": "user", "content": "what is the sum\n\ntwo and three"}, {"role": "assistant", "content": "three"}],
        [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "red"}],
    ]
    assert samples(tmp_path / "a") == [reference(hf_tok, m) for m in want]


def test_packing_fills_rows_and_keeps_every_sample(tmp_path, tokenizer_dir):
    convs = conversations(200, seed=3, max_turns=1)
    src = write_jsonl(tmp_path / "d.jsonl", as_records("messages", convs))
    plain, packed = (run(tokenizer_dir, [src], tmp_path / n, seq_length=512, pack=p) for n, p in (("plain", False), ("packed", True)))
    assert sorted(samples(packed)) == sorted(samples(plain))
    ds = IndexedDataset(output_paths(packed)["input_ids"])
    row_lengths = [ds.sequence_lengths[list(ds.document_sequences(d))].sum() for d in range(ds.num_documents)]
    assert max(row_lengths) <= 512
    m = read_manifest(packed)
    assert m["rows"] == ds.num_documents and m["packing_efficiency"] > 0.9
    assert m["packing_efficiency"] == pytest.approx(sum(row_lengths) / (512 * len(row_lengths)))


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_overlong_samples_are_counted(tmp_path, tokenizer_dir, hf_tok, overlong):
    convs = conversations(60, seed=4)
    lengths = [len(reference(hf_tok, m)[0]) for m in convs]
    n = int(np.median(lengths))
    src = write_jsonl(tmp_path / "d.jsonl", as_records("messages", convs))
    out = run(tokenizer_dir, [src], tmp_path / overlong, seq_length=n, overlong=overlong)
    m = read_manifest(out)
    longer = sum(length > n for length in lengths)
    assert longer > 0 and m["samples"] == len(convs)
    assert m["truncated"] + m["dropped_overlong"] == longer and m["written"] == len(convs) - m["dropped_overlong"]
    got = samples(out)
    assert all(len(ids) <= n for ids, _ in got)
    if overlong == "drop":
        assert m["truncated"] == 0
        assert got == [reference(hf_tok, c) for c, length in zip(convs, lengths) if length <= n]
    else:
        assert m["truncated"] > 0
        for ids, labels in got:
            assert any(label != IGNORE_INDEX for label in labels)


def test_same_output_for_any_worker_count(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "d.jsonl", as_records("sharegpt", conversations(300, seed=5)))
    outs = [run(tokenizer_dir, [src], tmp_path / f"w{w}", format="sharegpt", workers=w, batch_size=16, pack=True) for w in (1, 2)]
    for a, b in zip(*(dataset_files(o) for o in outs)):
        assert a.read_bytes() == b.read_bytes()


def test_next_token_targets_stay_inside_each_sample():
    labels = np.array([[-100, 5, 6, -100, 8, 9, -100]])
    docs = np.array([[0, 0, 0, 1, 1, 1, 2]])
    assert next_token_targets(labels, docs).tolist() == [[5, 6, -100, 8, 9, -100, -100]]


# --- bad input: a clear error, before any output exists ------------------------------------------


def _bad(tmp_path, tokenizer_dir, inputs, error, match, **kw):
    out = tmp_path / "bad" / "sft"
    with pytest.raises(error, match=match):
        run(tokenizer_dir, inputs, out, **kw)
    assert not read_manifest(out)
    assert not any(f.exists() for f in dataset_files(out))
    assert not (out.parent.exists() and any(out.parent.iterdir()))


def test_bad_input(tmp_path, tokenizer_dir):
    good = write_jsonl(tmp_path / "good.jsonl", as_records("alpaca", conversations(5)))
    _bad(tmp_path, tokenizer_dir, [good], InputError, r"no key 'conversations'; keys are \['history', 'input', 'instruction'", format="sharegpt")
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "output": ["b"]}), table)
    _bad(tmp_path, tokenizer_dir, [table], InputError, r"t\.parquet: no column 'instruction'; columns are \['prompt', 'output'\]", format="alpaca")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _bad(tmp_path, tokenizer_dir, [empty], InputError, r"empty\.jsonl: empty input")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(good.read_text() + '{"messages": [\n')
    _bad(tmp_path, tokenizer_dir, [broken], InputError, r"broken\.jsonl: line 6: malformed JSON", format="alpaca")
    roles = write_jsonl(tmp_path / "roles.jsonl", as_records("messages", conversations(3)) + [{"messages": [{"role": "assistant", "content": "x"}]}])
    _bad(tmp_path, tokenizer_dir, [roles], InputError, r"roles\.jsonl: line 4: message 0 is 'assistant' where 'user' was expected")
    _bad(tmp_path, tokenizer_dir, [good], InputError, r"--map-keys: \['prompt'\] are not keys of the alpaca format", format="alpaca", map_keys={"prompt": "q"})
    _bad(tmp_path, tokenizer_dir, [tmp_path / "absent.jsonl"], InputError, r"absent\.jsonl: no such file")
    _bad(tmp_path, tokenizer_dir, [good], TokenizeError, r"seq_length 5 is below the minimum of \d+ tokens for chat template 'tokenizer'", format="alpaca", seq_length=5)
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "tokenizer_config.json").write_text("{}")
    _bad(tmp_path, tmp_path / "notok", [good], TokenizeError, r"notok: no tokenizer files .*found \['tokenizer_config\.json'\]", format="alpaca")


def test_unknown_format_and_template_are_refused_by_the_config(tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="alpaca.*sharegpt.*messages"):
        InstructionTokenizeConfig(input=[tmp_path / "x.jsonl"], tokenizer=tokenizer_dir, out=tmp_path / "o", format="oasst", seq_length=64)
    with pytest.raises(ValueError, match="llama3"):
        InstructionTokenizeConfig(input=[tmp_path / "x.jsonl"], tokenizer=tokenizer_dir, out=tmp_path / "o", format="alpaca", seq_length=64, template="vicuna")


def test_tokenizer_without_template_needs_a_named_one(tmp_path, tokenizer_dir):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    good = write_jsonl(tmp_path / "good.jsonl", as_records("messages", conversations(3)))
    _bad(tmp_path, plain, [good], TemplateError, "has no chat template .* alpaca, chatml, qwen, llama2, llama3")
    assert run(plain, [good], tmp_path / "named", template="chatml")


# --- the frontier families' own chat templates (as TRL 1.16 ships them) ----------------------------

TRL_TEMPLATES = {
    # family: (original, marked, special tokens the template writes)
    "deepseek_v3": ("deepseekv3", "deepseekv3_training", {"bos_token": "<｜begin▁of▁sentence｜>",
                                                          "eos_token": "<｜end▁of▁sentence｜>"},
                    ["<｜User｜>", "<｜Assistant｜>"]),
    "gemma3_text": ("gemma3", "gemma3_training", {"bos_token": "<bos>", "eos_token": "<eos>"},
                    ["<start_of_turn>", "<end_of_turn>"]),
    "glm4_moe": ("glm4moe", "glm4moe_training", {"eos_token": "<|endoftext|>"},
                 ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]),
    "gpt_oss": ("gptoss", "gptoss_training", {"eos_token": "<|return|>"},
                ["<|start|>", "<|end|>", "<|message|>", "<|channel|>"]),
}


def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def family_tokenizer(tokenizer_dir: Path, out: Path, family: str, template: str) -> Path:
    """The module's tokenizer with ``family``'s special tokens and chat template ``template``."""
    from transformers import AutoTokenizer

    _, _, special, extra = TRL_TEMPLATES[family]
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf.add_special_tokens({**special, "additional_special_tokens": extra})
    hf.chat_template = trl_template(template)
    hf.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", list(TRL_TEMPLATES))
def test_frontier_chat_templates_train_what_transformers_masks(tmp_path, tokenizer_dir, family):
    """Each family's template with TRL's {% generation %} marks: the labels are transformers'
    assistant-token mask, multi-turn and with a system message. Gemma 3's and GLM-4.5's
    templates as the checkpoints ship them (no marks) train the same replies, split by their
    prefixes; DeepSeek-V3's and gpt-oss's are refused, naming the marked templates."""
    from transformers import AutoTokenizer

    original, marked, _, _ = TRL_TEMPLATES[family]
    convs = conversations(12, seed=3)
    assert any(c[0]["role"] == "system" for c in convs)
    src = write_jsonl(tmp_path / "d.jsonl", as_records("messages", convs))
    tokenizer = family_tokenizer(tokenizer_dir, tmp_path / "marked", family, marked)
    hf = AutoTokenizer.from_pretrained(tokenizer)
    want = [reference(hf, m) for m in convs]
    assert samples(run(tokenizer, [src], tmp_path / "sft", seq_length=512)) == want
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in convs)

    shipped = family_tokenizer(tokenizer_dir, tmp_path / "shipped", family, original)
    if family in ("deepseek_v3", "gpt_oss"):
        with pytest.raises(TemplateError, match=r"marks the assistant's text with \{% generation %\}"):
            run(shipped, [src], tmp_path / "refused", seq_length=512)
        return
    got = samples(run(shipped, [src], tmp_path / "prefixes", seq_length=512))
    trained = [[t for t in labels if t != IGNORE_INDEX] for _, labels in got]
    if family == "gemma3_text":
        assert got == want
    else:  # GLM-4.5's reply has no end-of-turn text of its own: the next turn's <|user|> ends it
        user = hf.convert_tokens_to_ids("<|user|>")
        assert trained == [[t for t, label in zip(*w, strict=True) if label != IGNORE_INDEX and t != user]
                           for w in want]
