"""Context parallelism, applied from outside the model: each rank of a "cp" mesh dimension
holds 1/cp of every sequence's positions, and each attention layer reaches the other ranks'
positions by one of two algorithms (``CP_ALGOS``).

Every layer but attention works on each token alone, so it runs on the rank's shard as it
would on the whole sequence. Attention needs every position:

- ``ulysses`` (DeepSpeed-Ulysses; MindSpeed's ulysses_cp_algo): each rank holds a contiguous
  1/cp of the sequence. ``ulysses_attention`` sends each rank's queries, keys and values of
  head group j to rank j with one all-to-all (rank j then holds head group j over the whole
  sequence, shards concatenated in rank order), attends with the usual kernel, causal and
  per-document masks and sliding window on the whole sequence, and sends each rank's
  positions back with a second all-to-all. Grouped-query attention keeps its pairing: query
  heads [j Hq/cp, (j+1) Hq/cp) read key/value heads [j Hkv/cp, (j+1) Hkv/cp); when cp does not
  divide the key/value heads, they are repeated to one per query head first. The query heads
  (per tensor-parallel rank) must divide by cp.
- ``ring`` (ring attention as ``torch.distributed.tensor.experimental.context_parallel``
  runs it with its default all-gather rotation and causal load balancing): the sequence is
  cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r, so every rank attends
  over as many keys as any other under the causal mask (torch's head-tail load balancer).
  ``ring_attention`` all-gathers the keys and values of every rank (their gradients
  reduce-scattered back in backward) and attends each of the rank's two query chunks over
  the keys up to its end, with the usual kernel and masks. Any head count works; each rank
  holds the whole sequence's keys and values of its layer while it attends.

Multi-head Latent Attention (DeepSeek-V3) goes through either as its per-head queries, keys
and values (keys and queries ``qk_nope_head_dim + qk_rope_head_dim`` wide, values
``v_head_dim``): Ulysses sends them whole, as it does grouped-query heads. Attention sinks
(gpt-oss, a logit per query head) join the softmax of each query wherever it attends: under
Ulysses each rank takes its head group's sinks, under ring every rank all of its heads'.

Both carry gradients through their collectives. The inputs of a context-parallel forward
come from ``shard_sequence``: each rank's tokens, labels and position ids, and the document
ids of the whole sequence (the attention masks are built over it). The loss of a shard is its
tokens' sum; the training step divides by the tokens of the whole sequence and sums gradients
over "cp" as it does over "dp".

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) carries a recurrent state along the sequence,
which a sequence shard cannot start from: ``context_parallel_problems`` refuses those models.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import all_gather_single_autograd, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from llmflow import kernels
from llmflow.models.blocks.attention import Attention
from llmflow.models.blocks.mla import MultiHeadLatentAttention
from llmflow.models.blocks.rotary import positions_from_documents
from llmflow.models.config import ModelConfig

CP_ALGOS = ("ulysses", "ring")
"""How attention reaches the other context-parallel ranks' positions (see the module docstring)."""


def sequence_split_problems(seq_length: int, cp: int, algo: str = "ulysses") -> list[str]:
    """Why a ``seq_length``-token sequence cannot be split over ``cp`` ranks by ``algo``
    (into cp equal shards for ulysses, 2 cp equal chunks for ring), if it cannot."""
    parts = 2 * cp if algo == "ring" else cp
    if cp > 1 and seq_length % parts:
        held = "2 chunks of seq_length/(2 cp)" if algo == "ring" else "seq_length/cp positions"
        divisor = "2*cp" if algo == "ring" else "cp"
        return [(f"seq_length={seq_length} is not divisible by {divisor}={parts}: "
                 f"each rank holds {held}; use a seq_length that is a multiple of {parts}")]
    return []


def context_parallel_problems(config: ModelConfig, cp: int, seq_length: int | None = None, tp: int = 1,
                              algo: str = "ulysses") -> list[str]:
    """Every reason context parallelism of degree ``cp`` by ``algo`` cannot split
    ``config``'s attention (Ulysses: the heads of one of ``tp`` tensor-parallel ranks) or a
    ``seq_length``-token sequence (empty when it can; the length is not checked when None)."""
    if cp == 1:
        return []
    problems = sequence_split_problems(seq_length, cp, algo) if seq_length is not None else []
    heads = config.num_attention_heads // tp
    if algo == "ulysses" and heads % cp:
        per_rank = f"num_attention_heads/tp = {config.num_attention_heads}/{tp} = {heads}" if tp > 1 else \
            f"num_attention_heads={heads}"
        problems.append(f"model {per_rank} is not divisible by cp={cp}: Ulysses gives each rank 1/cp of the "
                        "attention heads; use a cp that divides them, or cp_algo=ring")
    if "linear_attention" in config.layer_types:
        problems.append(f"cp={cp} cannot split {config.model_type}'s Gated DeltaNet layers: their recurrent state runs "
                        "along the whole sequence; train it with cp=1")
    return problems


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup, ranks: int) -> torch.Tensor:
    """[B, H, S/cp, D] (this rank's positions, every head) -> [B, H/cp, S, D] (this rank's
    head group, every position in rank order)."""
    batch, heads, local, dim = x.shape
    chunks = x.reshape(batch, ranks, heads // ranks, local, dim).transpose(0, 1).contiguous()
    arrived = all_to_all_single_autograd(chunks, None, None, group)
    # [source rank, B, H/cp, S/cp, D] -> [B, H/cp, source rank, S/cp, D]
    return arrived.view(ranks, batch, heads // ranks, local, dim).permute(1, 2, 0, 3, 4).reshape(
        batch, heads // ranks, ranks * local, dim)


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup, ranks: int) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``: [B, H/cp, S, D] -> [B, H, S/cp, D]."""
    batch, heads, seq, dim = x.shape
    local = seq // ranks
    chunks = x.reshape(batch, heads, ranks, local, dim).permute(2, 0, 1, 3, 4).contiguous()
    arrived = all_to_all_single_autograd(chunks, None, None, group)
    # [source rank (head group), B, H/cp, S/cp, D] -> [B, H, S/cp, D]
    return arrived.view(ranks, batch, heads, local, dim).transpose(0, 1).reshape(batch, ranks * heads, local, dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      document_ids: torch.Tensor | None, sliding_window: int | None, group: ProcessGroup,
                      rank: int, ranks: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.attention`` over the whole sequence of which q [B, Hq, S/cp, D] and k/v
    [B, Hkv, S/cp, D] (v's width may differ) hold this rank's positions; ``document_ids``
    [B, S] are the whole sequence's; ``sinks`` [Hq] (gpt-oss), the logit of every query head.
    Returns this rank's positions of the output, [B, Hq, S/cp, v's width]."""
    if k.shape[1] % ranks:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = (_seq_to_heads(t, group, ranks) for t in (q, k, v))
    if sinks is not None:  # this rank's head group's
        sinks = sinks.narrow(0, rank * q.shape[1], q.shape[1])
    out = kernels.attention(q, k, v, scale, document_ids, sliding_window, sinks)
    return _heads_to_seq(out, group, ranks)


class ContextParallelPlace(NamedTuple):
    """Where an attention layer ``apply_cp`` changed sits (its ``context_parallel`` attribute)."""

    group: ProcessGroup
    rank: int
    ranks: int
    algo: str
    """One of ``CP_ALGOS``."""


def ring_chunks(rank: int, ranks: int) -> tuple[int, int]:
    """The two of the sequence's 2 ``ranks`` chunks ring attention gives ``rank``."""
    return rank, 2 * ranks - 1 - rank


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   document_ids: torch.Tensor | None, sliding_window: int | None, group: ProcessGroup,
                   rank: int, ranks: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.attention`` over the whole sequence of which q [B, Hq, 2L, D] and k/v [B, Hkv,
    2L, D] (v's width may differ) hold this rank's two chunks (``ring_chunks``, L positions
    each); ``document_ids`` [B, S] are the whole sequence's; ``sinks`` [Hq] (gpt-oss), the
    logit of every query head. Returns this rank's positions of the output."""
    chunk = q.shape[2] // 2
    # [ranks, B, Hkv, 2L, Dk + Dv], rank s holding chunks s and 2 ranks - 1 - s.
    gathered = all_gather_single_autograd(torch.cat([k, v], dim=-1), 0, group).unflatten(0, (ranks, k.shape[0]))
    pieces: list[torch.Tensor | None] = [None] * (2 * ranks)
    for source in range(ranks):
        first, second = ring_chunks(source, ranks)
        pieces[first], pieces[second] = gathered[source].split(chunk, dim=-2)
    keys, values = torch.cat(pieces, dim=-2).split([k.shape[-1], v.shape[-1]], dim=-1)
    outputs = []
    for held, index in enumerate(ring_chunks(rank, ranks)):
        end = (index + 1) * chunk  # a query chunk attends to the keys up to its own end
        outputs.append(kernels.attention(q[:, :, held * chunk:(held + 1) * chunk], keys[:, :, :end], values[:, :, :end],
                                         scale, document_ids[:, :end] if document_ids is not None else None,
                                         sliding_window, sinks))
    return torch.cat(outputs, dim=2)


def _ulysses_core_attention(self: Attention | MultiHeadLatentAttention, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    place = self.context_parallel
    return ulysses_attention(q, k, v, self.scale, document_ids, self.sliding_window, place.group, place.rank,
                             place.ranks, self.local_sinks())


def _ring_core_attention(self: Attention | MultiHeadLatentAttention, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    place = self.context_parallel
    return ring_attention(q, k, v, self.scale, document_ids, self.sliding_window, place.group, place.rank,
                          place.ranks, self.local_sinks())


def apply_cp(model: nn.Module, mesh: DeviceMesh, algo: str = "ulysses") -> None:
    """Make every attention layer of ``model`` attend over the whole sequence split over the
    ranks of ``mesh`` by ``algo`` (``CP_ALGOS``). The model must pass ``context_parallel_problems``."""
    core = {"ulysses": _ulysses_core_attention, "ring": _ring_core_attention}[algo]
    for module in model.modules():
        if isinstance(module, (Attention, MultiHeadLatentAttention)):
            module.context_parallel = ContextParallelPlace(mesh.get_group(), mesh.get_local_rank(), mesh.size(), algo)
            module.core_attention = types.MethodType(core, module)


def held_positions(seq: int, rank: int, ranks: int, algo: str = "ulysses",
                   device: torch.device | str | None = None) -> torch.Tensor:
    """The positions of a ``seq``-token sequence that context-parallel ``rank`` of ``ranks``
    holds: a contiguous 1/ranks for ulysses, its two ``ring_chunks`` for ring."""
    if algo == "ring":
        chunk = seq // (2 * ranks)
        return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in ring_chunks(rank, ranks)])
    local = seq // ranks
    return torch.arange(rank * local, (rank + 1) * local, device=device)


def shard_sequence(input_ids: torch.Tensor, labels: torch.Tensor | None, position_ids: torch.Tensor | None,
                   document_ids: torch.Tensor | None, rank: int, ranks: int,
                   algo: str = "ulysses") -> dict[str, torch.Tensor | None]:
    """This rank's inputs of a context-parallel forward (``CausalLM``'s keyword arguments):
    its part of ``input_ids``, ``labels`` and ``position_ids`` [B, S] (None: each token's
    position, restarting at each packed document) — a contiguous 1/cp for ulysses, its two
    ``ring_chunks`` for ring — and the whole sequence's document ids. With ``ranks`` 1, the
    inputs themselves."""
    seq = input_ids.shape[1]
    if position_ids is None:
        position_ids = (positions_from_documents(document_ids) if document_ids is not None
                        else torch.arange(seq, device=input_ids.device).expand_as(input_ids))
    if ranks == 1:
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": document_ids}
    held = held_positions(seq, rank, ranks, algo, input_ids.device)
    return {"input_ids": input_ids[:, held], "labels": labels[:, held] if labels is not None else None,
            "position_ids": position_ids[:, held], "document_ids": document_ids}
