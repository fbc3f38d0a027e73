"""The tokenizer files that travel with a model's weights: beside config.json in a Hugging
Face directory, in ``tokenizer/`` of a checkpoint root (a LoRA checkpoint may leave them to
its base)."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

from llmflow.hf_files import has_tokenizer
from llmflow.weights.training_checkpoint import (
    TOKENIZER_DIR,
    checkpoint_root,
    is_checkpoint,
    lora_base,
    read_meta,
    resolve_step_dir,
)

TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
    "generation_config.json",
)


def copy_tokenizer_files(source: Path, target: Path) -> None:
    """Copy the tokenizer (and generation config) files of an HF directory into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in TOKENIZER_PATTERNS):
            shutil.copyfile(path, target / path.name)


def tokenizer_dir(path: str | Path) -> Path | None:
    """Where the tokenizer of the model in ``path`` is: the HF directory itself, a
    checkpoint's ``tokenizer/`` folder, or (LoRA) its base's."""
    path = Path(path)
    if not is_checkpoint(path):
        return path if has_tokenizer(path) else None
    step_dir = resolve_step_dir(path)
    root = checkpoint_root(step_dir)
    if has_tokenizer(root / TOKENIZER_DIR):
        return root / TOKENIZER_DIR
    meta = read_meta(step_dir)
    if meta.base_checkpoint is not None:
        return tokenizer_dir(lora_base(step_dir, meta))
    return None


def carry_tokenizer(model: Path, root: Path) -> None:
    """Give the checkpoint root ``root`` the tokenizer of the model training starts from
    (unless it has one), so export and inference find it."""
    found = tokenizer_dir(model)
    if found is not None and not (root / TOKENIZER_DIR / "tokenizer.json").is_file():
        copy_tokenizer_files(found, root / TOKENIZER_DIR)
