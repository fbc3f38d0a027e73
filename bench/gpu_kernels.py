"""The kernels a device dispatches to (``kernels_for(device.type)``: fused torch ops on CUDA,
torch_npu ops on NPU; on CUDA in bf16 also flash-linear-attention's gated delta rule and
causal-conv1d's convolution where they are importable) against the reference formulas,
forward and backward, as tests/test_kernels.py checks them on CPU and with its tolerances:

- fp32 on the device against the reference in fp32 on the CPU: outputs and the gradients of
  every input, max abs difference <= 1e-5;
- bf16 on the device against the reference in bf16 on the same device: outputs within
  2**-5 + 1% (one bf16 ulp of values up to 4), and for the cross-entropy the gradients within
  1e-2 + 2% of ``F.cross_entropy``'s.

TF32 is switched off for the fp32 checks (it would round matmul inputs to 10 bits).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmflow.kernels import REFERENCE, KernelSet, kernels_for
from llmflow.models.blocks.rotary import rotary_cos_sin

FP32 = (1e-5, 0.0)
BF16_FORWARD = (2**-5, 1e-2)
BF16_GRAD = (1e-2, 2e-2)


@dataclass
class KernelCheck:
    """One op in one dtype: the largest difference found and whether it is within tolerance."""

    op: str
    dtype: str
    max_abs_diff: float
    ok: bool
    atol: float
    rtol: float


def _inputs(seed: int, *shapes: tuple[int, ...], scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * scale for shape in shapes]


def _cos_sin(batch: int, seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return rotary_cos_sin(inv_freq, torch.arange(seq).expand(batch, seq), torch.float32)


def _ce_labels(device: torch.device | str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    labels = torch.randint(0, 5000, (256,), generator=g)
    labels[torch.rand(256, generator=g) < 0.2] = -100
    return labels.to(device)


@dataclass
class _Case:
    make: Callable[[KernelSet], Callable]
    """kernels -> the op as a function of ``inputs``."""
    inputs: list[torch.Tensor]
    """fp32 CPU inputs."""
    differentiable: int
    """How many leading inputs get gradients."""


def optional_kernels() -> dict[str, bool]:
    """Whether the CUDA kernel libraries the dispatch uses where they are installed are importable."""
    return {name: importlib.util.find_spec(module) is not None
            for name, module in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))}


def _gated_delta(document_ids: torch.Tensor | None = None):
    """The gated delta rule's output, its decay and beta made from unconstrained inputs as the
    model makes them (g = -softplus, beta = sigmoid)."""
    return lambda k: lambda q, kk, v, a, b: k.gated_delta_rule(
        q, kk, v, -F.softplus(a), torch.sigmoid(b),
        document_ids=None if document_ids is None else document_ids.to(q.device))[0]


def _conv(document_ids: torch.Tensor | None = None):
    return lambda k: lambda x, w, b: k.causal_conv1d(
        x, w, b, document_ids=None if document_ids is None else document_ids.to(x.device))[0]


def _cases() -> dict[str, _Case]:
    cos, sin = _cos_sin(2, 64, 64)
    docs = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 64])
    counts = torch.tensor([70, 0, 120, 66])  # one expert without tokens
    delta = ((2, 128, 4, 32),) * 3 + ((2, 128, 4),) * 2
    delta_docs = torch.tensor([[0] * 50 + [1] * 60 + [2] * 18, [0] * 128])
    scale = 64**-0.5
    mha, gqa = ((2, 8, 64, 64),) * 3, ((2, 8, 64, 64), (2, 2, 64, 64), (2, 2, 64, 64))

    def attention(*extra):
        return lambda k: lambda q, kk, v: k.attention(q, kk, v, scale, *[e.to(q.device) if torch.is_tensor(e) else e
                                                                         for e in extra])

    return {
        "rms_norm": _Case(lambda k: lambda x, w: k.rms_norm(x, w, 1e-6), _inputs(0, (2, 64, 256), (256,), scale=3), 2),
        "apply_rotary": _Case(lambda k: k.apply_rotary, [*_inputs(1, (2, 8, 64, 64)), cos, sin], 1),
        "swiglu": _Case(lambda k: k.swiglu, _inputs(2, (2, 64, 512), (2, 64, 512), scale=3), 2),
        "attention causal": _Case(attention(), _inputs(3, *mha), 3),
        "attention gqa": _Case(attention(), _inputs(4, *gqa), 3),
        "attention documents": _Case(attention(docs), _inputs(5, *gqa), 3),
        "attention window": _Case(attention(None, 16), _inputs(6, *gqa), 3),
        "attention decode": _Case(attention(), _inputs(7, (2, 8, 1, 64), *gqa[1:]), 3),
        "linear_cross_entropy": _Case(
            lambda k: lambda h, w: k.linear_cross_entropy(h, w, _ce_labels(h.device), -100, "mean"),
            [*_inputs(8, (256, 128)), *_inputs(10, (5000, 128), scale=0.3)], 2),
        "grouped_mm": _Case(lambda k: lambda x, w: k.grouped_mm(x, w, counts.to(x.device)),
                            _inputs(11, (256, 64), (4, 96, 64), scale=0.5), 2),
        "gated_delta_rule": _Case(_gated_delta(), _inputs(12, *delta), 5),
        "gated_delta_rule documents": _Case(_gated_delta(delta_docs), _inputs(13, *delta), 5),
        "causal_conv1d": _Case(_conv(), _inputs(14, (2, 64, 96), (96, 4), (96,)), 3),
        "causal_conv1d documents": _Case(_conv(docs), _inputs(15, (2, 64, 96), (96, 4), (96,)), 3),
    }


def _torch_cross_entropy(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.T).float(), _ce_labels(h.device), ignore_index=-100)


def _forward_backward(fn: Callable, inputs: list[torch.Tensor], differentiable: int) -> list[torch.Tensor]:
    """The output and the gradient of <output, fixed random> for the first ``differentiable`` inputs."""
    inputs = [t.detach().clone().requires_grad_(i < differentiable) for i, t in enumerate(inputs)]
    out = fn(*inputs)
    if not differentiable:
        return [out.detach()]
    g = torch.Generator().manual_seed(123)
    weight = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    return [out.detach(), *torch.autograd.grad(out, inputs[:differentiable], weight)]


def _max_diff(actual: list[torch.Tensor], expected: list[torch.Tensor], atol: float, rtol: float) -> tuple[float, bool]:
    worst, ok = 0.0, True
    for a, e in zip(actual, expected, strict=True):
        a, e = a.detach().float().cpu(), e.detach().float().cpu()
        diff = (a - e).abs()
        worst = max(worst, float(diff.max()))
        ok = ok and bool((diff <= atol + rtol * e.abs()).all())
    return worst, ok


def check_kernels(device: torch.device) -> list[KernelCheck]:
    """Every op of ``kernels_for(device.type)`` against the reference, in fp32 and bf16."""
    kernels = kernels_for(device.type)
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    try:
        for op, case in _cases().items():
            expected = _forward_backward(case.make(REFERENCE), case.inputs, case.differentiable)
            actual = _forward_backward(case.make(kernels), [t.to(device) for t in case.inputs], case.differentiable)
            results.append(KernelCheck(op, "fp32", *_max_diff(actual, expected, *FP32), *FP32))

            bf16 = [t.to(device, torch.bfloat16) for t in case.inputs]
            if op == "linear_cross_entropy":  # gradients, against F.cross_entropy of the bf16 logits in fp32
                expected = _forward_backward(_torch_cross_entropy, bf16, 2)[1:]
                actual = _forward_backward(case.make(kernels), bf16, 2)[1:]
                tol = BF16_GRAD
            else:
                expected = _forward_backward(case.make(REFERENCE), bf16, 0)
                actual = _forward_backward(case.make(kernels), bf16, 0)
                tol = BF16_FORWARD
            results.append(KernelCheck(op, "bf16", *_max_diff(actual, expected, *tol), *tol))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    return results
