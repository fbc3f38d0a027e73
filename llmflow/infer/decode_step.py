"""The forward generation runs for each new token: eager over the growing ``KVCache``, or
compiled over a ``StaticKVCache`` (``models/static_cache.py``).

A decode step feeds one token per row: a few milliseconds of GPU work that, eager, costs
more in kernel launches than in reading the weights. Compiled with ``torch.compile`` in
"reduce-overhead" mode on CUDA, the step is captured once as a CUDA graph per batch shape and
replayed, one launch per step; on other devices the compiled step is Inductor's code without
graphs. The prompt's forward (prefill) stays eager: its length differs from batch to batch.

The cache's length is rounded up to a multiple of ``CACHE_BUCKET`` so that batches of
different prompt lengths share a compiled step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Literal

import torch

from llmflow.models.decoder import CausalLM
from llmflow.models.kv_cache import KVCache
from llmflow.models.static_cache import StaticKVCache

DecodeMode = Literal["auto", "eager", "compiled"]
CACHE_BUCKET = 256


def compiles(model: CausalLM, mode: DecodeMode, sharded: bool) -> bool:
    """Whether generation with ``model`` runs the compiled step: "auto" on CUDA for a whole
    model without linear-attention layers; "compiled" wherever asked (refused for a model
    with linear-attention layers, before any work)."""
    linear = any(model.config.is_linear_layer(i) for i in range(model.config.num_hidden_layers))
    if mode == "compiled" and linear:
        raise ValueError(f"decode: compiled needs attention layers only; this {model.config.model_type} model has "
                         "linear-attention (Gated DeltaNet) layers, whose states the static KV cache does not hold: "
                         "use decode: eager or auto")
    if mode == "auto":
        return next(model.parameters()).device.type == "cuda" and not sharded and not linear
    return mode == "compiled"


def new_cache(length: int, device: torch.device, compiled: bool) -> KVCache | StaticKVCache:
    """A cache for ``length`` positions: static (its length rounded up to the bucket) for
    the compiled step."""
    if not compiled:
        return KVCache(length)
    return StaticKVCache(-(-length // CACHE_BUCKET) * CACHE_BUCKET, device)


def last_logits(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor | None,
                cache: KVCache | StaticKVCache) -> torch.Tensor:
    """Run ``ids`` [B, S] (their ``positions`` and ``documents`` [B, S]) after the cached
    positions; the logits [B, V] of the last one only."""
    hidden = model.model(ids, position_ids=positions, document_ids=documents, kv_cache=cache)
    return model.lm_head(hidden[:, -1])


@cache
def compiled_last_logits(device_type: str) -> Callable[..., torch.Tensor]:
    """``last_logits`` compiled for one device type, once per process (its compiled code is
    shared by every model and batch shape, each with its own guards)."""
    mode = "reduce-overhead" if device_type == "cuda" else None
    return torch.compile(last_logits, mode=mode, dynamic=False)


def decode(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor | None,
           cache: KVCache | StaticKVCache) -> torch.Tensor:
    """One decode step: compiled over a static cache, eager over a growing one."""
    if isinstance(cache, KVCache):
        return last_logits(model, ids, positions, documents, cache)
    device_type = ids.device.type
    if device_type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
    documents = _standard_strides(documents) if documents is not None else None
    return compiled_last_logits(device_type)(model, _standard_strides(ids), _standard_strides(positions), documents,
                                             cache)


def _standard_strides(x: torch.Tensor) -> torch.Tensor:
    """``x`` with row-major strides: a column sliced from a wider tensor keeps the width as its
    stride (even where ``is_contiguous`` ignores it, on a dim of size 1), and compiled code
    guards on strides, so a width that differs from batch to batch would compile the step again."""
    return torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
