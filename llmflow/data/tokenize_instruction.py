"""Instruction tokenization: conversations -> input_ids and labels indexed datasets.

Each record (see ``llmflow.data.conversations`` for the layouts) becomes a conversation,
rendered with a chat template (``llmflow.data.templates``, the same one generation and
evaluation use) and split into prompt text and assistant text. The rendered text is
encoded whole, with the tokenizer transformers' AutoTokenizer builds and no special tokens
added, so the ids are ``apply_chat_template``'s. Prompt tokens get label -100, assistant
tokens (and the end-of-turn text the template closes them with) are trained, in every
assistant turn of a multi-turn conversation.

Output, named as MindSpeed-LLM names its instruction data:

- ``{out}_packed_input_ids_document.bin/.idx``: token ids (uint16 under a 65500 vocabulary);
- ``{out}_packed_labels_document.bin/.idx``: labels aligned with the ids (int32, -100 on
  prompt tokens);
- ``{out}.manifest.json`` last: counts, template, seq_length, pad id.

Every sample is one sequence of the indexed datasets. Unpacked, every sample is also its
own document; with ``pack`` a document is a row of samples whose lengths sum to at most
``seq_length``: the document index is the boundary data that keeps attention inside each
sample and restarts positions (``llmflow.data.instruction_dataset`` pads the rows and
derives both). Samples longer than ``seq_length`` are dropped or truncated as
``overlong`` says, and counted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import CliVariadicArg

from llmflow.artifacts import write_prefix_manifest
from llmflow.data.conversations import Format, Message, record_columns, resolve_keys, to_messages
from llmflow.data.indexed import IndexedDatasetWriter, optimal_token_dtype
from llmflow.data.packing import Packer
from llmflow.data.parallel import ordered_map
from llmflow.data.readers import InputError, describe_row, iter_records, validate_input
from llmflow.data.templates import ChatTemplate, load_template
from llmflow.data.tokenizer import (
    TokenizeError,
    TokenizerInfo,
    load_tokenizer,
    out_of_vocab_message,
    resolve_vocab_size,
    tokenizer_from_state,
    tokenizer_info,
    tokenizer_state,
)

STAGE = "tokenize-instruction"
IGNORE_INDEX = -100
LABEL_DTYPE = np.int32
log = logging.getLogger("llmflow.tokenize")
T = TypeVar("T")
Sample = tuple[np.ndarray, np.ndarray]
"""A tokenized sequence: (input_ids, labels)."""

TemplateName = Literal["tokenizer", "alpaca", "chatml", "qwen", "llama2", "llama3"]


class InstructionTokenizeConfig(BaseModel):
    """Tokenize instruction data (alpaca, sharegpt, messages) into input_ids and labels datasets."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    input: CliVariadicArg[list[Path]] = Field(min_length=1)
    """Input files, read in order: .parquet, .jsonl, .json (array or lines), .csv (alpaca
    only), or a datasets save_to_disk directory."""
    tokenizer: Path
    """Hugging Face tokenizer or model directory, encoded as transformers' AutoTokenizer loads
    it (tokenizer.json or tokenizer.model, tokenizer_config.json with the chat template; a
    config.json there gives the model type and the model's vocab_size)."""
    out: Path
    """Output prefix: writes {out}_packed_input_ids_document.bin/.idx,
    {out}_packed_labels_document.bin/.idx and {out}.manifest.json."""
    format: Format
    """Record layout: alpaca (instruction/input/output[/system/history]), sharegpt
    (conversations of from/value) or messages (messages of role/content)."""
    seq_length: int = Field(ge=1)
    """Tokens per training sequence: longer samples are dropped or truncated (--overlong);
    with --pack, the length of every packed row."""
    map_keys: dict[str, str] = {}
    """Rename the format's keys, as JSON: {"instruction": "prompt", "output": "answer"};
    inner keys too ({"conversations": "dialog", "from": "speaker", "value": "text"})."""
    template: TemplateName | None = None
    """Chat template: the tokenizer's own (default when it has one) or a named one."""
    pack: bool = False
    """Pack several samples into each row of seq_length tokens (attention and positions
    stay within each sample)."""
    overlong: Literal["drop", "truncate"] = "drop"
    """Samples longer than seq_length: drop them, or cut them to seq_length (a sample left
    without a trained token is dropped). Either way the count is reported."""
    vocab_size: int | None = Field(default=None, ge=1)
    """The model's vocabulary size; every id must be below it. Default: config.json in the
    tokenizer directory, else the tokenizer's length."""
    workers: int = Field(default=1, ge=1)
    """Tokenizer processes (1: in this process)."""
    batch_size: int = Field(default=256, ge=1)
    """Conversations per tokenizer batch."""


def output_paths(out: str | Path) -> dict[str, Path]:
    """The dataset prefixes and the manifest a run with prefix ``out`` writes."""
    return {
        "input_ids": Path(f"{out}_packed_input_ids_document"),
        "labels": Path(f"{out}_packed_labels_document"),
        "manifest": Path(f"{out}.manifest.json"),
    }


def dataset_files(out: str | Path) -> list[Path]:
    paths = output_paths(out)
    return [Path(f"{paths[k]}{ext}") for k in ("input_ids", "labels") for ext in (".bin", ".idx")]


# --- encoding (runs in worker processes) ----------------------------------------------------------

_worker: dict[str, Any] = {}


def init_worker(tokenizer: tuple[str, bool], template: ChatTemplate, vocab_size: int, single_thread: bool) -> None:
    """Set up this process's encoder (``ordered_map``'s initializer)."""
    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=tokenizer_from_state(tokenizer), template=template, vocab_size=vocab_size)


def worker_encoder() -> tuple[Any, ChatTemplate, int]:
    """(tokenizer, template, vocab_size) that ``init_worker`` set up in this process."""
    return _worker["tokenizer"], _worker["template"], _worker["vocab_size"]


def encode_segments(tokenizer, pieces: list[list[tuple[str, bool]]]) -> list[Sample]:
    """(input_ids, labels) of each list of ``(text, trained)`` pieces: the concatenated text
    encoded whole, as transformers' ``apply_chat_template`` encodes it (no special tokens
    added), labels -100 on every token outside the trained pieces (a token that overlaps one
    is trained, as in transformers' assistant-token mask)."""
    texts = ["".join(text for text, _ in segments) for segments in pieces]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)  # with offsets
    samples = []
    for segments, encoding in zip(pieces, encoded):
        spans, start = [], 0
        for text, trained in segments:
            if trained:
                spans.append((start, start + len(text)))
            start += len(text)
        ids = np.array(encoding.ids, dtype=np.int64)
        labels = np.full(ids.size, IGNORE_INDEX, dtype=LABEL_DTYPE)
        for i, (begin, end) in enumerate(encoding.offsets):
            if any(begin < e and end > s for s, e in spans):
                labels[i] = ids[i]
        samples.append((ids, labels))
    return samples


def encode_conversations(tokenizer, template: ChatTemplate, conversations: list[list[Message]]) -> list[Sample]:
    """(input_ids, labels) of each conversation, trained on every assistant turn (the
    template's ``segments``) and encoded by ``encode_segments``."""
    return encode_segments(tokenizer, [template.segments(messages) for messages in conversations])


def out_of_vocab(samples: list[Sample], vocab_size: int) -> int:
    """Index of the first sample holding an id outside the model vocabulary (-1 when none does)."""
    return next((i for i, (ids, _) in enumerate(samples) if ids.size and (ids.min() < 0 or ids.max() >= vocab_size)), -1)


def _encode_batch(conversations: list[list[Message]]) -> tuple[list[Sample], int]:
    """Encoded conversations and the index of the first one holding an id outside the
    model vocabulary (-1 when none does)."""
    tokenizer, template, vocab_size = worker_encoder()
    samples = encode_conversations(tokenizer, template, conversations)
    return samples, out_of_vocab(samples, vocab_size)


# --- what the chat-data stages share ----------------------------------------------------------------


def minimum_seq_length(tokenizer, template: ChatTemplate) -> int:
    """Tokens of a one-turn conversation with empty messages, plus one response token: no
    sample fits in fewer."""
    empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    ids, _ = encode_conversations(tokenizer, template, [empty])[0]
    return int(ids.size) + 1


@dataclass
class ChatEncoder:
    """The tokenizer, template and vocabulary a chat-data stage encodes with, checked
    before any output is touched."""

    tokenizer: Any
    template: ChatTemplate
    info: TokenizerInfo
    vocab_size: int
    vocab_source: str

    @classmethod
    def load(cls, config: Any, sequences: int = 1) -> ChatEncoder:
        """The encoder for ``config`` (its tokenizer, template, vocab_size); an error unless
        ``config.seq_length`` fits ``sequences`` one-turn conversations and the tokenizer has
        a pad token."""
        info = tokenizer_info(config.tokenizer)
        vocab_size, vocab_source = resolve_vocab_size(config.vocab_size, info)
        template = load_template(config.tokenizer, config.template)
        tokenizer = load_tokenizer(config.tokenizer)
        minimum = sequences * minimum_seq_length(tokenizer, template)
        if config.seq_length < minimum:
            each = "" if sequences == 1 else f", and a row holds {sequences} of them"
            raise TokenizeError(
                f"seq_length {config.seq_length} is below the minimum of {minimum} tokens for chat template "
                f"{template.name!r}: its one-turn conversation with empty messages alone takes "
                f"{minimum // sequences - 1}{each}"
            )
        if info.pad_token_id is None:
            raise TokenizeError(f"tokenizer {config.tokenizer}: no pad_token or eos_token to pad rows with")
        return cls(tokenizer, template, info, vocab_size, vocab_source)

    def worker_args(self, workers: int) -> tuple:
        """``init_worker``'s arguments."""
        return (tokenizer_state(self.tokenizer), self.template, self.vocab_size, workers > 1)

    def check_vocab(self, ids: np.ndarray, where: str, tokenizer_dir: str | Path) -> None:
        """A ``TokenizeError`` naming ``where`` when ``ids`` hold an id outside the vocabulary."""
        token = next((int(t) for t in ids if not 0 <= t < self.vocab_size), None)
        if token is not None:
            raise TokenizeError(out_of_vocab_message(where, token, self.vocab_size, self.vocab_source, tokenizer_dir))


def record_batches(
    inputs: list[Path], required: list[str], optional: list[str], batch_size: int, convert: Callable[[dict[str, Any], str], T]
) -> Iterator[tuple[Path, list[int], list[T]]]:
    """(path, rows, items) batches, ``convert(record, where)`` of each record ("where" is
    "data.jsonl: line 7"); a batch never spans two inputs."""
    for path in inputs:
        rows: list[int] = []
        items: list[T] = []
        for row, record in iter_records(path, required, optional):
            rows.append(row)
            items.append(convert(record, f"{path}: {describe_row(path, row)}"))
            if len(rows) == batch_size:
                yield path, rows, items
                rows, items = [], []
        if rows:
            yield path, rows, items


class WriteCounts(BaseModel):
    written: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0


class RowWriter:
    """The input_ids and labels datasets of ``out``, written row by row: each ``add`` is one
    item (a group of sequences that stays whole) in a row of its own, or packed with others
    into rows of at most ``seq_length`` tokens. Used as a context manager: on success the
    datasets are finalized; on an exception both are removed (with the manifest, which
    entering already removed)."""

    def __init__(self, out: str | Path, vocab_size: int, seq_length: int, pack: bool, counts: WriteCounts) -> None:
        self.out = out
        self.paths = output_paths(out)
        self.counts = counts
        self.packer: Packer[list[Sample]] | None = Packer(seq_length) if pack else None
        self.paths["manifest"].unlink(missing_ok=True)
        self.ids = IndexedDatasetWriter(self.paths["input_ids"], optimal_token_dtype(vocab_size))
        self.labels = IndexedDatasetWriter(self.paths["labels"], LABEL_DTYPE)

    def add(self, item: list[Sample]) -> None:
        length = sum(ids.size for ids, _ in item)
        self.counts.written += 1
        self.counts.tokens += length
        self.counts.trained_tokens += sum(int((labels != IGNORE_INDEX).sum()) for _, labels in item)
        for row in self.packer.add(length, item) if self.packer else [[item]]:
            self._write(row)

    def _write(self, row: list[list[Sample]]) -> None:
        sequences = [sample for item in row for sample in item]
        lengths = [ids.size for ids, _ in sequences]
        self.ids.add_document(np.concatenate([ids for ids, _ in sequences]), lengths)
        self.labels.add_document(np.concatenate([labels for _, labels in sequences]), lengths)
        self.counts.rows += 1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                for row in self.packer.flush() if self.packer else []:
                    self._write(row)
                self.ids.finalize()
                self.labels.finalize()
                return
        except BaseException:
            self._remove()
            raise
        self._remove()

    def _remove(self) -> None:
        self.ids.abort()
        self.labels.abort()
        for f in dataset_files(self.out):
            f.unlink(missing_ok=True)


def finish_stage(config: Any, stage: str, encoder: ChatEncoder, counts: WriteCounts, started: float, unit: str, total: int) -> None:
    """Write the manifest of a finished chat-data stage (its datasets written), last, and log
    the counts: ``total`` items (``unit``: "samples", "pairs") read."""
    seconds = time.perf_counter() - started
    stats = {
        **counts.model_dump(),
        "packing_efficiency": counts.tokens / (counts.rows * config.seq_length),
        "seq_length": config.seq_length,
        "pack": config.pack,
        "template": encoder.template.name,
        "template_sha256": encoder.template.digest,
        "pad_id": encoder.info.pad_token_id,
        "ignore_index": IGNORE_INDEX,
        "vocab_size": encoder.vocab_size,
        "vocab_size_source": encoder.vocab_source,
        "seconds": round(seconds, 3),
        "data_prefix": str(config.out),
    }
    write_prefix_manifest(output_paths(config.out)["manifest"], dataset_files(config.out), stage, config.model_dump(mode="json"), **stats)
    if counts.dropped_overlong or counts.truncated:
        log.warning(
            "%d of %d %s were longer than seq_length %d: %d dropped, %d truncated",
            counts.dropped_overlong + counts.truncated, total, unit, config.seq_length,
            counts.dropped_overlong, counts.truncated,
        )
    log.info(
        "wrote %s: %d %s in %d rows, %d tokens (%d trained), %.1f s",
        config.out, counts.written, unit, counts.rows, counts.tokens, counts.trained_tokens, seconds,
    )


# --- the stage ------------------------------------------------------------------------------------


class _Counts(WriteCounts):
    samples: int = 0


def tokenize_instruction(config: InstructionTokenizeConfig) -> Path:
    """Tokenize ``config.input`` into the input_ids/labels datasets + manifest; returns ``out``."""
    started = time.perf_counter()

    # Everything that can be checked is checked before any output is touched.
    keys = resolve_keys(config.format, config.map_keys)
    encoder = ChatEncoder.load(config)
    required, optional = record_columns(config.format, keys)

    def convert(record: dict[str, Any], where: str) -> list[Message]:
        return to_messages(config.format, record, keys, where)

    for path in config.input:
        validate_input(path, required)
        _, _, (messages,) = next(record_batches([path], required, optional, 1, convert))
        encoder.template.segments(messages)

    counts = _Counts()
    with RowWriter(config.out, encoder.vocab_size, config.seq_length, config.pack, counts) as writer:
        batches = record_batches(config.input, required, optional, config.batch_size, convert)
        encoded = ordered_map(_encode_batch, batches, config.workers, init_worker, encoder.worker_args(config.workers), key=lambda b: b[2])
        for (path, rows, _), (samples, bad) in encoded:
            if bad >= 0:
                encoder.check_vocab(samples[bad][0], f"{path}: {describe_row(path, rows[bad])}", config.tokenizer)
            for ids, labels in samples:
                counts.samples += 1
                sample = _fit(ids, labels, config, counts)
                if sample is not None:
                    writer.add([sample])
        if counts.written == 0:
            raise InputError(
                f"no sample fits seq_length {config.seq_length}: all {counts.samples} are longer "
                "(raise --seq-length, or pass --overlong truncate)"
            )

    finish_stage(config, STAGE, encoder, counts, started, "samples", counts.samples)
    return Path(config.out)


def _fit(ids: np.ndarray, labels: np.ndarray, config: InstructionTokenizeConfig, counts: _Counts):
    """The sample cut to ``seq_length`` as ``overlong`` says, or None when it is dropped."""
    if ids.size <= config.seq_length:
        return ids, labels
    if config.overlong == "truncate":
        ids, labels = ids[: config.seq_length], labels[: config.seq_length]
        if (labels != IGNORE_INDEX).any():
            counts.truncated += 1
            return ids, labels
    counts.dropped_overlong += 1
    return None


class InstructionCommand(InstructionTokenizeConfig):
    """Tokenize instruction data into input_ids/labels indexed datasets ({out}_packed_*_document)."""

    def cli_cmd(self) -> None:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        out = tokenize_instruction(InstructionTokenizeConfig(**self.model_dump()))
        print(out)
