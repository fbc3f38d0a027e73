"""Inference: batched generation with a KV cache, the ``generate`` and ``chat`` commands."""

from llmflow.infer.generate import (
    GenerateConfig,
    GenerationResult,
    TextDelta,
    generate,
    stream_generate,
)

__all__ = ["GenerateConfig", "GenerationResult", "TextDelta", "generate", "stream_generate"]
