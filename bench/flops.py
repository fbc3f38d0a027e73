"""Model FLOPs of a training step and the peak they are measured against.

Model FLOPs follow PaLM's appendix B (Chowdhery et al. 2022) and Chinchilla's convention:
per trained token, 6 N for the forward and backward pass through the weights, where N
counts the weights of every matrix multiplication (per layer q, k, v, o, gate, up and down;
plus the output layer, vocab x hidden), and 12 x layers x (heads x head_dim) x seq for the
attention scores and their product with the values, forward and backward, without halving
for the causal mask (PaLM's and torchtitan's count). Left out: the input embedding (a
lookup, no FLOPs), the RMSNorm weights (2 x hidden per layer + hidden, under 0.01% of N)
and element-wise work. The formula itself is ``llmflow.train.metrics.flops_per_token``,
the one the training loop's MFU uses; this module splits it into its two terms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmflow.models import ModelConfig
from llmflow.train.metrics import flops_per_token


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs per token of one model at one sequence length."""

    matmul_params: int
    """N: the weights of every matrix multiplication, the output layer's included."""
    dense: float
    """6 N: forward and backward through those weights."""
    attention: float
    """12 x layers x (heads x head_dim) x seq: attention scores and values, forward and backward."""

    @property
    def per_token(self) -> float:
        """dense + attention."""
        return self.dense + self.attention


def count_flops(config: ModelConfig, seq_length: int) -> FlopCount:
    """The split of ``flops_per_token(config, seq_length)`` into its two terms."""
    dense = flops_per_token(config, 0)
    return FlopCount(matmul_params=int(dense) // 6, dense=dense, attention=flops_per_token(config, seq_length) - dense)


def describe(count: FlopCount, seq_length: int) -> str:
    """One line saying what was counted, for the benchmark's report."""
    return (f"model FLOPs per token = 6N + 12*layers*(heads*head_dim)*seq = 6 x {count.matmul_params / 1e6:.2f}M "
            f"+ {count.attention / 1e6:.1f}M (seq {seq_length}) = {count.per_token / 1e9:.3f} GFLOP; N = weights of "
            "every matmul (q, k, v, o, gate, up, down, output layer), no embedding lookup or norms (PaLM appendix B)")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), before reading a clock."""
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def measured_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 2048,
                        repeats: int = 8, budget_s: float = 5.0) -> float:
    """The best FLOP/s of an n x n x n matrix multiplication in ``dtype`` on ``device`` over
    ``repeats`` timed runs (after one warm-up), on the threads torch uses now: the
    machine's practical dense peak, which achieved FLOP/s is a fraction of. Runs stop once
    they have taken ``budget_s``; a warm-up that alone takes longer is the measurement (a CPU
    without bfloat16 units takes a minute for one 2048^3 bf16 product)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    out = torch.empty(n, n, device=device, dtype=dtype)
    synchronize(device)
    start = time.perf_counter()
    torch.matmul(a, b, out=out)
    synchronize(device)
    best = spent = time.perf_counter() - start
    if spent > budget_s:
        return 2 * n**3 / best
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        synchronize(device)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > budget_s:
            break
    return 2 * n**3 / best
