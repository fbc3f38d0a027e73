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

The questions of one subject share their few-shot examples, so their token sequences share
a long prefix (most of a 5-shot prompt). That prefix runs once, into a KV cache, and only each
question's own tokens run on top of it (``prefix_forward.py``): the same numbers within fp32
rounding. The prefix is found on the tokens, after each context was encoded whole, so the
tokenization stays lm-evaluation-harness's.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from llmflow.data.tokenizer import load_tokenizer, tokenizer_info
from llmflow.evaluate.prefix_forward import Row, run_rows
from llmflow.models import CausalLM
from llmflow.progress import Progress, no_progress


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


def encode_requests(tokenizer, contexts: list[str], continuations: Sequence[Sequence[str]], prefix: str | None
                    ) -> list[Request]:
    """The requests of ``contexts``, each with its own ``continuations`` (``tokenizer`` is a
    ``tokenizers.Tokenizer``), each context and context + continuation encoded as
    ``encode_texts`` does."""
    pairs = [[split_whitespace(ctx, cont) for cont in conts] for ctx, conts in zip(contexts, continuations, strict=True)]
    # The context loses the same trailing whitespace whatever the continuation: encoded once.
    context_ids = encode_texts(tokenizer, [own[0][0] for own in pairs], prefix)
    whole_ids = iter(encode_texts(tokenizer, [ctx + cont for own in pairs for ctx, cont in own], prefix))
    requests = []
    for context, own in zip(context_ids, pairs):
        requests.append(Request(context, [next(whole_ids)[len(context) :] for _ in own]))
    return requests


def model_requests(tokenizer_dir: str | Path, contexts: list[str], continuations: Sequence[Sequence[str]]
                   ) -> list[Request]:
    """``encode_requests`` with the tokenizer of ``tokenizer_dir`` as transformers loads it."""
    tokenizer, info = load_tokenizer(tokenizer_dir), tokenizer_info(tokenizer_dir)
    return encode_requests(tokenizer, contexts, continuations, prefix_text(tokenizer, info.bos_token_id, info.eos_token_id))


def _fits(request: Request, max_length: int) -> bool:
    """Whether every context + continuation of ``request`` runs without left truncation."""
    return len(request.context) + max(len(c) for c in request.continuations) - 1 <= max_length


def _shared_length(contexts: list[list[int]]) -> int:
    """Length of the longest common token prefix of ``contexts``, short of the shortest one's
    last token (whose next-token distribution every score needs)."""
    if len(contexts) < 2:
        return 0
    return min(len(os.path.commonprefix(contexts)), min(len(c) for c in contexts) - 1)


def _rows(request: Request, one_pass: bool, start: int, max_length: int) -> list[Row]:
    """The rows of ``request`` after its first ``start`` context tokens (run before, shared):
    one row reading the four letters at the context's last position, or one row per
    continuation (context + continuation without its last token, the last ``max_length``)."""
    if one_pass:
        tokens = request.context[-max_length:][start:]
        return [Row(tokens, [[(len(tokens) - 1, c[0])] for c in request.continuations])]
    rows = []
    for cont in request.continuations:
        tokens = (request.context + cont)[-(max_length + 1) :][:-1][start:]
        rows.append(Row(tokens, [[(len(tokens) - len(cont) + j, token) for j, token in enumerate(cont)]]))
    return rows


def score_requests(
    model: CausalLM,
    requests: list[Request],
    batch_size: int,
    max_length: int,
    padding_side: str = "right",
    groups: Sequence[Hashable] | None = None,
    one_pass: bool = True,
    progress: Progress = no_progress,
) -> tuple[torch.Tensor, list[bool]]:
    """Scores [N, most choices] of every request (-inf past a request's own choices), and
    whether each took the one-pass path (all its continuations one token, and ``one_pass``;
    the others run each continuation in full).

    Requests with the same ``groups`` label (a subject's questions, which share their few-shot
    examples) run on top of their contexts' longest common token prefix, computed once; a
    request whose context + continuation exceeds ``max_length`` (truncated on the left, so it
    no longer starts with that prefix) and every request without a group run in full.
    ``progress`` hears how many requests have all their rows scored."""
    choices = max((len(r.continuations) for r in requests), default=0)
    fast = [one_pass and r.single_token for r in requests]
    members: dict[Hashable, list[int]] = {}
    for i, label in enumerate(groups if groups is not None else range(len(requests))):
        members.setdefault(label, []).append(i)
    jobs: list[tuple[list[int], list[int]]] = []
    alone: list[int] = []
    for indices in members.values():
        fitting = [i for i in indices if _fits(requests[i], max_length)]
        shared = _shared_length([requests[i].context for i in fitting])
        if shared:
            jobs.append((requests[fitting[0]].context[:shared], fitting))
            alone += sorted(set(indices) - set(fitting))
        else:
            alone += indices
    jobs.append(([], sorted(alone)))
    scores = torch.full((len(requests), choices), -torch.inf)
    rows_left = [1 if fast[i] else len(r.continuations) for i, r in enumerate(requests)]
    done = 0

    def scored(owners: list[int], batch: list[int]) -> None:
        nonlocal done
        for row in batch:
            rows_left[owners[row]] -= 1
            done += rows_left[owners[row]] == 0
        progress(done, len(requests))

    progress(0, len(requests))
    for prefix, indices in jobs:
        rows, owners = [], []
        for i in indices:
            made = _rows(requests[i], fast[i], len(prefix), max_length)
            rows += made
            owners += [i] * len(made)
        found: dict[int, list[float]] = {}
        for i, row_scores in zip(owners, run_rows(model, rows, batch_size, padding_side, prefix, partial(scored, owners))):
            found.setdefault(i, []).extend(row_scores)
        for i, values in found.items():
            scores[i, : len(values)] = torch.tensor(values)
    return scores, fast


def score_loglikelihood(model: CausalLM, requests: list[Request], batch_size: int, max_length: int) -> torch.Tensor:
    """Scores [N, choices]: the summed log-probability of each continuation after its
    context, every (context, continuation) pair its own sequence of at most ``max_length``
    tokens (truncated on the left), nothing shared."""
    return score_requests(model, requests, batch_size, max_length, one_pass=False)[0]
