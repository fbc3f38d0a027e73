"""The files from which transformers builds a tokenizer: what tokenization (``llmflow.data``)
and the weights that carry a tokenizer (``llmflow.weights``) both look for, kept below both
so that neither imports the other for it."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json")
"""One of them must be in a tokenizer directory."""


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds files transformers builds a tokenizer from."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)
