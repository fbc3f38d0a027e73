"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5 (HF's
``linear_attn``): projections to q, k, v (with a depthwise causal convolution and SiLU over
them), the gate ``z``, the write strength ``b`` and the decay input ``a``; the gated delta
rule over L2-normalised q and k; a gated RMSNorm per value head and ``out_proj``.

Qwen3-Next fuses the projections into ``in_proj_qkvz`` and ``in_proj_ba``, grouped per key
head ([q, k, v, z] of one key head and its value heads, then the next); Qwen3.5 keeps them
apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).

Packed documents (``document_ids``) reset the convolution and the recurrent state where a
document starts. During generation the layer keeps its states in the ``KVCache``: the new
positions continue the document of the last cached position, start from zero states if
theirs differs, and positions before the first one of the cached document (left padding
after a shared prefix) pass by without touching its states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmflow import kernels
from llmflow.models.blocks.norm import GatedRMSNorm
from llmflow.models.kv_cache import KVCache


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel_size: int,
        norm_eps: float,
        *,
        fused_projections: bool = False,
    ) -> None:
        """``fused_projections``: Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba`` instead of
        Qwen3.5's four projections."""
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"{num_value_heads} value heads are not a multiple of {num_key_heads} key heads")
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.fused_projections = fused_projections
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        conv_dim = 2 * key_dim + value_dim
        # nn.Conv1d for its HF name and shape (conv1d.weight [D, 1, K]); forward runs kernels.causal_conv1d.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel_size, groups=conv_dim, bias=False,
                                padding=conv_kernel_size - 1)
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_value_heads))
        a_log = torch.empty(num_value_heads)
        self.A_log = nn.Parameter(a_log if a_log.is_meta else init_a_log(a_log))
        self.norm = GatedRMSNorm(value_head_dim, norm_eps)
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)
        self.tensor_parallel = None
        """Set by the tensor-parallel plan (``models/parallelize.py``, ``HeadGroupRows``): this
        rank's rows of ``in_proj_qkv`` and ``conv1d``, and its pieces of ``A_log``/``dt_bias``.
        Shapes are otherwise read from the tensors, so the layer runs on whatever heads it holds."""

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v concatenated [B, S, 2 Dk Hk + Dv Hv], z [B, S, Hv, Dv], b, a [B, S, Hv])."""
        batch, seq, _ = x.shape
        if not self.fused_projections:
            z = self.in_proj_z(x).view(batch, seq, -1, self.value_head_dim)
            tp = self.tensor_parallel
            qkv = self.in_proj_qkv(x) if tp is None else tp.linear(self.in_proj_qkv, x)
            return qkv, z, self.in_proj_b(x), self.in_proj_a(x)
        per_key = self.num_value_heads // self.num_key_heads
        dk, dv = self.key_head_dim, self.value_head_dim
        qkvz = self.in_proj_qkvz(x).view(batch, seq, -1, 2 * dk + 2 * per_key * dv)  # per key head
        q, k, v, z = qkvz.split([dk, dk, per_key * dv, per_key * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(batch, seq, -1, 2 * per_key).split([per_key, per_key], dim=-1)
        mixed = torch.cat([t.reshape(batch, seq, -1) for t in (q, k, v)], dim=-1)
        return (mixed, z.reshape(batch, seq, -1, dv), b.reshape(batch, seq, -1), a.reshape(batch, seq, -1))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        document_ids: torch.Tensor | None,
        cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        """x [B, S, hidden]; ``cos``/``sin`` are unused (no positions here). With ``cache``,
        ``document_ids`` are those of every cached position and then the new ones."""
        batch, seq, _ = x.shape
        mixed, z, b, a = self._project(x)
        tp = self.tensor_parallel
        weight = (self.conv1d.weight if tp is None else tp.rows(self.conv1d.weight)).squeeze(1)
        a_log, dt_bias = (self.A_log, self.dt_bias) if tp is None else (tp.local(self.A_log), tp.local(self.dt_bias))
        conv_state = recurrent_state = None
        passing = None
        if cache is not None:
            conv_state, recurrent_state = cache[0].linear_state(cache[1])
            if document_ids is not None:
                document_ids, conv_state, recurrent_state, passing = _continuation(
                    document_ids, seq, conv_state, recurrent_state)
        if passing is None:
            mixed, conv_final = kernels.causal_conv1d(mixed, weight, document_ids=document_ids, activation="silu",
                                                      state=conv_state, output_final_state=cache is not None)
        else:
            mixed, conv_final = _conv_after_passing(mixed, weight, document_ids, conv_state, passing)
        per_key = self.num_value_heads // self.num_key_heads
        # This layer's key heads: all of them, or one tensor-parallel rank's.
        key_dim = mixed.shape[-1] // (2 * self.key_head_dim + per_key * self.value_head_dim) * self.key_head_dim
        q, k, v = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
        q = q.reshape(batch, seq, -1, self.key_head_dim).repeat_interleave(per_key, dim=2)
        k = k.reshape(batch, seq, -1, self.key_head_dim).repeat_interleave(per_key, dim=2)
        v = v.reshape(batch, seq, -1, self.value_head_dim)
        beta = b.sigmoid()
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        if passing is not None:  # no decay, no write: the cached document's state passes unchanged
            beta = beta.masked_fill(passing[..., None], 0.0)
            g = g.masked_fill(passing[..., None], 0.0)
        out, recurrent_final = kernels.gated_delta_rule(
            q, k, v, g, beta, document_ids=document_ids, initial_state=recurrent_state,
            output_final_state=cache is not None, use_qk_l2norm=True)
        if cache is not None:
            cache[0].set_linear_state(cache[1], conv_final, recurrent_final)
        return self.out_proj(self.norm(out, z).reshape(batch, seq, -1))


def init_a_log(a_log: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A_log as transformers initialises it: the log of A drawn uniformly from [0.01, 16]."""
    with torch.no_grad():
        return a_log.uniform_(0.01, 16, generator=generator).log_()


def _continuation(
    documents: torch.Tensor, seq: int, conv: torch.Tensor | None, recurrent: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The new positions' document ids [B, S] (``documents`` holds the cached ones first), the
    cached states zeroed in rows whose new positions never return to the last cached document,
    and the positions that pass by before they do ([B, S] bool, None when there are none)."""
    new = documents[:, -seq:]
    if documents.shape[1] == seq or conv is None:
        return new, conv, recurrent, None
    continuing = new == documents[:, -seq - 1, None]
    returns = continuing.any(dim=1)
    keep = returns.to(conv.dtype)
    conv, recurrent = conv * keep[:, None, None], recurrent * keep.to(recurrent.dtype)[:, None, None, None]
    if seq == 1:
        return new, conv, recurrent, None
    first = torch.where(returns, continuing.int().argmax(dim=1), 0)
    passing = torch.arange(seq, device=new.device)[None, :] < first[:, None]
    if not passing.any():
        return new, conv, recurrent, None
    # Passing positions take the continued document's id: no reset between the cache and its return.
    return torch.where(passing, new.gather(1, first[:, None]), new), conv, recurrent, passing


def _conv_after_passing(
    x: torch.Tensor, weight: torch.Tensor, documents: torch.Tensor, state: torch.Tensor, passing: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution of x [B, S, D] where each row's leading ``passing`` positions are no part
    of the cached document: they run first as a document of their own, then the cached inputs
    ``state`` [B, D, K - 1] and the rest of the row, so the continuation's windows skip them."""
    batch, seq, _ = x.shape
    history = state.shape[-1]
    count = passing.sum(dim=1)  # [B]
    # Row r of the combined sequence: x[:count], state, x[count:]; index into cat([x, state^T]).
    slots = torch.arange(seq + history, device=x.device)[None, :].expand(batch, -1)
    before = slots < count[:, None]
    in_state = ~before & (slots < count[:, None] + history)
    index = torch.where(before, slots, torch.where(in_state, seq + slots - count[:, None], slots - history))
    combined = torch.cat([x, state.transpose(1, 2).to(x.dtype)], dim=1).gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
    continued = documents.gather(1, count[:, None])  # the cached document, where the row returns to it
    ids = torch.cat([documents, continued.expand(-1, history)], dim=1).gather(1, index)
    ids = torch.where(before, documents.min() - 1, ids)  # a document of their own
    out, final = kernels.causal_conv1d(combined, weight, document_ids=ids, activation="silu", output_final_state=True)
    back = torch.where(slots[:, :seq] < count[:, None], slots[:, :seq], slots[:, :seq] + history)
    return out.gather(1, back[..., None].expand(-1, -1, out.shape[-1])), final
