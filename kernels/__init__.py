"""Fused ops of the decoder, each with a reference, a fused-torch (CPU/CUDA) and an NPU
implementation. The functions here dispatch on the input's device type."""

from __future__ import annotations

import torch

from llmflow.kernels import cross_entropy
from llmflow.kernels.dispatch import FUSED, REFERENCE, KernelSet, kernels_for, use_kernels
from llmflow.kernels.reference import soft_cap

__all__ = [
    "FUSED",
    "REFERENCE",
    "KernelSet",
    "apply_rotary",
    "attention",
    "causal_conv1d",
    "gated_delta_rule",
    "geglu",
    "grouped_mm",
    "kernels_for",
    "linear_cross_entropy",
    "rms_norm",
    "soft_cap",
    "swiglu",
    "token_cross_entropy",
    "use_kernels",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, normalised in fp32 as HF Llama/Qwen2 do."""
    return kernels_for(x.device.type).rms_norm(x, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, S, D] with cos/sin [B, S, D] (rotate-half convention)."""
    return kernels_for(x.device.type).apply_rotary(x, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return kernels_for(gate.device.type).swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up, GELU's tanh approximation (transformers' ``gelu_pytorch_tanh``)."""
    return kernels_for(gate.device.type).geglu(gate, up)


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
    """Causal attention, q [B, Hq, Sq, D], k [B, Hkv, Skv, D] and v [B, Hkv, Skv, Dv] (Dv may
    differ from D, as in Multi-head Latent Attention) with Hq a multiple of Hkv (GQA); the
    output is [B, Hq, Sq, Dv]. Queries are the last Sq positions, or the Sq from ``query_start``
    (a 0-d tensor) on, the keys after them unwritten slots of a static KV cache. ``document_ids``
    [B, Skv] keeps packed documents apart; ``sliding_window`` limits how far back a query looks. ``sinks`` [Hq] (gpt-oss's
    attention sinks): each head's logit joins every query's softmax as one more column whose
    probability is dropped (it attends to nothing), so a query's weights may sum to less than one."""
    extra = {} if sinks is None else {"sinks": sinks}
    if query_start is not None:
        extra["query_start"] = query_start
    return kernels_for(q.device.type).attention(q, k, v, scale, document_ids, sliding_window, **extra)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The experts' matmul: ``x`` [N, in] holds ``counts[e]`` rows for each expert e in
    order, each multiplied by its ``weight[e]`` [out, in] as nn.Linear does; [N, out]."""
    return kernels_for(x.device.type).grouped_mm(x, weight, counts)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule of Qwen3-Next/Qwen3.5's linear attention: (output [B, S, H, Dv]
    in q's dtype, final state [B, H, Dk, Dv] fp32 or None).

    q, k [B, S, H, Dk] (heads already repeated to v's), v [B, S, H, Dv], g [B, S, H] the log
    decay (<= 0), beta [B, S, H]. q and k are L2-normalised in the kernel when
    ``use_qk_l2norm`` (eps 1e-6, as transformers and fla), q is scaled by ``scale``
    (default 1/sqrt(Dk)). ``document_ids`` [B, S] (documents contiguous) resets the state at
    every document boundary, as separate calls per document would; ``initial_state``
    [B, H, Dk, Dv] seeds each row's first document and the final state is each row's last
    document's. Computed in fp32 (on CUDA with flash-linear-attention, in bf16/fp16, by its
    kernels). Decoding (a few positions with ``initial_state``) runs the recurrence. Paths
    and what backward keeps: llmflow/kernels/gated_delta.py."""
    return kernels_for(q.device.type).gated_delta_rule(
        q, k, v, g, beta, scale=scale, document_ids=document_ids, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    document_ids: torch.Tensor | None = None,
    activation: str | None = "silu",
    state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution of x [B, S, D] (channels last) with weight [D, K] (the
    checkpoint's ``conv1d.weight`` [D, 1, K] squeezed), then ``activation`` ("silu"/"swish"
    or None): (output [B, S, D] in x's dtype, final state [B, D, K-1] or None). Each packed
    document of ``document_ids`` [B, S] starts from zeros; ``state`` [B, D, K-1] holds the
    K-1 inputs before x (generation), for each row's first document; the final state is the
    K-1 inputs before the next position (zeros before the last document's start)."""
    return kernels_for(x.device.type).causal_conv1d(
        x, weight, bias, document_ids=document_ids, activation=activation, state=state,
        output_final_state=output_final_state,
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against labels, of the logits soft-capped to
    ``softcap * tanh(logits / softcap)`` when ``softcap`` is set; the fused paths never hold
    the logits of all tokens at once. A tensor-parallel run passes the output projection as
    a replicated DTensor; every rank then computes the same loss on its full copy."""
    weight = _replicated_local(weight)
    return kernels_for(hidden.device.type).linear_cross_entropy(hidden, weight, labels, ignore_index, reduction,
                                                                softcap=softcap)


def token_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        ignore_index: int = -100, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's cross-entropy of ``hidden @ weight.T`` (soft-capped as for the loss) and the
    entropy of its softmax (a metric, without gradient), both [tokens] and 0 where the label is
    ignored, from the fused chunks on every device; a replicated DTensor weight as for the loss."""
    return cross_entropy.token_cross_entropy(hidden, _replicated_local(weight), labels, ignore_index,
                                             with_entropy=True, softcap=softcap)


def _replicated_local(weight: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(weight, DTensor):
        return weight
    if not all(p.is_replicate() for p in weight.placements):
        raise NotImplementedError(f"the fused cross-entropy needs a replicated output projection, got {weight.placements}")
    return weight.to_local()
