"""Pretraining tokenization: text corpora -> one Megatron indexed dataset.

``tokenize_pretrain`` reads every input (see ``llmflow.data.readers`` for the formats),
tokenizes batches of documents with the fast (Rust) tokenizer that transformers'
``AutoTokenizer`` builds for the directory, in ``workers`` processes: a document's ids are
``AutoTokenizer(text, add_special_tokens=False)``'s (no BOS unless ``add_special_tokens``),
then the EOD with ``append_eod``. It checks every id against the model's vocabulary, and streams the
tokens into ``{out}_text_document.bin/.idx`` (one document per sequence, as Megatron-LM's
``tools/preprocess_data.py`` writes). ``{out}.manifest.json`` is written last; on any
error the partial files are removed, so an output without a manifest never looks complete.

Order is kept (batches are collected in submission order), so the output is byte for
byte the same for any worker count. At most ``2 * workers`` batches are in flight, so
memory does not grow with the input. Documents whose text is empty or only whitespace
are skipped (counted in the manifest as ``skipped_empty``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import CliVariadicArg

from llmflow.artifacts import write_prefix_manifest
from llmflow.data.indexed import IndexedDatasetWriter, optimal_token_dtype
from llmflow.data.parallel import ordered_map
from llmflow.data.readers import InputError, describe_row, iter_texts, validate_input
from llmflow.data.tokenizer import (
    TokenizeError,
    load_tokenizer,
    out_of_vocab_message,
    resolve_vocab_size,
    tokenizer_from_state,
    tokenizer_info,
    tokenizer_state,
)

STAGE = "tokenize-pretrain"
log = logging.getLogger("llmflow.tokenize")


class PretrainTokenizeConfig(BaseModel):
    """Tokenize text corpora into a Megatron indexed dataset for pretraining."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    input: CliVariadicArg[list[Path]] = Field(min_length=1)
    """Input files, read in order: .parquet, .jsonl, .json (array or lines), .csv (with a
    header), .txt (one document per non-empty line), or a datasets save_to_disk directory."""
    tokenizer: Path
    """Hugging Face tokenizer or model directory, encoded as transformers' AutoTokenizer loads
    it (tokenizer.json or tokenizer.model, tokenizer_config.json; a config.json there gives
    the model type and the model's vocab_size)."""
    out: Path
    """Output prefix: writes {out}_text_document.bin/.idx and {out}.manifest.json."""
    text_key: str = "text"
    """Column (parquet, csv, datasets) or key (json, jsonl) holding the document text."""
    workers: int = Field(default=1, ge=1)
    """Tokenizer processes. 1 tokenizes in this process (the Rust tokenizer may still use
    several threads); N > 1 runs N single-threaded worker processes."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document token (eos_token) to every document."""
    add_special_tokens: bool = False
    """Add the special tokens transformers' AutoTokenizer adds to a text (BOS for Llama- and
    Mistral-style tokenizers). Off by default (Megatron's convention for pretraining data):
    a document is its text's tokens, then the EOD with --append-eod."""
    vocab_size: int | None = Field(default=None, ge=1)
    """The model's vocabulary size (embedding rows); every id must be below it. Default:
    vocab_size from config.json in the tokenizer directory, else the tokenizer's length."""
    batch_size: int = Field(default=256, ge=1)
    """Documents per tokenizer batch (the unit of work handed to a worker)."""
    log_every: int = Field(default=100_000, ge=1)
    """Log progress every this many documents."""


# --- batch encoding (runs in worker processes) --------------------------------------------------

_worker_tokenizer = None
_worker_eod: int | None = None
_worker_special = False
_worker_vocab = 0
_worker_dtype: Any = np.uint16


def _init_worker(
    tokenizer: tuple[str, bool], special: bool, eod: int | None, vocab_size: int, dtype: str, single_thread: bool
) -> None:
    global _worker_tokenizer, _worker_special, _worker_eod, _worker_vocab, _worker_dtype
    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = tokenizer_from_state(tokenizer)
    _worker_special, _worker_eod, _worker_vocab, _worker_dtype = special, eod, vocab_size, np.dtype(dtype)


def _encode_batch(texts: list[str]) -> tuple[bytes, np.ndarray, int]:
    """Tokens of ``texts`` back to back (as the output dtype's bytes), their lengths, and
    the index in the batch of the first document holding an id outside [0, vocab), or -1."""
    encodings = _worker_tokenizer.encode_batch_fast(texts, add_special_tokens=_worker_special)
    ids = [e.ids for e in encodings]
    if _worker_eod is not None:
        for x in ids:
            x.append(_worker_eod)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    bad = -1
    if flat.size and (flat.min() < 0 or flat.max() >= _worker_vocab):
        wrong = np.flatnonzero((flat < 0) | (flat >= _worker_vocab))[0]
        bad = int(np.searchsorted(np.cumsum(lengths), wrong, side="right"))
    return flat.astype(_worker_dtype).tobytes(), lengths, bad


# --- the stage ----------------------------------------------------------------------------------


def output_paths(out: str | Path) -> dict[str, Path]:
    """The files a run with prefix ``out`` writes."""
    out = Path(out)
    prefix = Path(f"{out}_text_document")
    return {
        "prefix": prefix,
        "bin": Path(f"{prefix}.bin"),
        "idx": Path(f"{prefix}.idx"),
        "manifest": Path(f"{out}.manifest.json"),
    }


def _batches(paths: list[Path], text_key: str, batch_size: int, skipped: list[int]) -> Iterator[tuple[int, list[int], list[str]]]:
    """(input index, rows, texts) batches; a batch never spans two inputs."""
    for i, path in enumerate(paths):
        rows: list[int] = []
        texts: list[str] = []
        for row, text in iter_texts(path, text_key):
            if not text.strip():
                skipped[0] += 1
                continue
            rows.append(row)
            texts.append(text)
            if len(texts) == batch_size:
                yield i, rows, texts
                rows, texts = [], []
        if texts:
            yield i, rows, texts


def tokenize_pretrain(config: PretrainTokenizeConfig) -> Path:
    """Tokenize ``config.input`` into ``{out}_text_document.bin/.idx`` + manifest; returns ``out``."""
    started = time.perf_counter()
    paths = [Path(p) for p in config.input]
    outputs = output_paths(config.out)

    # Everything that can be checked is checked before any output is touched.
    info = tokenizer_info(config.tokenizer)
    vocab_size, vocab_source = resolve_vocab_size(config.vocab_size, info)
    eod = None
    if config.append_eod:
        if info.eos_token_id is None:
            raise TokenizeError(
                f"tokenizer {config.tokenizer}: --append-eod needs an eos_token "
                f"(tokenizer_config.json eos_token is {info.eos_token!r}, not a token of the vocabulary)"
            )
        eod = info.eos_token_id
        if not 0 <= eod < vocab_size:
            raise TokenizeError(f"EOD id {eod} is outside the model vocabulary of {vocab_size}")
    for path in paths:
        validate_input(path, config.text_key)
    dtype = np.dtype(optimal_token_dtype(vocab_size))

    # A manifest from an earlier run must not vouch for the files this run replaces.
    outputs["manifest"].unlink(missing_ok=True)
    skipped = [0]
    # Workers rebuild the tokenizer transformers built here (they need not import transformers).
    tokenizer = tokenizer_state(load_tokenizer(config.tokenizer))
    init_args = (tokenizer, config.add_special_tokens, eod, vocab_size, dtype.name, config.workers > 1)
    writer = IndexedDatasetWriter(outputs["prefix"], dtype.type)
    documents = 0
    next_log = config.log_every
    try:
        batches = _batches(paths, config.text_key, config.batch_size, skipped)
        encoded = ordered_map(_encode_batch, batches, config.workers, _init_worker, init_args, key=lambda b: b[2])
        for (file_index, rows, _texts), (tokens, lengths, bad) in encoded:
            if bad >= 0:
                _raise_out_of_vocab(paths[file_index], rows[bad], _texts[bad], config, vocab_size, vocab_source, eod)
            flat = np.frombuffer(tokens, dtype=dtype)
            writer.add_documents(np.split(flat, np.cumsum(lengths[:-1])))
            documents += len(rows)
            if documents >= next_log:
                elapsed = time.perf_counter() - started
                log.info("%d documents, %d tokens, %.0f tokens/s", documents, writer.num_tokens, writer.num_tokens / elapsed)
                next_log += config.log_every
        if documents == 0:
            raise InputError(f"no documents: every record of {[str(p) for p in paths]} is empty text")
        writer.finalize()
    except BaseException:
        writer.abort()
        raise

    seconds = time.perf_counter() - started
    stats = {
        "documents": documents,
        "tokens": writer.num_tokens,
        "skipped_empty": skipped[0],
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "vocab_size_source": vocab_source,
        "tokenizer_length": info.length,
        "eod_id": eod,
        "seconds": round(seconds, 3),
        "tokens_per_s": writer.num_tokens / seconds if seconds > 0 else 0.0,
        "data_prefix": str(outputs["prefix"]),
    }
    files = [outputs["bin"], outputs["idx"]]
    write_prefix_manifest(outputs["manifest"], files, STAGE, config.model_dump(mode="json"), **stats)
    log.info(
        "wrote %s: %d documents, %d tokens (%s) in %.1f s, %.0f tokens/s",
        outputs["prefix"], documents, writer.num_tokens, dtype.name, seconds, stats["tokens_per_s"],
    )
    return Path(config.out)


def _raise_out_of_vocab(path, row, text, config, vocab_size, vocab_source, eod) -> None:
    tok = load_tokenizer(config.tokenizer)
    ids = tok.encode(text, add_special_tokens=config.add_special_tokens).ids + ([eod] if eod is not None else [])
    bad = next(i for i in ids if not 0 <= i < vocab_size)
    raise TokenizeError(out_of_vocab_message(f"{path}: {describe_row(path, row)}", bad, vocab_size, vocab_source, config.tokenizer))


# --- command line -------------------------------------------------------------------------------


class PretrainCommand(PretrainTokenizeConfig):
    """Tokenize text corpora into a Megatron indexed dataset ({out}_text_document.bin/.idx)."""

    def cli_cmd(self) -> None:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        out = tokenize_pretrain(PretrainTokenizeConfig(**self.model_dump()))
        print(output_paths(out)["prefix"])
