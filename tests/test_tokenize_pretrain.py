"""Pretraining tokenization: every input format, Megatron byte layout, worker-count
independence, vocabulary checks, and clean failure (no complete-looking output)."""

from __future__ import annotations

import csv
import json
import random
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.artifacts import read_manifest
from llmflow.data.indexed import IndexedDataset
from llmflow.data.readers import InputError
from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, output_paths, tokenize_pretrain
from llmflow.data.tokenizer import TokenizeError

WORDS = ["the", "model", "learns", "tokens", "from", "text", "and", "data", "flows", "through", "every", "stage", "of", "training", "pipeline", "parallel", "tensor", "gradient", "loss", "falls", "accuracy", "rises", "über", "café", "naïve", "東京", "数据", "✓"]


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 25))]
        if i % 7 == 0:
            words.insert(1, "a, \"quoted\" phrase")
        docs.append(" ".join(words) + ("." if i % 3 else "!"))
    return docs


DOCS = make_docs(300)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab ~400) trained on the corpus, saved as a HF tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(make_docs(400, seed=1), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    path = tmp_path_factory.mktemp("tok") / "tiny"
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def expected(hf_tok, docs, eod=False) -> list[list[int]]:
    ids = hf_tok(docs, add_special_tokens=False)["input_ids"]
    return [x + [hf_tok.eos_token_id] for x in ids] if eod else ids


def write_parquet(path: Path, docs, key="text") -> Path:
    pq.write_table(pa.table({key: docs, "id": list(range(len(docs)))}), path, row_group_size=64)
    return path


def write_jsonl(path: Path, docs, key="text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, key: d}, ensure_ascii=False) + "\n" for i, d in enumerate(docs))
    return path


def run(tokenizer_dir, inputs, out, **kw) -> Path:
    cfg = PretrainTokenizeConfig(input=[str(p) for p in inputs], tokenizer=tokenizer_dir, out=out, **kw)
    return tokenize_pretrain(cfg)


def read_back(out) -> list[list[int]]:
    ds = IndexedDataset(output_paths(out)["prefix"])
    return [ds[i].tolist() for i in range(len(ds))]


def assert_no_output(directory: Path) -> None:
    left = sorted(p.name for p in directory.iterdir())
    assert left == [], f"files left after a failed run: {left}"


# --- correctness ---------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size,dtype", [(None, "uint16"), (70000, "int32")])
@pytest.mark.parametrize("append_eod", [False, True])
def test_roundtrip(tmp_path, tokenizer_dir, hf_tok, vocab_size, dtype, append_eod):
    src = write_parquet(tmp_path / "c.parquet", DOCS)
    out = run(tokenizer_dir, [src], tmp_path / "out" / "ds", vocab_size=vocab_size, append_eod=append_eod, batch_size=50)
    ds = IndexedDataset(output_paths(out)["prefix"])
    assert ds.dtype == np.dtype(dtype)
    want = expected(hf_tok, DOCS, append_eod)
    assert read_back(out) == want
    m = read_manifest(out)
    assert m["documents"] == len(DOCS) and m["tokens"] == sum(map(len, want))
    assert m["dtype"] == dtype and m["vocab_size"] == (vocab_size or len(hf_tok))
    sizes = {f["path"]: f["size"] for f in m["files"]}
    assert set(sizes) == {"ds_text_document.bin", "ds_text_document.idx"}
    assert sizes["ds_text_document.bin"] == m["tokens"] * np.dtype(dtype).itemsize


@pytest.mark.parametrize("vocab_size,code,itemsize", [(None, 8, 2), (70000, 4, 4)])
def test_idx_bytes_match_megatron_layout(tmp_path, tokenizer_dir, hf_tok, vocab_size, code, itemsize):
    docs = DOCS[:40]
    out = run(tokenizer_dir, [write_jsonl(tmp_path / "c.jsonl", docs)], tmp_path / "ds", vocab_size=vocab_size, append_eod=True)
    paths = output_paths(out)
    raw = paths["idx"].read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, dtype_code, n, d = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, dtype_code, n, d) == (1, code, len(docs), len(docs) + 1)
    off = 9 + 8 + 1 + 8 + 8
    lengths = struct.unpack_from(f"<{n}i", raw, off)
    off += 4 * n
    pointers = struct.unpack_from(f"<{n}q", raw, off)
    off += 8 * n
    doc_idx = struct.unpack_from(f"<{d}q", raw, off)
    off += 8 * d
    assert off == len(raw)
    want = expected(hf_tok, docs, eod=True)
    assert list(lengths) == [len(x) for x in want]
    assert list(pointers) == list(np.cumsum([0] + [len(x) * itemsize for x in want[:-1]]))
    assert list(doc_idx) == list(range(n + 1))
    fmt = "<H" if itemsize == 2 else "<i"
    binary = paths["bin"].read_bytes()
    assert len(binary) == sum(lengths) * itemsize
    flat = [v for (v,) in struct.iter_unpack(fmt, binary)]
    assert flat == [t for x in want for t in x]


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [None, 70000])
def test_bytes_equal_megatron_core_builder(tmp_path, tokenizer_dir, hf_tok, vocab_size):
    """The same ids through megatron-core's own IndexedDatasetBuilder (as Megatron-LM's
    preprocess_data.py writes them: one sequence per document) give the same .bin and .idx."""
    indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    out = run(tokenizer_dir, [write_jsonl(tmp_path / "c.jsonl", DOCS)], tmp_path / "ours", vocab_size=vocab_size,
              append_eod=True, batch_size=64)
    prefix = tmp_path / "megatron_text_document"
    builder = indexed_dataset.IndexedDatasetBuilder(
        f"{prefix}.bin", dtype=indexed_dataset.DType.optimal_dtype(vocab_size or len(hf_tok)))
    for ids in expected(hf_tok, DOCS, eod=True):
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{prefix}.idx")
    for key in ("bin", "idx"):
        assert output_paths(out)[key].read_bytes() == Path(f"{prefix}.{key}").read_bytes(), key
    theirs = indexed_dataset.IndexedDataset(str(output_paths(out)["prefix"]))
    assert [theirs[i].tolist() for i in range(len(theirs))] == expected(hf_tok, DOCS, eod=True)


def test_workers_give_identical_bytes(tmp_path, tokenizer_dir):
    src = write_parquet(tmp_path / "c.parquet", DOCS)
    src2 = write_jsonl(tmp_path / "d.jsonl", DOCS[::-1])
    one = run(tokenizer_dir, [src, src2], tmp_path / "one", workers=1, batch_size=16, append_eod=True)
    two = run(tokenizer_dir, [src, src2], tmp_path / "two", workers=2, batch_size=16, append_eod=True)
    for key in ("bin", "idx"):
        assert output_paths(one)[key].read_bytes() == output_paths(two)[key].read_bytes()


def _write_format(fmt: str, directory: Path, docs: list[str]) -> Path:
    if fmt == "parquet":
        return write_parquet(directory / "c.parquet", docs)
    if fmt == "jsonl":
        return write_jsonl(directory / "c.jsonl", docs)
    if fmt == "json":
        path = directory / "c.json"
        path.write_text(json.dumps([{"text": d, "n": i} for i, d in enumerate(docs)], ensure_ascii=False, indent=1))
        return path
    if fmt == "csv":
        path = directory / "c.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", "text"])
            w.writerows([i, d] for i, d in enumerate(docs))
        return path
    if fmt == "txt":
        path = directory / "c.txt"
        path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")  # blank lines are skipped
        return path
    if fmt == "hf":
        from datasets import Dataset

        path = directory / "hfds"
        Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).save_to_disk(str(path))
        return path
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "json", "csv", "txt", "hf"])
def test_every_input_format(tmp_path, tokenizer_dir, hf_tok, fmt):
    docs = DOCS[:120]
    if fmt == "csv":
        docs = docs[:-1] + ["a document\nwith a newline, a comma and \"quotes\""]
    src = _write_format(fmt, tmp_path, docs)
    out = run(tokenizer_dir, [src], tmp_path / "out" / "ds", batch_size=32)
    assert read_back(out) == expected(hf_tok, docs)


# --- vocabulary ----------------------------------------------------------------------------


def test_vocab_smaller_than_tokenizer_fails_before_work(tmp_path, tokenizer_dir, hf_tok):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:10])
    (tmp_path / "out").mkdir()
    with pytest.raises(TokenizeError, match=rf"vocab_size 100 .*smaller than the tokenizer's {len(hf_tok)}"):
        run(tokenizer_dir, [src], tmp_path / "out" / "ds", vocab_size=100)
    assert_no_output(tmp_path / "out")


def test_vocab_from_config_json(tmp_path, tokenizer_dir, hf_tok):
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    (tok / "config.json").write_text(json.dumps({"vocab_size": 70016}))
    out = run(tok, [write_jsonl(tmp_path / "c.jsonl", DOCS[:10])], tmp_path / "ds")
    assert read_manifest(out)["vocab_size"] == 70016 and read_manifest(out)["dtype"] == "int32"


@pytest.fixture
def sparse_tokenizer(tmp_path, tokenizer_dir, hf_tok) -> tuple[Path, int]:
    """The tiny tokenizer with the id of "~" moved past its length: len(tokenizer) stays the
    same, so the up-front check passes and only the per-row check can catch "~" (as when a
    model's vocabulary does not cover a tokenizer it was not trained with)."""
    import shutil

    tok = tmp_path / "sparse"
    shutil.copytree(tokenizer_dir, tok)
    spec = json.loads((tok / "tokenizer.json").read_text())
    new_id = len(hf_tok) + 50
    spec["model"]["vocab"]["~"] = new_id
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    return tok, new_id


def test_token_outside_vocab_names_file_and_row(tmp_path, sparse_tokenizer, hf_tok):
    tok, bad_id = sparse_tokenizer
    docs = DOCS[:200]
    docs[150] = "the model ~ learns"
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    (tmp_path / "out").mkdir()
    with pytest.raises(TokenizeError) as e:
        run(tok, [src], tmp_path / "out" / "ds", batch_size=16, workers=2)
    msg = str(e.value)
    assert f"{src}: line 151:" in msg and f"token id {bad_id}" in msg and f"vocab_size {len(hf_tok)}" in msg
    assert_no_output(tmp_path / "out")
    # The same rows in parquet are named by row index.
    src = write_parquet(tmp_path / "c.parquet", docs)
    with pytest.raises(TokenizeError, match=r"c\.parquet: row 150: token id"):
        run(tok, [src], tmp_path / "out" / "ds", batch_size=16)
    assert_no_output(tmp_path / "out")


# --- bad input -----------------------------------------------------------------------------


def _bad(tmp_path, tokenizer_dir, inputs, err, pattern, **kw):
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    with pytest.raises(err, match=pattern):
        run(tokenizer_dir, inputs, out_dir / "ds", **kw)
    assert_no_output(out_dir)


def test_missing_column(tmp_path, tokenizer_dir):
    pq_path = write_parquet(tmp_path / "c.parquet", DOCS[:5], key="content")
    _bad(tmp_path, tokenizer_dir, [pq_path], InputError, r"c\.parquet: no column 'text'; columns are \['content', 'id'\]")
    csv_path = _write_format("csv", tmp_path, DOCS[:5])
    _bad(tmp_path, tokenizer_dir, [csv_path], InputError, r"c\.csv: no column 'body'; columns are \['id', 'text'\]", text_key="body")
    jl = write_jsonl(tmp_path / "c.jsonl", DOCS[:5], key="content")
    _bad(tmp_path, tokenizer_dir, [jl], InputError, r"c\.jsonl: line 1: no key 'text'; keys are \['content', 'id'\]")
    # A good first file does not let a bad second one through.
    _bad(tmp_path, tokenizer_dir, [write_jsonl(tmp_path / "ok.jsonl", DOCS[:5]), pq_path], InputError, "no column 'text'")


def test_empty_input(tmp_path, tokenizer_dir):
    (tmp_path / "e.jsonl").write_text("\n\n")
    _bad(tmp_path, tokenizer_dir, [tmp_path / "e.jsonl"], InputError, r"e\.jsonl: empty input")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    _bad(tmp_path, tokenizer_dir, [tmp_path / "e.parquet"], InputError, r"e\.parquet: empty input")
    (tmp_path / "e.txt").write_text("")
    _bad(tmp_path, tokenizer_dir, [tmp_path / "e.txt"], InputError, r"e\.txt: empty input")
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", "  "])
    _bad(tmp_path, tokenizer_dir, [blank], InputError, "no documents")


def test_malformed_jsonl_late_line(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:200])
    lines = src.read_text().splitlines()
    lines[179] = '{"text": "broken'
    src.write_text("\n".join(lines) + "\n")
    # Batches before line 180 are tokenized and written first; none of it may survive.
    _bad(tmp_path, tokenizer_dir, [src], InputError, r"c\.jsonl: line 180: malformed JSON", batch_size=16)
    _bad(tmp_path, tokenizer_dir, [src], InputError, r"c\.jsonl: line 180", batch_size=16, workers=2)


def test_unknown_extension_and_missing_file(tmp_path, tokenizer_dir):
    (tmp_path / "c.xml").write_text("<doc/>")
    _bad(tmp_path, tokenizer_dir, [tmp_path / "c.xml"], InputError, r"c\.xml: unknown input format '\.xml'; supported: \.parquet")
    _bad(tmp_path, tokenizer_dir, [tmp_path / "nope.jsonl"], InputError, r"nope\.jsonl: no such file")


def test_tokenizer_dir_missing_files(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:5])
    empty = tmp_path / "emptytok"
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text("{}")
    _bad(tmp_path, empty, [src], TokenizeError, r"emptytok: no tokenizer files \(expected one of tokenizer\.json, .*found \['tokenizer_config\.json'\]")
    _bad(tmp_path, tmp_path / "absent", [src], TokenizeError, "absent: no such directory")
    # --append-eod with a tokenizer that has no eos token.
    import shutil

    noeos = tmp_path / "noeos"
    shutil.copytree(tokenizer_dir, noeos)
    cfg = json.loads((noeos / "tokenizer_config.json").read_text())
    cfg.pop("eos_token", None)
    (noeos / "tokenizer_config.json").write_text(json.dumps(cfg))
    (noeos / "special_tokens_map.json").unlink(missing_ok=True)
    _bad(tmp_path, noeos, [src], TokenizeError, "append-eod needs an eos_token", append_eod=True)


def test_failed_rerun_withdraws_old_manifest(tmp_path, tokenizer_dir):
    good = write_jsonl(tmp_path / "c.jsonl", DOCS[:20])
    out = run(tokenizer_dir, [good], tmp_path / "ds")
    assert read_manifest(out) is not None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + "{oops\n")
    with pytest.raises(InputError, match="line 21"):
        run(tokenizer_dir, [bad], tmp_path / "ds")
    assert read_manifest(out) is None


# --- command line --------------------------------------------------------------------------


def test_cli(tmp_path, tokenizer_dir, hf_tok, capsys):
    from llmflow.cli import main

    f1 = write_jsonl(tmp_path / "a.jsonl", DOCS[:30])
    f2 = write_parquet(tmp_path / "b.parquet", DOCS[30:50])
    prefix = tmp_path / "out" / "corpus"
    main(["tokenize", "pretrain", "--input", str(f1), str(f2), "--tokenizer", str(tokenizer_dir),
          "--out", str(prefix), "--append-eod", "--workers", "2"])
    assert read_back(prefix) == expected(hf_tok, DOCS[:50], eod=True)
    assert read_manifest(prefix)["documents"] == 50
    assert str(output_paths(prefix)["prefix"]) in capsys.readouterr().out
