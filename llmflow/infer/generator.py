"""A model ready to generate: its weights (whole or tensor-parallel), tokenizer and stop ids,
loaded from an HF directory, a checkpoint or a LoRA checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from llmflow.data.tokenizer import eos_token_ids, load_tokenizer
from llmflow.infer.generate import GenerateConfig, GenerationResult, generate
from llmflow.models import CausalLM
from llmflow.models.config import text_config
from llmflow.weights import load_model, tokenizer_dir


@dataclass
class Generator:
    """A model ready to generate: weights, tokenizer and the ids that end a reply."""

    model: CausalLM
    tokenizer: Any
    tokenizer_dir: Path
    vocab_size: int
    """The model's real vocabulary (a checkpoint's padded rows are never sampled)."""
    eos_token_ids: list[int]
    group: dist.ProcessGroup | None = None
    """The tensor-parallel group the model is sharded over; None for a whole model."""

    def run(self, prompts: list[str] | list[list[int]], config: GenerateConfig, on_text=None) -> list[GenerationResult]:
        """``generate`` with this model's eos ids (unless the config names its own)."""
        config = config.model_copy(update={"eos_token_ids": config.eos_token_ids or self.eos_token_ids})
        return generate(
            self.model, self.tokenizer, prompts, config, on_text=on_text, vocab_size=self.vocab_size, group=self.group
        )


def load_generator(path: str | Path, device: str = "cpu") -> Generator:
    """The model in ``path`` with its tokenizer and eos ids, in eval mode."""
    return make_generator(path, *load_model(path, device))


def make_generator(
    path: str | Path, model: CausalLM, hf_config: dict[str, Any], group: dist.ProcessGroup | None = None
) -> Generator:
    """``model``, loaded from ``path`` (and sharded over ``group`` when given), with the
    tokenizer and eos ids that go with it, in eval mode."""
    tok_dir = tokenizer_dir(path)
    if tok_dir is None:
        raise FileNotFoundError(f"model {path}: no tokenizer (tokenizer.json) beside it")
    return Generator(
        model=model.eval(),
        tokenizer=load_tokenizer(tok_dir),
        tokenizer_dir=tok_dir,
        vocab_size=int(text_config(hf_config)["vocab_size"]),
        eos_token_ids=eos_token_ids(tok_dir, hf_config),
        group=group,
    )
