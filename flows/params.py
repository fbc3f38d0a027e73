"""Flow parameters: pydantic models whose field docstrings become the Prefect UI's form.

Every default points at the built-in sample assets, so each flow runs offline with no
parameters; real models and data are parameter values (``hf://Qwen/Qwen2.5-0.5B``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmflow import runtime
from llmflow.models.lora import LoraConfig
from llmflow.train.config import DataConfig, OptimConfig, TrainConfig

SAMPLE = "sample"
"""Source value that means "the built-in sample assets" (written by the sample stage)."""

Stage = Literal[
    "sample", "download", "convert", "tokenize", "evaluate-base", "train", "export", "infer", "evaluate", "register",
    "compare",
]


class Params(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


class TrainParams(Params):
    """How the model is trained. The defaults are the recipe that teaches the sample model
    its facts in about two minutes on two CPU cores; real models want a far lower lr."""

    steps: int = Field(default=500, ge=1)
    """Optimizer steps."""
    micro_batch_size: int = Field(default=16, ge=1)
    """Samples per rank per forward/backward."""
    global_batch_size: int = Field(default=16, ge=1)
    """Samples per optimizer step over all data-parallel ranks."""
    optim: OptimConfig = OptimConfig(lr=5e-3, min_lr=5e-4, warmup_steps=20, decay="linear")
    """AdamW and its learning-rate schedule."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (merged into the exported model) instead of every weight."""
    nproc: int = Field(default=1, ge=1)
    """Worker processes (one per accelerator; CPU runs use gloo)."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree; nproc / tp ranks are data parallel."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Compute dtype: auto = bf16 on accelerators, fp32 on CPU."""
    save_interval: int | None = Field(default=100, ge=1)
    """Checkpoint every this many steps: a retried run resumes from the last one."""
    seed: int = 1234
    """Seed of the data order and of LoRA's initialisation."""

    def train_config(self, model: Path, out: Path, data: DataConfig, seq_length: int | None = None) -> TrainConfig:
        """The training stage's config for these settings."""
        settings = self.model_dump(exclude={"nproc"})
        return TrainConfig.model_validate({**settings, "model": model, "out": out, "data": data,
                                           "seq_length": seq_length, "log_interval": 10})

    @model_validator(mode="after")
    def _layout_fits(self) -> TrainParams:
        if self.nproc % self.tp:
            raise ValueError(f"nproc={self.nproc} is not a multiple of tp={self.tp}")
        device_type = runtime.detect_device_type()
        available = runtime.device_count(device_type)
        if available is not None and self.nproc > available:
            raise ValueError(f"nproc={self.nproc} but this machine has {available} {device_type} device(s)")
        return self


class EvalParams(Params):
    """The MMLU evaluation (lm-evaluation-harness's prompts and scoring)."""

    data: str = SAMPLE
    """MMLU data: hf://cais/mmlu, a local directory in the cais/mmlu or the original CSV
    layout, or "sample" for the sample set."""
    shots: int = Field(default=5, ge=0, le=5)
    """Solved dev questions before each question."""
    subjects: list[str] | None = None
    """Subjects to evaluate (default: all)."""
    limit: int | None = Field(default=None, ge=1)
    """Only the first N test questions of each subject."""
    batch_size: int = Field(default=8, ge=1)
    """Sequences per forward pass."""
    template: str = "none"
    """Chat template for the prompts: "none" (plain, as lm-evaluation-harness), "tokenizer" or a named one."""
