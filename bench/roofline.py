"""The memory-bandwidth roofline of decoding: a batch-1 decode step reads every weight it
multiplies by once (and the KV cache so far), so its tokens/s can reach at most the device's
memory bandwidth divided by those bytes.

``PEAK_BANDWIDTH`` holds vendor datasheet HBM bandwidths, matched by device name in order
as ``llmflow.train.metrics.PEAK_FLOPS`` is; ``measured_bandwidth`` times a read of a large
tensor, the practical ceiling the datasheet figure overstates.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from bench.flops import synchronize
from llmflow.train.metrics import device_figure

PEAK_BANDWIDTH: dict[str, float] = {
    # Matched in order: the PCIe and NVL cards before the SXM parts that share their name.
    "H100PCIe": 2.0e12,
    "H100NVL": 3.9e12,
    "H200NVL": 4.8e12,
    "H100": 3.35e12,
    "H200": 4.8e12,
    "A10080GBPCIe": 1.935e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100": 1.555e12,
}


def peak_bandwidth(device: torch.device) -> float | None:
    """The device's datasheet memory bandwidth in bytes/s; None on CPU or an unlisted device."""
    return device_figure(PEAK_BANDWIDTH, device)


def measured_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes/s of the best of ``repeats`` sums of a ``megabytes`` MiB fp32 tensor on ``device``
    (a read of memory far beyond the caches, as a decode step's read of the weights is)."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        x.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return megabytes * 2**20 / best


def decode_step_bytes(config: Mapping[str, int], batch: int, context: float, value_bytes: int) -> float:
    """Bytes a decode step of ``batch`` rows of a Llama-shaped model (an HF ``config.json``'s
    sizes, untied) reads with ``context`` positions cached, ``value_bytes`` per value: every
    weight but the embedding, ``batch`` embedding rows, and the cached keys and values."""
    h, f, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h
    weights = layers * per_layer + h + vocab * h + batch * h
    cache = 2 * layers * batch * kv * context
    return value_bytes * (weights + cache)
