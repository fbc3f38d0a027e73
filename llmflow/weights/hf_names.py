"""Parameter names between Hugging Face checkpoints and the decoder.

The decoder uses HF's module names, so most names map to themselves. What the map adds:
keys HF files may carry that are not parameters (rotary ``inv_freq`` buffers of older
exports), the output projection that tied checkpoints omit, and the list of names a
complete checkpoint must provide.
"""

from __future__ import annotations

import re

from torch import nn

# Buffers some HF exports contain; recomputed from the config instead.
_IGNORED_HF_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
TIED_OUTPUT = "lm_head.weight"
TIED_INPUT = "model.embed_tokens.weight"


def hf_to_ours(hf_name: str, tie_word_embeddings: bool) -> str | None:
    """Our parameter name for an HF tensor name; None for tensors we do not load."""
    if _IGNORED_HF_KEYS.search(hf_name):
        return None
    if tie_word_embeddings and hf_name == TIED_OUTPUT:
        return None
    return hf_name


def ours_to_hf(name: str) -> str:
    """The HF tensor name under which our parameter ``name`` is saved."""
    return name


def expected_names(model: nn.Module) -> list[str]:
    """Parameter names a checkpoint must provide for ``model`` (a tied output projection
    appears once, as the embedding)."""
    return [name for name, _ in model.named_parameters()]
