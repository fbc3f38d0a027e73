"""What every evaluation command shares: the model, the data, where results go, batching,
the chat settings and the device; and loading the model with its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field

from llmflow.evaluate.chat_context import ChatSettings
from llmflow.models.config import text_config
from llmflow.runtime import detect_device_type, resolve_dtype
from llmflow.weights import load_model, tokenizer_dir

DEFAULT_MAX_LENGTH = 2048


class EvalSettings(ChatSettings):
    """Settings shared by every evaluation (the chat settings first)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: Path
    """Hugging Face model directory, training checkpoint (root or step directory) or LoRA checkpoint."""
    data: Path | str
    """The benchmark's data: a local directory in one of its published layouts, or a hub dataset
    (hf://cais/mmlu, hf://ceval/ceval-exam, hf://haonan-li/cmmlu, hf://aps/super_glue, hf://hails
    for every hails/agieval-* task, hf://openai/gsm8k, hf://SaylorTwift/bbh, hf://openai/openai_humaneval,
    hf://HuggingFaceH4/MATH-500, hf://EleutherAI/hendrycks_math, hf://TIGER-Lab/MMLU-Pro,
    hf://Idavidrein/gpqa, hf://google/IFEval, ms://org/name),
    downloaded into cache_dir first (only the files the evaluation reads)."""
    out: Path
    """Output directory: results.json, predictions.jsonl and manifest.json (replaced as a whole)."""
    limit: int | None = Field(default=None, ge=1)
    """Evaluate only the first N questions of each subject or task."""
    batch_size: int = Field(default=8, ge=1)
    """Sequences per forward pass."""
    padding_side: Literal["right", "left"] = "right"
    """Where batches are padded (the scores do not depend on it)."""
    device: str = "auto"
    """cpu, cuda or npu; auto picks npu, then cuda, then cpu."""
    dtype: str = "auto"
    """Compute dtype: fp32, bf16, fp16, or auto (bf16 on accelerators that support it, fp32 on CPU)."""
    cache_dir: Path = Path("~/.cache/llmflow")
    """Where hub data is downloaded (cache_dir/hf/org/name, with a manifest; verified, not
    fetched again, on later runs)."""


def eval_model(settings: EvalSettings) -> tuple[Any, dict[str, Any]]:
    """The model in eval mode on its device and dtype, and its HF config."""
    device_type = detect_device_type() if settings.device == "auto" else settings.device
    model, hf_config = load_model(settings.model, device_type)
    return model.to(resolve_dtype(settings.dtype, device_type)).eval(), hf_config


def context_length(hf_config: dict[str, Any]) -> int:
    """The longest sequence the model takes (a multimodal config.json: its text model's)."""
    return int(text_config(hf_config).get("max_position_embeddings") or DEFAULT_MAX_LENGTH)


def load_for_eval(settings: EvalSettings) -> tuple[Any, Path, int]:
    """The model in eval mode on its device and dtype, its tokenizer's directory and the
    longest sequence it takes."""
    model, hf_config = eval_model(settings)
    tok_dir = tokenizer_dir(settings.model)
    if tok_dir is None:
        raise FileNotFoundError(f"model {settings.model}: no tokenizer (tokenizer.json) found with it")
    return model, tok_dir, context_length(hf_config)
