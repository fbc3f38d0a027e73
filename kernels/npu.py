"""Ascend NPU kernels, written to torch_npu's documented operators.

Imported only after torch_npu has loaded (see llmflow.kernels.dispatch). Pitfalls handled:
- ``npu_rms_norm`` defaults epsilon to 1e-6: the model's eps is always passed.
- ``npu_fusion_attention``'s mask is True where attention is *blocked* (SDPA: True =
  attend); with sparse_mode 2/3 it takes the compressed 2048x2048 upper-triangular mask.
- ``npu_swiglu`` gates the first half of its input: silu(gate) * up needs [gate, up].
- ``npu_fusion_attention`` is given values as wide as the queries and keys: narrower ones
  (Multi-head Latent Attention's) are padded with zero columns, which leave the output's
  other columns as they are, and the padding's columns are cut off the output.
- ``npu_fusion_attention`` takes no attention sinks (gpt-oss): attention with sinks runs the
  reference formula.
- ``npu_grouped_matmul`` multiplies x by weight as stored ([E, in, out]): the experts' nn.Linear
  layout [E, out, in] goes in transposed; ``group_list_type=1`` reads group_list as counts.
"""

from __future__ import annotations

import functools

import torch
import torch_npu  # also registers the npu device

from llmflow.kernels import reference
from llmflow.kernels.masks import attention_mask

# sparse_mode 3 = "rightDownCausal": causal with queries aligned to the last keys, which is
# ordinary causal attention for training and correct for decoding with a KV cache.
_RIGHT_DOWN_CAUSAL = 3
_COMPRESSED_MASK_SIZE = 2048


@functools.cache
def _causal_compressed_mask(device: torch.device) -> torch.Tensor:
    ones = torch.ones(_COMPRESSED_MASK_SIZE, _COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: BNSD; cos/sin [B, S, D] -> B1SD, a documented broadcast for BNSD input.
    return torch_npu.npu_rotary_mul(x, cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch_npu.npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


def _document_ends(document_ids: torch.Tensor) -> list[int]:
    """Cumulative end offsets of each document in the flattened [B*S] token stream, the
    ``actual_seq_qlen`` of the TND layout."""
    change = torch.ones_like(document_ids, dtype=torch.bool)
    change[:, :-1] = document_ids[:, 1:] != document_ids[:, :-1]
    return (change.flatten().nonzero().squeeze(1) + 1).tolist()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    query_start: torch.Tensor | None = None,
) -> torch.Tensor:
    if sinks is not None:  # npu_fusion_attention takes no per-head extra logit
        return reference.attention(q, k, v, scale, document_ids, sliding_window, sinks, query_start)
    batch, heads, q_len, head_dim = q.shape
    if v.shape[-1] < head_dim:
        padded = torch.nn.functional.pad(v, (0, head_dim - v.shape[-1]))
        return attention(q, k, padded, scale, document_ids, sliding_window, query_start=query_start)[..., : v.shape[-1]]
    kv_len = k.shape[2]
    if query_start is not None or (sliding_window is not None and kv_len > sliding_window):
        blocked = ~attention_mask(q_len, kv_len, q.device, document_ids, sliding_window, query_start)
        return torch_npu.npu_fusion_attention(
            q, k, v, heads, "BNSD", atten_mask=blocked, scale=scale, sparse_mode=0
        )[0]
    if document_ids is not None and q_len == kv_len:
        ends = _document_ends(document_ids)
        tnd = lambda t: t.transpose(1, 2).reshape(batch * q_len, t.shape[1], head_dim)
        out = torch_npu.npu_fusion_attention(
            tnd(q), tnd(k), tnd(v), heads, "TND",
            atten_mask=_causal_compressed_mask(q.device), scale=scale, sparse_mode=_RIGHT_DOWN_CAUSAL,
            actual_seq_qlen=ends, actual_seq_kvlen=ends,
        )[0]
        return out.reshape(batch, q_len, heads, head_dim).transpose(1, 2)
    if document_ids is not None:
        blocked = ~attention_mask(q_len, kv_len, q.device, document_ids, None)
        return torch_npu.npu_fusion_attention(
            q, k, v, heads, "BNSD", atten_mask=blocked, scale=scale, sparse_mode=0
        )[0]
    return torch_npu.npu_fusion_attention(
        q, k, v, heads, "BNSD",
        atten_mask=_causal_compressed_mask(q.device), scale=scale, sparse_mode=_RIGHT_DOWN_CAUSAL,
    )[0]


# split_item 3: x and the output are single tensors split by group_list; group_type 0 splits the m axis.
_SINGLE_TENSORS = 3
_SPLIT_M = 0
_GROUP_COUNTS = 1


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return torch_npu.npu_grouped_matmul(
        [x], [weight.transpose(-2, -1)], group_list=counts.to(torch.int64), split_item=_SINGLE_TENSORS,
        group_type=_SPLIT_M, group_list_type=_GROUP_COUNTS,
    )[0]
