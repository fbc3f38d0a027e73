"""Throughput, model FLOPs utilisation and memory of training steps."""

from __future__ import annotations

import resource
import time

import torch

from llmflow.models import ModelConfig
from llmflow.train.memory import attention_widths, latent_linear_params

# Dense bf16 peak FLOP/s per device (vendor datasheets); CPUs have no meaningful figure.
PEAK_FLOPS: dict[str, float] = {
    "Ascend910B": 313e12,
    "A100": 312e12,
    # Matched in order: the PCIe and NVL cards before the SXM parts that share their name.
    "H100PCIe": 756e12,
    "H100NVL": 835e12,
    "H200NVL": 835e12,
    "H100": 989e12,
    "H200": 989e12,
}


def device_figure(table: dict[str, float], device: torch.device) -> float | None:
    """The first figure of ``table`` whose key is part of the device's name (spaces and case
    ignored); None on CPU or an unlisted device."""
    if device.type == "cpu":
        return None
    name = torch.get_device_module(device.type).get_device_name(device).replace(" ", "").lower()
    return next((figure for key, figure in table.items() if key.lower() in name), None)


def peak_flops(device: torch.device) -> float | None:
    """The device's peak bf16 FLOP/s from ``PEAK_FLOPS``; None on CPU or an unlisted device."""
    return device_figure(PEAK_FLOPS, device)


def flops_per_token(config: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token: 6 x the matmul parameters a token goes through (forward +
    backward; in a mixture-of-experts layer the router, its top-k experts and the shared
    expert with its gate, if gated; a dense layer's SwiGLU of ``intermediate_size``) plus the
    attention score and value products (6 x layers x seq x (query heads' widths + their
    values'); 12 x layers x hidden x seq with heads as wide as their values), as in PaLM's MFU.
    Multi-head Latent Attention's matmuls are its down projections, their expansion into the
    heads' queries, keys and values (``kv_b_proj``) and ``o_proj``, its scores qk_head_dim and
    its values v_head_dim wide per head."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    q, k, v = attention_widths(config)
    attention = latent_linear_params(config) if config.kv_lora_rank else h * (q + k + v) + q * h
    values = heads * (config.v_head_dim if config.kv_lora_rank else config.head_dim)
    shared = config.shared_expert_intermediate_size
    routed = (config.num_experts + 3 * config.num_experts_per_tok * config.moe_intermediate_size + 3 * shared
              + (shared > 0 and config.shared_expert_gated)) * h
    feed_forward = sum(routed if config.is_moe_layer(i) else 3 * h * config.intermediate_size for i in range(layers))
    matmul_params = layers * attention + feed_forward + config.vocab_size * h
    return 6 * matmul_params + 6 * layers * (q + values) * seq_length


def memory_gib(device: torch.device) -> float:
    """Peak device memory allocated by tensors (accelerators), or peak RSS (CPU), in GiB."""
    if device.type == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return torch.get_device_module(device.type).max_memory_allocated(device) / 2**30


class StepTimer:
    """Seconds since the previous lap (device work included)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds
