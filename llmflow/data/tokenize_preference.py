"""Preference tokenization: chosen/rejected pairs -> input_ids and labels indexed datasets.

Each record (see ``llmflow.data.conversations`` for the ``pairwise``, ``alpaca`` and
``sharegpt`` preference layouts) becomes a pair: a prompt conversation and two assistant
responses. Each side is rendered exactly as the instruction tokenizer renders a
conversation (``llmflow.data.tokenize_instruction``: the same chat templates, the rendered
text encoded whole with no special tokens added, so the ids are ``apply_chat_template``'s
of the prompt followed by the response): the chosen sequence is prompt + chosen response,
the rejected one prompt + rejected response. Labels are -100 on the prompt (earlier
assistant turns of a multi-turn prompt included); the response and the end-of-turn text
the template closes it with are trained.

Output, in the instruction dataset's files (``output_paths``), written by its writer:

- ``{out}_packed_input_ids_document.bin/.idx`` and ``{out}_packed_labels_document.bin/.idx``:
  every pair is two consecutive sequences, chosen then rejected; every document (a training
  row) holds one pair or, with ``pack``, several whole pairs back to back whose lengths sum
  to at most ``seq_length``. A row's sequence k is document k of the row
  (``llmflow.data.preference_dataset``): pair j's chosen sequence is 2j, its rejected 2j+1;
- ``{out}.manifest.json`` last (stage ``tokenize-preference``): counts, template,
  seq_length, pad id.

A pair longer than ``seq_length`` (both sequences together) is dropped or, with ``overlong``
truncate, its responses are cut at the end (the longer first, each keeping at least one
token) so that it fits with its prompt whole; a pair whose two prompts leave no room for
one response token each is dropped. Either way it is counted. Every written sequence has at
least one trained token after its first position (so at least one next-token target):
trainers tell padding from a sequence by that.

Every record is read and checked (layout, roles, empty responses, chosen equal to rejected)
before any output is touched: a bad row is an ``InputError`` naming the file and the row.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import CliVariadicArg

from llmflow.artifacts import read_manifest
from llmflow.data.conversations import Message, Pair, PreferenceFormat, record_columns, resolve_keys, to_pair
from llmflow.data.parallel import ordered_map
from llmflow.data.readers import InputError, describe_row, validate_input
from llmflow.data.templates import ChatTemplate
from llmflow.data.tokenize_instruction import (
    IGNORE_INDEX,
    ChatEncoder,
    RowWriter,
    Sample,
    TemplateName,
    WriteCounts,
    encode_segments,
    finish_stage,
    init_worker,
    out_of_vocab,
    record_batches,
    worker_encoder,
)
from llmflow.data.tokenizer import TokenizeError

STAGE = "tokenize-preference"


class PreferenceTokenizeConfig(BaseModel):
    """Tokenize preference pairs (pairwise, alpaca, sharegpt) into input_ids and labels datasets."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    input: CliVariadicArg[list[Path]] = Field(min_length=1)
    """Input files, read in order: .parquet, .jsonl, .json (array or lines), .csv (text
    columns only), or a datasets save_to_disk directory."""
    tokenizer: Path
    """Hugging Face tokenizer or model directory, encoded as transformers' AutoTokenizer loads
    it (tokenizer.json or tokenizer.model, tokenizer_config.json with the chat template; a
    config.json there gives the model type and the model's vocab_size)."""
    out: Path
    """Output prefix: writes {out}_packed_input_ids_document.bin/.idx,
    {out}_packed_labels_document.bin/.idx and {out}.manifest.json."""
    format: PreferenceFormat
    """Record layout: pairwise (TRL's prompt/chosen/rejected, as text or role/content
    messages, or chosen/rejected conversations sharing an implicit prompt), alpaca
    (instruction/input/chosen/rejected[/system/history]) or sharegpt (conversations of
    from/value ending with a human turn, chosen and rejected one from/value message each)."""
    seq_length: int = Field(ge=1)
    """Tokens per training row, which holds a pair's chosen and rejected sequences: longer
    pairs are dropped or truncated (--overlong); with --pack, the length of every packed row."""
    map_keys: dict[str, str] = {}
    """Rename the format's keys, as JSON: {"prompt": "question", "chosen": "good"}; inner
    keys too ({"role": "speaker", "content": "text"}, or sharegpt's {"from": ..., "value": ...})."""
    template: TemplateName | None = None
    """Chat template: the tokenizer's own (default when it has one) or a named one."""
    pack: bool = False
    """Pack several whole pairs into each row of seq_length tokens (attention and positions
    stay within each sequence; a pair is never split)."""
    overlong: Literal["drop", "truncate"] = "drop"
    """Pairs longer than seq_length: drop them, or cut the ends of their responses (the
    longer first, each keeping a token) so that the pair fits with its prompt (a pair whose
    prompts leave no room is dropped). Either way the count is reported."""
    vocab_size: int | None = Field(default=None, ge=1)
    """The model's vocabulary size; every id must be below it. Default: config.json in the
    tokenizer directory, else the tokenizer's length."""
    workers: int = Field(default=1, ge=1)
    """Tokenizer processes (1: in this process)."""
    batch_size: int = Field(default=256, ge=1)
    """Pairs per tokenizer batch."""


# --- encoding (runs in worker processes) ----------------------------------------------------------


def pair_segments(template: ChatTemplate, prompt: list[Message], response: Message) -> list[tuple[str, bool]]:
    """The prompt and one response rendered as one conversation (the template's
    ``segments``): everything before the response untrained, the response with its
    end-of-turn text trained."""
    pieces = template.segments([*prompt, response])
    return [("".join(text for text, _ in pieces[:-1]), False), pieces[-1]]


def encode_pairs(tokenizer, template: ChatTemplate, pairs: list[Pair]) -> list[tuple[Sample, Sample]]:
    """(chosen, rejected) (input_ids, labels) of each pair."""
    pieces = [pair_segments(template, pair.prompt, response) for pair in pairs for response in (pair.chosen, pair.rejected)]
    samples = encode_segments(tokenizer, pieces)
    return list(zip(samples[0::2], samples[1::2]))


def _encode_batch(pairs: list[Pair]) -> tuple[list[tuple[Sample, Sample]], int]:
    """Encoded pairs and the index of the first one holding an id outside the model
    vocabulary (-1 when none does)."""
    tokenizer, template, vocab_size = worker_encoder()
    encoded = encode_pairs(tokenizer, template, pairs)
    bad = out_of_vocab([sample for pair in encoded for sample in pair], vocab_size)
    return encoded, bad // 2 if bad >= 0 else -1


# --- the stage ------------------------------------------------------------------------------------


class _Counts(WriteCounts):
    pairs: int = 0


def tokenize_preference(config: PreferenceTokenizeConfig) -> dict[str, Any]:
    """Tokenize ``config.input`` into the input_ids/labels datasets + manifest; returns the manifest."""
    started = time.perf_counter()

    # Everything that can be checked is checked before any output is touched: every record.
    keys = resolve_keys(config.format, config.map_keys, preference=True)
    encoder = ChatEncoder.load(config, sequences=2)
    required, optional = record_columns(config.format, keys, preference=True)

    def convert(record: dict[str, Any], where: str) -> Pair:
        return to_pair(config.format, record, keys, where)

    for path in config.input:
        validate_input(path, required)
    first: Pair | None = None
    for _, _, pairs in record_batches(config.input, required, optional, config.batch_size, convert):
        first = first or pairs[0]
    assert first is not None  # validate_input found a record
    pair_segments(encoder.template, first.prompt, first.chosen)

    counts = _Counts()
    with RowWriter(config.out, encoder.vocab_size, config.seq_length, config.pack, counts) as writer:
        batches = record_batches(config.input, required, optional, config.batch_size, convert)
        encoded = ordered_map(_encode_batch, batches, config.workers, init_worker, encoder.worker_args(config.workers), key=lambda b: b[2])
        for (path, rows, _), (pairs, bad) in encoded:
            if bad >= 0:
                ids = np.concatenate([pairs[bad][0][0], pairs[bad][1][0]])
                encoder.check_vocab(ids, f"{path}: {describe_row(path, rows[bad])}", config.tokenizer)
            for row, (chosen, rejected) in zip(rows, pairs):
                counts.pairs += 1
                _check_encoded(chosen, rejected, f"{path}: {describe_row(path, row)}")
                fitted = _fit(chosen, rejected, config, counts)
                if fitted is not None:
                    writer.add(fitted)
        if counts.written == 0:
            raise InputError(
                f"no pair fits seq_length {config.seq_length}: all {counts.pairs} are longer "
                "(raise --seq-length, or pass --overlong truncate)"
            )

    finish_stage(config, STAGE, encoder, counts, started, "pairs", counts.pairs)
    manifest = read_manifest(config.out)
    assert manifest is not None
    return manifest


def _check_encoded(chosen: Sample, rejected: Sample, where: str) -> None:
    for name, (_, labels) in (("chosen", chosen), ("rejected", rejected)):
        if not (labels[1:] != IGNORE_INDEX).any():
            raise TokenizeError(f"{where}: the {name} sequence has no response token after its first position, so nothing to train on")
    if np.array_equal(chosen[0], rejected[0]):
        raise InputError(f"{where}: chosen and rejected encode to the same tokens, so there is no preference to learn")


def _response_start(labels: np.ndarray) -> int:
    """Where a sequence's response starts: its first trained token (at least position 1, so
    that a kept response token is a next-token target)."""
    return max(int(np.argmax(labels != IGNORE_INDEX)), 1)


def _share(budget: int, chosen: int, rejected: int) -> tuple[int, int]:
    """Response tokens to keep, at least one each and at most ``budget`` (>= 2) together: a
    response that takes at most half the budget stays whole, the other gets the rest; two
    longer responses get half each (the chosen one the odd token)."""
    half = budget // 2
    if chosen <= half:
        return chosen, min(rejected, budget - chosen)
    if rejected <= half:
        return min(chosen, budget - rejected), rejected
    return budget - half, half


def _fit(chosen: Sample, rejected: Sample, config: PreferenceTokenizeConfig, counts: _Counts) -> list[Sample] | None:
    """The pair cut to ``seq_length`` as ``overlong`` says, or None when it is dropped."""
    if chosen[0].size + rejected[0].size <= config.seq_length:
        return [chosen, rejected]
    if config.overlong == "truncate":
        starts = [_response_start(labels) for _, labels in (chosen, rejected)]
        budget = config.seq_length - sum(starts)
        if budget >= 2:
            keep = _share(budget, chosen[0].size - starts[0], rejected[0].size - starts[1])
            counts.truncated += 1
            return [(ids[: s + k], labels[: s + k]) for (ids, labels), s, k in zip((chosen, rejected), starts, keep)]
    counts.dropped_overlong += 1
    return None


class PreferenceCommand(PreferenceTokenizeConfig):
    """Tokenize preference pairs into input_ids/labels indexed datasets ({out}_packed_*_document)."""

    def cli_cmd(self) -> None:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        manifest = tokenize_preference(PreferenceTokenizeConfig(**self.model_dump()))
        print(manifest["data_prefix"])
