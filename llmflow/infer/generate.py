"""Batched text generation with a KV cache: greedy or sampled, with stop tokens, stop
strings and streamed text.

Prompts of different lengths are left-padded. Pad positions form a document of their own
(they never enter a real token's attention) and every row's positions start at 0 at its
first real token, so a batched row generates exactly what it generates alone.

A row stops at an eos token, at ``max_new_tokens`` or once its text holds a stop string (found
in a window of its last tokens, not by decoding its whole text each step); in greedy decoding
a finished row leaves the batch (its cache rows dropped), so a long generation's last rows do
not carry the finished ones, except with the compiled decode step (``decode_step.py``), whose
shapes stay fixed.

Under tensor parallelism every rank of the group runs the same generation; the tokens rank
0 of the group picks are broadcast each step, so the ranks feed the same tokens and stop at
the same step even where their logits differ in the last bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from llmflow.infer.decode_step import DecodeMode, compiles, decode, last_logits, new_cache
from llmflow.models.decoder import CausalLM
from llmflow.models.sampling import filter_top_k_top_p, left_pad

FinishReason = Literal["eos", "stop", "length"]


class GenerateConfig(BaseModel):
    """How to continue the prompts."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    max_new_tokens: int = Field(default=128, ge=1)
    """Most tokens generated per prompt."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 picks the most likely token (greedy decoding)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(default=0, ge=0)
    """Sample from the k most likely tokens only; 0 keeps all."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """Divide positive (multiply negative) logits of tokens already in the prompt or output
    by this (CTRL's penalty, as transformers applies it); 1 turns it off."""
    seed: int = 0
    """Seed of the sampling generator: the same seed gives the same samples."""
    eos_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a row's generation (kept as its last token); the generate and chat
    commands use the model's (generation_config.json, else its tokenizer's eos) when empty."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a row's generation; the text stops before the first one."""
    decode: DecodeMode = "auto"
    """The decode step: "compiled" runs it through torch.compile over a static KV cache (CUDA
    graphs on CUDA), "eager" over a growing one; "auto" compiles on CUDA for a whole model
    without linear-attention layers. Greedy tokens are the same either way in fp32."""


class GenerationResult(BaseModel):
    """One prompt's continuation."""

    prompt_tokens: list[int]
    """The prompt's token ids."""
    tokens: list[int]
    """Generated token ids (an ending eos id included)."""
    text: str
    """Generated text (special tokens skipped, cut before a stop string)."""
    finish_reason: FinishReason
    """eos: an eos token; stop: a stop string; length: max_new_tokens reached."""


@dataclass(frozen=True)
class TextDelta:
    """New text of one row, and that row's result once it has finished."""

    row: int
    text: str
    result: GenerationResult | None = None


@dataclass
class _Row:
    """Decoding state of one prompt."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    emitted: str = ""
    finish_reason: FinishReason | None = None


def encode_prompts(tokenizer, prompts: list[str] | list[list[int]], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each prompt (lists of ids pass through)."""
    return [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=add_special_tokens).ids for p in prompts]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor on logits [B, V] with ``seen`` [B, V]
    marking tokens already present."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def next_tokens(
    logits: torch.Tensor, seen: torch.Tensor, config: GenerateConfig, generator: torch.Generator
) -> torch.Tensor:
    """The next token of each row [B] from the last logits [B, V]."""
    logits = logits.float()
    if config.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, config.repetition_penalty)
    if config.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = filter_top_k_top_p(logits / config.temperature, config.top_k, config.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)


def safe_text(text: str, stop: list[str]) -> str:
    """The part of ``text`` that can be shown now: not ending in an incomplete UTF-8
    character (decoded as U+FFFD) nor in what may be the start of a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stop:
        for n in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:n]):
                end -= n
                break
    return text[:end]


def _row_text(tokenizer, row: _Row, stop: list[str]) -> tuple[str, bool]:
    """The row's text so far (cut before a stop string) and whether a stop string occurred."""
    text = tokenizer.decode(row.tokens, skip_special_tokens=True)
    cuts = [i for s in stop if (i := text.find(s)) >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def stop_window(stop: list[str]) -> int:
    """How many of a row's last tokens (special ones not counted) hold any stop string that its
    newest token completes: a character is at most 4 UTF-8 bytes and every token but a special
    one adds at least one byte; one more token keeps the string's first token off the window's
    start (where a decoder may drop a leading space)."""
    return 4 * max(map(len, stop)) + 2


def _stopped(tokenizer, row: _Row, stop: list[str], special: frozenset[int]) -> bool:
    """Whether the row's text holds a stop string, read from its last tokens only (its newest
    token completes any stop string not found before): a long generation decodes a window per
    step instead of its whole text. ``special``: the ids decoding skips."""
    start, counted, size = len(row.tokens), 0, stop_window(stop)
    while start > 0 and counted < size:
        start -= 1
        counted += row.tokens[start] not in special
    window = tokenizer.decode(row.tokens[start:], skip_special_tokens=True)
    return any(s and s in window for s in stop)


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (decoded as nothing without special tokens)."""
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)


def _advance(tokenizer, row: _Row, token: int, config: GenerateConfig, streaming: bool,
             special: frozenset[int] = frozenset()) -> str:
    """Append ``token`` to the row, settle its finish reason; the new text to show."""
    row.tokens.append(token)
    if token in config.eos_token_ids:
        row.finish_reason = "eos"
    elif len(row.tokens) >= config.max_new_tokens:
        row.finish_reason = "length"
    if not streaming:
        if config.stop and _stopped(tokenizer, row, config.stop, special):
            row.finish_reason = "stop"
        return ""
    text, stopped = _row_text(tokenizer, row, config.stop)
    if stopped:
        row.finish_reason = "stop"
    shown = text if row.finish_reason else safe_text(text, config.stop)
    delta, row.emitted = shown[len(row.emitted) :], shown
    return delta


def _result(tokenizer, row: _Row, stop: list[str]) -> GenerationResult:
    return GenerationResult(
        prompt_tokens=row.prompt, tokens=row.tokens, text=_row_text(tokenizer, row, stop)[0], finish_reason=row.finish_reason
    )


def stream_generate(
    model: CausalLM,
    tokenizer,
    prompts: list[str] | list[list[int]],
    config: GenerateConfig,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Iterator[TextDelta]:
    """Generate for every prompt at once, yielding each row's new text token by token (only
    complete UTF-8 text) and, with its last delta, the row's result. ``vocab_size`` cuts off
    padded vocabulary rows of the output projection. ``group``: the tensor-parallel group the
    model is sharded over (every rank of it runs this call), None for a whole model."""
    return _generate_events(model, tokenizer, prompts, config, vocab_size, group, streaming=True)


@torch.no_grad()
def _generate_events(
    model: CausalLM,
    tokenizer,
    prompts: list[str] | list[list[int]],
    config: GenerateConfig,
    vocab_size: int | None,
    group: dist.ProcessGroup | None,
    streaming: bool,
) -> Iterator[TextDelta]:
    rows = [_Row(prompt=p) for p in encode_prompts(tokenizer, prompts)]
    device = next(model.parameters()).device
    ids, positions, documents = left_pad([r.prompt for r in rows], config.max_new_tokens)
    ids, positions = ids.to(device), positions.to(device)
    documents = documents.to(device) if documents is not None else None
    vocab = vocab_size or model.config.vocab_size
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        seen[i, r.prompt] = True
    generator = torch.Generator().manual_seed(config.seed)
    special = special_ids(tokenizer)
    compiled = compiles(model, config.decode, group is not None)
    cache = new_cache(ids.shape[1] + config.max_new_tokens, device, compiled)
    written = ids.shape[1]  # positions in the cache
    logits = last_logits(model, ids, positions[:, :written], _span(documents, 0, written), cache)
    live = list(range(len(rows)))  # the rows still generating, in batch order
    for _ in range(config.max_new_tokens):
        chosen = next_tokens(logits[:, :vocab], seen, config, generator)
        if group is not None:
            dist.broadcast(chosen, group=group, group_src=0)
        seen[torch.arange(len(live), device=device), chosen] = True
        for i, token in zip(live, chosen.tolist()):
            r = rows[i]
            if r.finish_reason is not None:  # a sampled batch keeps its finished rows
                continue
            delta = _advance(tokenizer, r, token, config, streaming, special)
            result = _result(tokenizer, r, config.stop) if r.finish_reason else None
            if delta or result:
                yield TextDelta(i, delta, result)
        going = [b for b, i in enumerate(live) if rows[i].finish_reason is None]
        if not going:
            return
        if len(going) < len(live) and config.temperature == 0.0 and not compiled:
            # Finished rows leave the batch (greedy only: sampling keeps its rows so that a seed
            # draws the same random numbers whichever rows finish first; a compiled step keeps
            # its shapes).
            keep = torch.tensor(going, device=device)
            chosen, positions, seen = chosen[keep], positions[keep], seen[keep]
            documents = documents[keep] if documents is not None else None
            cache.keep(keep)
            live = [live[b] for b in going]
        logits = decode(model, chosen[:, None], positions[:, written : written + 1], _span(documents, written, 1),
                        cache)
        written += 1


def _span(documents: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    return documents[:, start : start + length] if documents is not None else None


def generate(
    model: CausalLM,
    tokenizer,
    prompts: list[str] | list[list[int]],
    config: GenerateConfig,
    on_text: Callable[[int, str], None] | None = None,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[GenerationResult]:
    """Continue every prompt (text, encoded with the tokenizer's special tokens, or token
    ids); ``on_text(row, delta)`` receives the text as it is generated. ``vocab_size`` and
    ``group`` as for ``stream_generate``."""
    results: list[GenerationResult | None] = [None] * len(prompts)
    for delta in _generate_events(model, tokenizer, prompts, config, vocab_size, group, streaming=on_text is not None):
        if on_text is not None and delta.text:
            on_text(delta.row, delta.text)
        if delta.result is not None:
            results[delta.row] = delta.result
    return results
