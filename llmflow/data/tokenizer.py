"""The tokenizer directory a stage is given: its fast tokenizer, special tokens, and the
model vocabulary every token id must fall in.

Text becomes ids exactly as ``transformers.AutoTokenizer.from_pretrained(directory)`` makes
them, with the pinned transformers: the stages encode with the fast tokenizer transformers
builds (``backend_tokenizer``), never with tokenizer.json read on its own."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from tokenizers import Tokenizer

from llmflow.hf_files import TOKENIZER_FILES, has_tokenizer
from llmflow.models.config import text_config


class TokenizeError(ValueError):
    """The tokenizer or the tokens do not fit the request (missing files, no EOD, ids
    outside the model's vocabulary)."""


def _checkpoint_model_config(directory: Path) -> dict | None:
    """The HF config of the checkpoint whose ``tokenizer/`` folder ``directory`` is, when it has
    no config.json of its own: transformers picks some tokenizer classes by the model type."""
    if (directory / "config.json").is_file():
        return None  # checked before the import: llmflow.weights brings in the model code
    from llmflow.weights.training_checkpoint import LATEST, TOKENIZER_DIR, read_meta, resolve_step_dir

    if directory.name != TOKENIZER_DIR or not (directory.parent / LATEST).is_file():
        return None
    return read_meta(resolve_step_dir(directory.parent)).hf_config


@lru_cache(maxsize=8)
def _auto_tokenizer(directory: str, _files: tuple):
    from transformers import AutoConfig, AutoTokenizer

    try:
        model_config = _checkpoint_model_config(Path(directory))
        if model_config is not None:
            return AutoTokenizer.from_pretrained(directory, config=AutoConfig.for_model(**model_config))
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers raises anything from OSError to ValueError here
        reason = " ".join(str(e).split())
        raise TokenizeError(f"tokenizer {directory}: transformers' AutoTokenizer cannot load it: {reason}") from e


def hf_tokenizer(directory: str | Path):
    """``transformers.AutoTokenizer.from_pretrained(directory)``, loaded once per process: the
    one source of truth for how text becomes ids (transformers builds some model types'
    tokenizers in code, e.g. Qwen2's pre-tokenizer, whatever tokenizer.json says). Do not
    change it: every caller in the process shares it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TokenizeError(f"tokenizer {directory}: no such directory")
    if not has_tokenizer(directory):
        present = sorted(p.name for p in directory.iterdir())
        raise TokenizeError(
            f"tokenizer {directory}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}; "
            f"save them with transformers' save_pretrained); found {present}"
        )
    # Keyed by the files' stamps too: a directory written again is loaded again.
    files = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(directory.iterdir()) if p.is_file())
    return _auto_tokenizer(str(directory.resolve()), files)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The fast tokenizer (``tokenizers.Tokenizer``) that ``AutoTokenizer.from_pretrained(directory)``
    encodes with, as a copy of its own: ``encode``/``encode_batch`` give exactly the ids
    ``AutoTokenizer(text, add_special_tokens=...)`` gives (no truncation, no padding, special
    tokens split as the tokenizer's ``split_special_tokens`` says)."""
    hf = hf_tokenizer(directory)
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TokenizeError(
            f"tokenizer {directory}: transformers loads it as {type(hf).__name__}, which has no fast "
            "(tokenizers) backend; llmflow needs a fast tokenizer"
        )
    return tokenizer_from_state((backend.to_str(), bool(hf.split_special_tokens)))


def tokenizer_state(tokenizer: Tokenizer) -> tuple[str, bool]:
    """What rebuilds ``tokenizer`` in another process (its JSON does not keep whether special
    tokens are split)."""
    return tokenizer.to_str(), tokenizer.encode_special_tokens


def tokenizer_from_state(state: tuple[str, bool]) -> Tokenizer:
    """The tokenizer ``tokenizer_state`` describes, without truncation or padding."""
    tokenizer = Tokenizer.from_str(state[0])
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = state[1]
    return tokenizer


class TokenizerInfo(BaseModel):
    """What the stages need to know about a tokenizer directory (as transformers loads it)."""

    path: str
    length: int
    """len(tokenizer): ids in the vocabulary, added tokens included."""
    bos_token_id: int | None
    """Id of bos_token (None when the tokenizer has none)."""
    eos_token: str | None
    eos_token_id: int | None
    pad_token_id: int | None
    """Id of pad_token, falling back to eos_token's."""
    config_vocab_size: int | None
    """vocab_size of config.json beside the tokenizer, when there is one."""


def _config_vocab_size(config: dict) -> int | None:
    """vocab_size of a config.json: its own, or a multimodal model's text config's (Qwen3.5
    nests the decoder's keys under ``text_config``); None when it names none."""
    if "vocab_size" in config:
        return config["vocab_size"]
    from llmflow.models.config import ConfigError, text_config

    try:
        return text_config(config).get("vocab_size")
    except ConfigError:  # a model type llmflow does not build: no vocabulary to check against
        return None


def tokenizer_info(directory: str | Path) -> TokenizerInfo:
    directory = Path(directory)
    hf = hf_tokenizer(directory)
    config_vocab = None
    if (directory / "config.json").is_file():
        config_vocab = _config_vocab_size(json.loads((directory / "config.json").read_text()))
    eos_id = hf.eos_token_id
    return TokenizerInfo(
        path=str(directory),
        length=len(hf),
        bos_token_id=hf.bos_token_id,
        eos_token=hf.eos_token,
        eos_token_id=eos_id,
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else eos_id,
        config_vocab_size=config_vocab,
    )


def resolve_vocab_size(vocab_size: int | None, info: TokenizerInfo) -> tuple[int, str]:
    """The model vocabulary to check ids against (``vocab_size`` when given, else config.json's,
    else the tokenizer's length), and where it came from."""
    if vocab_size is not None:
        vocab, source = vocab_size, "--vocab-size"
    elif info.config_vocab_size is not None:
        vocab, source = int(info.config_vocab_size), f"{info.path}/config.json"
    else:
        vocab, source = info.length, "len(tokenizer)"
    if vocab < info.length:
        raise TokenizeError(
            f"vocab_size {vocab} (from {source}) is smaller than the tokenizer's {info.length} ids "
            f"({info.path}): the model cannot embed every token this tokenizer produces. Use the "
            "tokenizer that belongs to the model, or the model's real vocab_size."
        )
    return vocab, source


def out_of_vocab_message(where: str, token_id: int, vocab_size: int, vocab_source: str, tokenizer: str | Path) -> str:
    return (
        f"{where}: token id {token_id} is outside the model vocabulary "
        f"(vocab_size {vocab_size}, from {vocab_source}); training on it would fail with "
        f"'srcIndex < srcSelectDimSize'. Was the data tokenized for another model, or is "
        f"vocab_size wrong? Tokenizer: {tokenizer}"
    )


def eos_token_ids(tok_dir: Path, hf_config: dict[str, Any]) -> list[int]:
    """The eos_token_id (one id or a list) of generation_config.json beside the tokenizer
    (a checkpoint keeps it there), else of config.json (a multimodal one's text config), else
    the tokenizer's eos token."""
    generation = tok_dir / "generation_config.json"
    for source in (json.loads(generation.read_text()) if generation.is_file() else {}, text_config(hf_config)):
        eos = source.get("eos_token_id")
        if eos is not None:
            return eos if isinstance(eos, list) else [eos]
    eos = tokenizer_info(tok_dir).eos_token_id
    return [eos] if eos is not None else []
