"""Batched scoring forward passes, optionally on top of a shared prompt prefix.

A ``Row`` is one sequence to run and the log-probabilities to read from it. Rows that share
a token prefix run as: the prefix once (batch of one) into a ``KVCache``, then each batch of
rows' own tokens on a copy of that cache, at the positions after the prefix. The numbers
are those of running every row in full (the same keys, values and positions; only the
matrix shapes differ, so fp32 rounding does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmflow.models import CausalLM
from llmflow.models.kv_cache import KVCache


@dataclass(frozen=True)
class Row:
    """One sequence to run and the scores it yields."""

    tokens: list[int]
    """Its tokens after the shared prefix (all of them when there is none)."""
    targets: list[list[tuple[int, int]]]
    """Per score, the (index into ``tokens``, next token) pairs whose log-probabilities it sums."""


def batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _pad(
    sequences: list[list[int]], padding_side: str, start: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """Token ids [B, S] padded with 0, their positions (from ``start``, skipping left padding),
    document ids that keep left padding apart (None for right padding), and each row's offset."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    documents = torch.ones(len(sequences), width, dtype=torch.long)
    offsets = [width - len(s) if padding_side == "left" else 0 for s in sequences]
    for row, (seq, offset) in enumerate(zip(sequences, offsets)):
        ids[row, offset : offset + len(seq)] = torch.tensor(seq)
        documents[row, :offset] = 0
    columns = torch.arange(width)[None, :] - torch.tensor(offsets)[:, None]
    positions = start + columns.clamp(min=0)
    return ids.to(device), positions.to(device), documents.to(device) if padding_side == "left" else None, offsets


def log_probs(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities (fp32) over the model's own vocabulary (padding rows left out)."""
    logits = model.lm_head(hidden).float()
    real = model.config.unpadded_vocab_size
    return torch.log_softmax(logits if real is None else logits[..., :real], dim=-1)


def _prefix_cache(model: CausalLM, prefix: list[int], padding_side: str) -> KVCache:
    device = next(model.parameters()).device
    cache = KVCache(len(prefix))
    ids = torch.tensor([prefix], device=device)
    documents = torch.ones_like(ids) if padding_side == "left" else None
    model.model(ids, None, documents, cache)
    return cache


@torch.no_grad()
def run_rows(
    model: CausalLM, rows: list[Row], batch_size: int, padding_side: str = "right", prefix: list[int] | None = None,
    on_batch: Callable[[list[int]], None] | None = None,
) -> list[list[float]]:
    """Each row's scores, rows run in batches of ``batch_size`` after ``prefix`` (computed once);
    ``on_batch`` is called with the indices of each batch's rows once they are scored."""
    device = next(model.parameters()).device
    prefix = prefix or []
    shared = _prefix_cache(model, prefix, padding_side) if prefix else None
    results: list[list[float]] = [[] for _ in rows]
    for batch in batches([len(r.tokens) for r in rows], batch_size):
        ids, positions, documents, offsets = _pad([rows[i].tokens for i in batch], padding_side, len(prefix), device)
        cache = shared.repeat(len(batch), len(prefix) + ids.shape[1]) if shared is not None else None
        hidden = model.model(ids, positions, documents, cache)
        # Each (row, column) read once, however many targets read it (the four letters share one).
        places: dict[tuple[int, int], int] = {}
        for j, i in enumerate(batch):
            for score in rows[i].targets:
                for index, _ in score:
                    places.setdefault((j, offsets[j] + index), len(places))
        where = torch.tensor(list(places), device=device)
        read = log_probs(model, hidden[where[:, 0], where[:, 1]]).cpu()
        for j, i in enumerate(batch):
            results[i] = [
                sum(read[places[(j, offsets[j] + index)], token].item() for index, token in score)
                for score in rows[i].targets
            ]
        if on_batch is not None:
            on_batch(batch)
    return results
