"""Shared fixtures: tiny Hugging Face models saved to temporary checkpoint directories.

Nothing here reaches the network: the hub is forced offline before transformers is
imported, and every model is built from a config in memory.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# The small shapes every tiny model shares (override per test through the factory).
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def _hf_classes(family: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> None:
    """Give every parameter non-trivial values: transformers initialises biases to zero and
    norm weights to one, which would let bias- or norm-handling bugs pass unnoticed."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(std * torch.randn(p.shape, generator=g))


@pytest.fixture
def make_hf_model(tmp_path_factory):
    """Factory: ``make_hf_model(family="llama", seed=0, save_kwargs=None, **config_overrides)``
    builds a tiny transformers model with seeded random weights (eager attention, fp32),
    saves it with ``save_pretrained`` and returns ``(hf_model.eval(), path)``."""

    def factory(family: str = "llama", seed: int = 0, save_kwargs: dict | None = None, **overrides):
        config_cls, model_cls = _hf_classes(family)
        kwargs = {**TINY, **overrides}
        config = config_cls(**kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = model_cls(config)
        randomize_(model, seed)
        if config.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        path = tmp_path_factory.mktemp(f"hf_{family}")
        model.save_pretrained(path, **(save_kwargs or {}))
        return model.eval(), path

    return factory


@pytest.fixture
def tokens():
    """Factory: ``tokens(batch, seq, vocab, seed=0)`` -> random int64 ids."""

    def factory(batch: int, seq: int, vocab: int = TINY["vocab_size"], seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, seq), generator=g)

    return factory
