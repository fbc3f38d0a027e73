"""Rollouts inside the training job: the policy's own (sharded) weights sample the completions
with the KV cache, no second copy of the model.

Every completion draws its tokens from uniforms of its own, seeded by the run's seed, the
generation and the completion's index in the generation batch: what a completion samples does
not depend on which rank generates it, beside which others, or whether the run was resumed
(inverse-CDF sampling of each row's filtered distribution). The sampler records each token's
log-prob under the policy's distribution at ``temperature`` before top-k/top-p filtering, the
distribution the loss scores (TRL's).

Every rank takes the same number of decoding steps (until no rank has a row still going):
the sharded model's collectives (FSDP's gathers, expert parallelism's all-to-alls) run on
every rank of their groups at each step.

Under tensor parallelism the training plan shards the residual stream along the sequence,
so every forward must hold a multiple of tp positions (``sequence_multiple``): the prompts
are left-padded to one, and each decoding step feeds the new token followed by tp - 1
copies of it, reads the logits of the first and takes the copies back out of the KV cache.
Causal attention keeps the copies out of the real token's logits, and the next step
overwrites their cache positions; each rank's share of the work is still one token's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmflow.models.decoder import CausalLM
from llmflow.models.kv_cache import KVCache
from llmflow.models.sampling import filter_top_k_top_p, left_pad


@dataclass(frozen=True)
class SamplerSettings:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    """The model's real vocabulary (padded rows of the output projection are never sampled)."""


@dataclass
class Completions:
    """Sampled completions of a batch of prompts."""

    tokens: list[list[int]]
    """Each completion's ids (an ending eos id included)."""
    logps: list[list[float]]
    """The sampler's log-prob of each of those tokens."""
    truncated: list[bool]
    """Cut at max_new_tokens without an eos."""


def completion_uniforms(seeds: list[int], length: int) -> torch.Tensor:
    """[B, length] uniforms in [0, 1), row b from a generator seeded with ``seeds[b]``."""
    return torch.stack([torch.rand(length, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                        for s in seeds])


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row [B] of ``probs`` [B, V] whose cumulative probability first exceeds
    ``uniforms`` [B] times the row's total (a zero-probability token is never picked)."""
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return picked.clamp(max=probs.shape[1] - 1)


def _any_running(running: bool, device: torch.device) -> bool:
    """Whether any rank still has a row to generate (every rank takes the same steps)."""
    flag = torch.tensor(float(running), device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@torch.no_grad()
def sample(model: CausalLM, prompts: list[list[int]], seeds: list[int], settings: SamplerSettings,
           sequence_multiple: int = 1) -> Completions:
    """Sample one completion of each prompt (``seeds``: each one's sampling seed), every
    forward over a multiple of ``sequence_multiple`` positions (the tensor-parallel size).
    Collective: every rank of the run calls it the same number of times."""
    device = next(model.parameters()).device
    rows = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    done = [False] * rows
    uniforms = completion_uniforms(seeds, settings.max_new_tokens)
    copies = sequence_multiple - 1
    ids, positions, documents = left_pad(prompts, settings.max_new_tokens + copies, sequence_multiple)
    step_input, positions = ids.to(device), positions.to(device)
    documents = documents.to(device) if documents is not None else None
    cache = KVCache(positions.shape[1])
    for t in range(settings.max_new_tokens):
        if not _any_running(not all(done), device):
            break
        span = slice(cache.filled, cache.filled + step_input.shape[1])
        logits = model(step_input, position_ids=positions[:, span],
                       document_ids=documents[:, span] if documents is not None else None,
                       kv_cache=cache, logits_to_keep=sequence_multiple)
        if t:  # a decoding step: the new token's logits, its copies out of the cache
            logits, cache.filled = logits[:, 0], cache.filled - copies
        else:
            logits = logits[:, -1]
        logits = logits[:, :settings.vocab_size].float()
        scaled = logits / settings.temperature
        log_probs = F.log_softmax(scaled, dim=-1)
        probs = filter_top_k_top_p(scaled, settings.top_k, settings.top_p).softmax(dim=-1)
        chosen = inverse_cdf(probs, uniforms[:, t])
        chosen_logps = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        for i, (token, logp) in enumerate(zip(chosen.tolist(), chosen_logps, strict=True)):
            if done[i]:
                continue
            tokens[i].append(token)
            logps[i].append(logp)
            done[i] = token in settings.eos_token_ids
        step_input = chosen.unsqueeze(1).expand(-1, sequence_multiple)
    truncated = [not (row and row[-1] in settings.eos_token_ids) for row in tokens]
    return Completions(tokens, logps, truncated)
