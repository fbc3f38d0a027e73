"""The tokenizer directory a stage is given: its fast tokenizer, special tokens, and the
model vocabulary every token id must fall in."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from llmflow.data.templates import tokenizer_config


class TokenizeError(ValueError):
    """The tokenizer or the tokens do not fit the request (missing files, no EOD, ids
    outside the model's vocabulary)."""


def load_tokenizer(directory: str | Path):
    """The fast tokenizer of a Hugging Face tokenizer directory (``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise TokenizeError(f"tokenizer {directory}: no such directory")
    path = directory / "tokenizer.json"
    if not path.is_file():
        present = sorted(p.name for p in directory.iterdir())
        raise TokenizeError(
            f"tokenizer {directory}: missing tokenizer.json (a fast tokenizer is required; "
            f"save one with transformers' save_pretrained); found {present}"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise TokenizeError(f"tokenizer {path}: cannot be loaded: {e}") from e


class TokenizerInfo(BaseModel):
    """What the stages need to know about a tokenizer directory."""

    path: str
    length: int
    """len(tokenizer): ids in the vocabulary, added tokens included."""
    eos_token: str | None
    eos_token_id: int | None
    pad_token_id: int | None
    """Id of pad_token, falling back to eos_token's."""
    config_vocab_size: int | None
    """vocab_size of config.json beside the tokenizer, when there is one."""


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_info(directory: str | Path) -> TokenizerInfo:
    directory = Path(directory)
    tok = load_tokenizer(directory)
    config = tokenizer_config(directory)
    if not config and (directory / "special_tokens_map.json").is_file():
        config = json.loads((directory / "special_tokens_map.json").read_text())
    eos, pad = _token_text(config.get("eos_token")), _token_text(config.get("pad_token"))
    eos_id = tok.token_to_id(eos) if eos is not None else None
    pad_id = tok.token_to_id(pad) if pad is not None else None
    config_vocab = None
    if (directory / "config.json").is_file():
        config_vocab = json.loads((directory / "config.json").read_text()).get("vocab_size")
    return TokenizerInfo(
        path=str(directory),
        length=tok.get_vocab_size(with_added_tokens=True),
        eos_token=eos,
        eos_token_id=eos_id,
        pad_token_id=pad_id if pad_id is not None else eos_id,
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
