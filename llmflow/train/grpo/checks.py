"""What ``llmflow train`` checks of a ``method: grpo`` config before launch, one line per
problem: the prompt file's rows, prompts that leave no room for a completion in the model's
context, reward functions that do not import."""

from __future__ import annotations

import functools
from pathlib import Path

from llmflow.data.readers import InputError
from llmflow.data.templates import TemplateError
from llmflow.data.tokenizer import TokenizeError
from llmflow.models import ModelConfig
from llmflow.train.grpo.config import RLConfig
from llmflow.train.grpo.prompts import prompt_problems, read_prompt_rows, render_prompts
from llmflow.train.grpo.rewards import reward_problems
from llmflow.weights import tokenizer_dir


def rl_problems(rl: RLConfig, prompts: str | Path, model_path: str | Path, model: ModelConfig | None) -> list[str]:
    """Why the ``prompts`` file and ``rl``'s rewards cannot train ``model`` (read from
    ``model_path``; empty when they can)."""
    path = Path(prompts)
    problems = reward_problems(rl.rewards)
    if not path.is_file():
        return [f"data {path}: no such prompts file", *problems]
    tokenizer = tokenizer_dir(model_path)
    if tokenizer is None:
        return [f"model {model_path}: no tokenizer (tokenizer.json) beside it to render the prompts", *problems]
    room = None
    if model is not None:
        room = model.max_position_embeddings - rl.max_completion_length
        if room < 1:
            full = (f"rl.max_completion_length={rl.max_completion_length} leaves no room for a prompt in the "
                    f"model's context of {model.max_position_embeddings} positions")
            return [full, *problems]
    found = prompt_problems(path, tokenizer, rl.template, room)
    if room is not None:  # the limit's reason, said once
        found = [f"{line} (the model's {model.max_position_embeddings} positions less rl.max_completion_length "
                 f"{rl.max_completion_length})" if "over max_prompt_tokens" in line else line for line in found]
    return found + problems


def longest_sequence(rl: RLConfig, prompts: str | Path, model_path: str | Path) -> int | None:
    """The longest prompt of the ``prompts`` file plus ``rl.max_completion_length``: the
    memory plan's sequence length (None when the prompts cannot be read)."""
    try:
        stat = Path(prompts).stat()
    except OSError:
        return None
    longest = _longest_prompt(str(prompts), stat.st_size, stat.st_mtime_ns, str(model_path), rl.template)
    return longest + rl.max_completion_length if longest is not None else None


@functools.lru_cache(maxsize=8)
def _longest_prompt(prompts: str, size: int, mtime_ns: int, model_path: str, template: str) -> int | None:
    """The longest rendered prompt of a file, read once per content (its size and modification
    time in the key): the memory plan asks for it again for every layout it tries."""
    tokenizer = tokenizer_dir(model_path)
    if tokenizer is None:
        return None
    try:
        return max(len(p) for p in render_prompts(read_prompt_rows(prompts), tokenizer, template))
    except (InputError, TemplateError, TokenizeError):
        return None
