"""Log-likelihood scoring of multiple-choice continuations, as lm-evaluation-harness does it.

Each question is a context and four continuations. They are tokenized as lm-evaluation-harness's
``hf`` backend tokenizes them: trailing whitespace of the context moves to the continuation,
texts are encoded with the tokenizer's default special tokens (so a context starts with BOS
for Llama 2/3, Mistral and every tokenizer that adds one), and the continuation's tokens are
those of context + continuation past the context's own tokens. A choice's score is the summed
log-probability of its continuation tokens.

When every continuation of a question is one token, all four scores come from one forward
pass over the context (the next-token distribution at its last position); otherwise each
continuation is run in full. Both give the same numbers; the first is four times cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llmflow.data.tokenizer import load_tokenizer, tokenizer_info
from llmflow.models import CausalLM


@dataclass(frozen=True)
class Request:
    """One question: the context tokens and the tokens of each continuation."""

    context: list[int]
    continuations: list[list[int]]

    @property
    def single_token(self) -> bool:
        """Whether every continuation is exactly one token."""
        return all(len(c) == 1 for c in self.continuations)


def split_whitespace(context: str, continuation: str) -> tuple[str, str]:
    """Trailing whitespace of ``context`` moved to the front of ``continuation``."""
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + continuation


def prefix_text(tokenizer, bos_token_id: int | None, eos_token_id: int | None) -> str | None:
    """The text of lm-evaluation-harness's prefix token (BOS, else EOS): a string that starts
    with it is encoded without the tokenizer's special tokens."""
    token = bos_token_id if bos_token_id is not None else eos_token_id
    return tokenizer.decode([token], skip_special_tokens=False) if token is not None else None


def encode_texts(tokenizer, texts: list[str], prefix: str | None) -> list[list[int]]:
    """Ids of each text as lm-evaluation-harness's hf backend encodes it (``tok_encode``): with
    the tokenizer's default special tokens (its BOS for Llama- and Mistral-style tokenizers),
    except for a text that already starts with ``prefix``."""
    adds = [not (prefix and text.startswith(prefix)) for text in texts]
    ids: list[list[int]] = [[] for _ in texts]
    for add in (True, False):
        rows = [i for i, a in enumerate(adds) if a is add]
        for i, encoding in zip(rows, tokenizer.encode_batch([texts[i] for i in rows], add_special_tokens=add)):
            ids[i] = encoding.ids
    return ids


def encode_requests(tokenizer, contexts: list[str], continuations: tuple[str, ...], prefix: str | None) -> list[Request]:
    """The requests of ``contexts`` x ``continuations`` (``tokenizer`` is a ``tokenizers.Tokenizer``),
    each context and context + continuation encoded as ``encode_texts`` does."""
    pairs = [split_whitespace(ctx, cont) for ctx in contexts for cont in continuations]
    context_ids = encode_texts(tokenizer, [ctx for ctx, _ in pairs], prefix)
    whole_ids = encode_texts(tokenizer, [ctx + cont for ctx, cont in pairs], prefix)
    n = len(continuations)
    requests = []
    for i in range(len(contexts)):
        rows = range(i * n, (i + 1) * n)
        conts = [whole_ids[r][len(context_ids[r]) :] for r in rows]
        requests.append(Request(context_ids[i * n], conts))
    return requests


def model_requests(tokenizer_dir: str | Path, contexts: list[str], continuations: tuple[str, ...]) -> list[Request]:
    """``encode_requests`` with the tokenizer of ``tokenizer_dir`` as transformers loads it."""
    tokenizer, info = load_tokenizer(tokenizer_dir), tokenizer_info(tokenizer_dir)
    return encode_requests(tokenizer, contexts, continuations, prefix_text(tokenizer, info.bos_token_id, info.eos_token_id))


def _batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _pad(sequences: list[list[int]], padding_side: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B, S] padded with 0, and (left padding) document ids that keep the padding apart."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    documents = torch.ones(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if padding_side == "left":
            ids[row, width - len(seq) :] = torch.tensor(seq)
            documents[row, : width - len(seq)] = 0
        else:
            ids[row, : len(seq)] = torch.tensor(seq)
    return ids.to(device), documents.to(device) if padding_side == "left" else None


def _hidden(model: CausalLM, sequences: list[list[int]], padding_side: str) -> tuple[torch.Tensor, list[int]]:
    """Final hidden states [B, S, H] and, per row, the index of its first real position."""
    device = next(model.parameters()).device
    ids, documents = _pad(sequences, padding_side, device)
    width = ids.shape[1]
    offsets = [width - len(s) if padding_side == "left" else 0 for s in sequences]
    return model.model(ids, document_ids=documents), offsets


def _log_probs(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model.lm_head(hidden).float(), dim=-1)


@torch.no_grad()
def score_single_token(
    model: CausalLM, requests: list[Request], batch_size: int, max_length: int, padding_side: str = "right"
) -> torch.Tensor:
    """Scores [N, choices] of requests whose continuations are one token each, one forward
    pass per question over its context (the last ``max_length`` tokens)."""
    scores = torch.empty(len(requests), len(requests[0].continuations)) if requests else torch.empty(0, 4)
    contexts = [r.context[-max_length:] for r in requests]
    for batch in _batches([len(c) for c in contexts], batch_size):
        hidden, offsets = _hidden(model, [contexts[i] for i in batch], padding_side)
        last = torch.tensor([offsets[j] + len(contexts[i]) - 1 for j, i in enumerate(batch)], device=hidden.device)
        log_probs = _log_probs(model, hidden[torch.arange(len(batch), device=hidden.device), last])
        targets = torch.tensor([[c[0] for c in requests[i].continuations] for i in batch], device=hidden.device)
        scores[batch] = log_probs.gather(1, targets).cpu()
    return scores


@torch.no_grad()
def score_loglikelihood(model: CausalLM, requests: list[Request], batch_size: int, max_length: int) -> torch.Tensor:
    """Scores [N, choices]: the summed log-probability of each continuation after its
    context, every (context, continuation) pair its own sequence of at most ``max_length``
    tokens (truncated on the left)."""
    choices = len(requests[0].continuations) if requests else 4
    pairs = [(r.context, c) for r in requests for c in r.continuations]
    inputs = [(ctx + cont)[-(max_length + 1) :][:-1] for ctx, cont in pairs]
    flat = torch.empty(len(pairs))
    for batch in _batches([len(x) for x in inputs], batch_size):
        hidden, _ = _hidden(model, [inputs[i] for i in batch], "right")
        for j, i in enumerate(batch):
            cont = pairs[i][1]
            end = len(inputs[i])
            log_probs = _log_probs(model, hidden[j, end - len(cont) : end])
            flat[i] = log_probs.gather(1, torch.tensor(cont, device=hidden.device)[:, None]).sum().cpu()
    return flat.view(len(requests), choices)


def score_requests(
    model: CausalLM, requests: list[Request], batch_size: int, max_length: int, padding_side: str = "right"
) -> tuple[torch.Tensor, list[bool]]:
    """Scores [N, choices] of every request, and whether each took the one-pass path."""
    fast = [r.single_token for r in requests]
    fast_idx = [i for i, f in enumerate(fast) if f]
    slow_idx = [i for i, f in enumerate(fast) if not f]
    scores = torch.empty(len(requests), len(requests[0].continuations) if requests else 4)
    if fast_idx:
        scores[fast_idx] = score_single_token(model, [requests[i] for i in fast_idx], batch_size, max_length, padding_side)
    if slow_idx:
        scores[slow_idx] = score_loglikelihood(model, [requests[i] for i in slow_idx], batch_size, max_length)
    return scores, fast
