"""The sample's tokenizer: a byte-level BPE trained on the text of the other assets, with
Qwen2.5-Instruct's special tokens, tokenizer_config.json and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers

from llmflow.data.templates import QWEN
from llmflow.evaluate.chat_context import FEWSHOT_DELIMITER
from llmflow.evaluate.prompts import CONTINUATIONS, MMLU_PROMPT
from llmflow.evaluate.questions import Question

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
MAX_POSITIONS = 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE (no prefix space, every byte in the alphabet) with the three
    special tokens appended after the merges, as in Qwen2's vocabulary. Its normalizer and
    pre-tokenizer are those transformers' ``Qwen2Tokenizer`` builds (NFC; Qwen2's split regex,
    single digits, then bytes), so tokenizer.json says what ``AutoTokenizer`` does."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.normalizer = tokenizers.normalizers.NFC()
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _token_entry(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def write_tokenizer(tokenizer: tokenizers.Tokenizer, directory: Path) -> None:
    """tokenizer.json plus the tokenizer_config.json and special_tokens_map.json of a
    Qwen2.5-Instruct tokenizer (eos <|im_end|>, pad <|endoftext|>, no bos)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {**_token_entry(t), "special": True} for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": QWEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    special_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": _token_entry(IM_END),
        "pad_token": _token_entry(ENDOFTEXT),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def check_tokenizer(tokenizer: tokenizers.Tokenizer) -> None:
    """The MMLU answer tokens must be single tokens, or scoring compares the wrong things."""
    for continuation in CONTINUATIONS:
        if len(tokenizer.encode(continuation, add_special_tokens=False).ids) != 1:
            raise RuntimeError(f"sample tokenizer splits {continuation!r}; raise tokenizer_vocab")

def tokenizer_texts(
    corpus: list[dict[str, str]], instructions: list[dict[str, str]], mmlu: dict[str, dict[str, list[Question]]]
) -> list[str]:
    """The text the tokenizer learns from: everything the other assets hold, MMLU as the
    evaluation prompts spell it."""
    texts = [r["text"] for r in corpus] + ["system user assistant You are a helpful assistant."]
    texts += [f"{r['instruction']}\n\n{r['input']}\n{r['output']}" for r in instructions]
    for subject, splits in mmlu.items():
        texts += [MMLU_PROMPT.describe(subject) + MMLU_PROMPT.solved_example(q) + FEWSHOT_DELIMITER
                  for q in splits["dev"] + splits["test"]]
    return texts
