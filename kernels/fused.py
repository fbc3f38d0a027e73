"""Fused PyTorch kernels for CPU and CUDA.

- RMSNorm through ``F.rms_norm`` (one fused kernel that saves only the input and rstd).
- Rotary embedding on the two halves directly, without building rotate_half's copy.
- SwiGLU as an autograd function that saves its two inputs only and recomputes silu in
  backward (the composite saves three tensors of FFN width); GeGLU (tanh GELU, Gemma) alike.
- Attention through ``F.scaled_dot_product_attention``: flash/efficient kernels on CUDA,
  the flash CPU kernel on CPU, native GQA, and an explicit mask only when packed
  documents or a sliding window require one. Attention sinks (gpt-oss) go in as an additive
  float mask over one extra zero key (exact; the kernels that take such a mask, not flash).
- Cross-entropy fused with the output projection (see cross_entropy.py).
- The experts of a mixture of experts through ``F.grouped_mm`` (one kernel for every
  expert's rows, CPU and CUDA); shapes or dtypes it does not take go expert by expert.
  Under torch.compile outside bfloat16 (which is all the compiler traces it in) the same
  kernel runs as the custom op ``llmflow::grouped_mm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmflow.kernels import reference
from llmflow.kernels.masks import attention_mask, needs_explicit_mask


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalise in fp32, round to the input dtype, then scale: the HF order of rounding.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate)
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


class _GeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.gelu(gate, approximate="tanh")
        grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh")
        return grad_gate, grad_up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _GeGLU.apply(gate, up)


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
    q_len, kv_len = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if sinks is not None:
        return _sink_attention(q, k, v, scale, document_ids, sliding_window, sinks, query_start)
    if needs_explicit_mask(q_len, kv_len, document_ids, sliding_window, query_start):
        mask = attention_mask(q_len, kv_len, q.device, document_ids, sliding_window, query_start)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=scale, enable_gqa=gqa)


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    document_ids: torch.Tensor | None, sliding_window: int | None,
                    sinks: torch.Tensor, query_start: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with a sink logit per head, exactly, through SDPA: one more key of zeros
    (score 0) whose additive mask is the head's sink, and a value of zeros, so the sink joins
    every query's softmax and its probability adds nothing to the output."""
    heads, q_len = q.shape[1], q.shape[2]
    allowed = attention_mask(q_len, k.shape[2], q.device, document_ids, sliding_window, query_start)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    bias = bias.expand(allowed.shape[0], heads, q_len, -1)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(allowed.shape[0], heads, q_len, 1)
    k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)
    v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat([bias, sink], dim=-1), scale=scale,
                                          enable_gqa=heads != k.shape[1])


# F.grouped_mm wants every stride a multiple of 16 bytes; CUDA takes bfloat16 only.
_GROUPED_MM_ALIGNMENT = 16


def _grouped_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return all(size * x.element_size() % _GROUPED_MM_ALIGNMENT == 0 for size in (x.shape[-1], weight.shape[-2]))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if not _grouped_mm_takes(x, weight):
        return reference.grouped_mm(x, weight, counts)
    offsets = counts.cumsum(0, dtype=torch.int32)
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # torch.compile traces grouped_mm in bfloat16 only (its fake kernel refuses fp32):
        # in other dtypes the same kernel runs as an op the compiler does not look into.
        return torch.ops.llmflow.grouped_mm(x, weight, offsets)
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


@torch.library.custom_op("llmflow::grouped_mm", mutates_args=())
def _opaque_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` with the groups' end offsets, for torch.compile outside bfloat16."""
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


@_opaque_grouped_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[-2])


@torch.library.custom_op("llmflow::grouped_mm_backward", mutates_args=())
def _opaque_grouped_mm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of x [N, in] (grad [N, out] times each group's weight [out, in]) and of
    weight [E, out, in] (each group's grad rows transposed times its x rows)."""
    return F.grouped_mm(grad, weight, offs=offsets), F.grouped_mm(grad.t(), x, offs=offsets)


@_opaque_grouped_mm_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
      offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _grouped_mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad: torch.Tensor):
    x, weight, offsets = ctx.saved_tensors
    grad_x, grad_weight = torch.ops.llmflow.grouped_mm_backward(grad.contiguous(), x, weight, offsets)
    return grad_x, grad_weight, None


_opaque_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)
