"""The prompts of online reinforcement learning: a JSON-lines or parquet file of prompts with
the columns their rewards are computed from, read and checked whole, and rendered with a
chat template into the token ids generation starts from.

Layouts, detected per file from the columns of its first row (the first of these whose
prompt column it has):

- ``gsm8k`` (openai/gsm8k): ``question`` (text) and ``answer``;
- ``math`` (MATH): ``problem`` (text) and ``solution``;
- ``prompt``: ``prompt`` as text with an ``answer``, or as a list of role/content messages
  (TRL's conversational prompt);
- ``messages``: ``messages``, a list of role/content messages (the OpenAI chat layout).

A conversation (a list of messages) is the whole prompt: it must end with a user message,
the one the model answers, and needs no answer column. Every column of a row is kept as it
is for the reward functions (``answer``, ``solution``, ``test``, ``entry_point``, ...).
Rows are located as ``llmflow.data.readers`` words them: "rl.jsonl: line 13" (the line's
1-based number), "rl.parquet: row 12" (the record's 0-based index).

Every prompt is rendered with a chat template, the tokenizer's own unless a named one
(``llmflow.data.templates``) is asked for: a question, problem or text prompt as the user's
message, a conversation as it stands, followed by the assistant's turn header. The text is
encoded whole with no special tokens added, so the ids are those of transformers'
``apply_chat_template(messages, add_generation_prompt=True)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmflow.data.readers import InputError, describe_row, iter_records
from llmflow.data.templates import Message, TemplateError, load_template
from llmflow.data.tokenizer import TokenizeError, load_tokenizer

FORMATS = (".jsonl", ".ndjson", ".parquet")
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Layout:
    """Where a layout holds its prompt and what a row of it needs."""

    name: str
    """How errors name it: gsm8k, math, prompt, messages."""
    column: str
    """The prompt's column."""
    answer: str | None
    """The column a text prompt needs beside it; None where the prompt is never text."""
    conversation: bool
    """Whether the prompt may be a list of role/content messages."""


LAYOUTS = (
    Layout("gsm8k", "question", "answer", conversation=False),
    Layout("math", "problem", "solution", conversation=False),
    Layout("prompt", "prompt", "answer", conversation=True),
    Layout("messages", "messages", None, conversation=True),
)
ACCEPTED = (
    "gsm8k (question, answer), math (problem, solution), prompt (prompt text and answer, or prompt "
    "as role/content messages), messages (role/content messages ending with a user message)"
)


@dataclass
class PromptRow:
    """One prompt of the file, with every column of its row."""

    index: int
    """0-based position of the row among the file's records."""
    where: str
    """The file and row, for messages: "rl.jsonl: line 13", "rl.parquet: row 12"."""
    prompt: str | list[Message]
    """The user's message, or the conversation the model answers the last message of."""
    columns: dict[str, Any]
    """Every column of the row as the file gives it (the prompt's included)."""
    prompt_ids: list[int] = field(default_factory=list)
    """The rendered prompt's token ids (``render_prompts``)."""

    def reward_columns(self) -> dict[str, Any]:
        """The columns reward functions get as keyword arguments: all but the prompt (passed
        apart, as TRL passes it)."""
        return {k: v for k, v in self.columns.items() if k != "prompt"}


def read_prompt_rows(path: str | Path) -> list[PromptRow]:
    """Every prompt of a JSON-lines or parquet file, the whole file read and checked first:
    an ``InputError`` names the file, the row and what was expected (no rows, a layout none
    of ``LAYOUTS``, a missing, non-text or empty prompt, a missing answer, a conversation
    that does not end with a user message)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise InputError(f"{path}: prompts must be JSON lines or parquet ({', '.join(FORMATS)})")
    next(iter_records(path, []), None)  # the readers' error for a missing or unreadable file
    rows: list[PromptRow] = []
    layout: Layout | None = None
    for index, (row, record) in enumerate(iter_records(path, [], _column_names(path))):
        where = f"{path}: {describe_row(path, row)}"
        layout = layout or _layout(record, where)
        rows.append(PromptRow(index, where, _prompt(layout, record, where), record))
    if not rows:
        raise InputError(f"{path}: no rows, so no prompts")
    return rows


def render_prompts(rows: list[PromptRow], tokenizer_dir: str | Path, template: str | None = None) -> list[list[int]]:
    """The token ids of every row's prompt, also set as its ``prompt_ids``: rendered with
    ``template`` ("tokenizer" or None: the tokenizer's own chat template; or a named one)
    up to the assistant's turn header."""
    chat = load_template(tokenizer_dir, template)
    texts = []
    for row in rows:
        try:
            texts.append(chat.prompt(row.prompt))
        except TemplateError as error:
            raise TemplateError(f"{row.where}: {error}") from error
    for row, encoding in zip(rows, load_tokenizer(tokenizer_dir).encode_batch(texts, add_special_tokens=False)):
        row.prompt_ids = encoding.ids
    return [row.prompt_ids for row in rows]


def prompt_problems(path: str | Path, tokenizer_dir: str | Path, template: str | None, max_prompt_tokens: int | None) -> list[str]:
    """Why the prompts of ``path`` cannot be trained on, one line each (empty when they can):
    the file's first bad row, a tokenizer or template that cannot render them, and every
    prompt longer than ``max_prompt_tokens`` (None: no limit)."""
    try:
        rows, problems = read_prompt_rows(path), []
    except InputError as error:
        rows, problems = [], [str(error)]
    try:
        render_prompts(rows, tokenizer_dir, template)
    except (TemplateError, TokenizeError) as error:
        return [*problems, str(error)]
    if max_prompt_tokens is not None:
        problems += [
            f"{row.where}: the prompt is {len(row.prompt_ids)} tokens, over max_prompt_tokens {max_prompt_tokens}"
            for row in rows
            if len(row.prompt_ids) > max_prompt_tokens
        ]
    return problems


def _column_names(path: Path) -> list[str]:
    """Every column of ``path``: a parquet file's schema, the keys of a JSON-lines file's
    objects in order of first appearance (a line that is not one is ``iter_records``' to
    report)."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).schema_arrow.names
    names: dict[str, None] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                names.update(dict.fromkeys(record))
    return list(names)


def _layout(record: Mapping[str, Any], where: str) -> Layout:
    """The layout of the file whose first row is ``record``."""
    for layout in LAYOUTS:
        if layout.column in record:
            return layout
    raise InputError(f"{where}: no prompt column in the columns {list(record)}; the layouts are {ACCEPTED}")


def _prompt(layout: Layout, record: Mapping[str, Any], where: str) -> str | list[Message]:
    """The prompt of ``record``, checked against ``layout``."""
    value = record.get(layout.column)
    if isinstance(value, list) and layout.conversation:
        return _conversation(value, where, layout.column)
    if not isinstance(value, str) or layout.answer is None:
        kinds = (["text"] if layout.answer else []) + (["a list of role/content messages"] if layout.conversation else [])
        found = "is missing" if value is None else f"holds {type(value).__name__}"
        raise InputError(f"{where}: {layout.column!r} {found}, expected {' or '.join(kinds)} ({layout.name} layout)")
    if not value.strip():
        raise InputError(f"{where}: {layout.column!r} is an empty prompt ({layout.name} layout)")
    if record.get(layout.answer) is None:
        raise InputError(f"{where}: {layout.answer!r} is missing; a {layout.name} row needs it beside a text {layout.column!r}")
    return value


def _conversation(turns: list[Any], where: str, column: str) -> list[Message]:
    """``turns`` as messages, checked to be role/content messages ending with a user message."""
    for i, turn in enumerate(turns):
        if not (isinstance(turn, Mapping) and turn.get("role") in ROLES and isinstance(turn.get("content"), str)):
            shown = json.dumps(turn, ensure_ascii=False, default=str)[:80]
            raise InputError(f"{where}: {column}[{i}] must be {{'role': {'|'.join(ROLES)}, 'content': text}}, got {shown}")
    if not turns or turns[-1]["role"] != "user":
        order = " -> ".join(turn["role"] for turn in turns) or "no message"
        raise InputError(f"{where}: {column!r} must end with a user message, the one the model answers (got {order})")
    return [{"role": turn["role"], "content": turn["content"]} for turn in turns]
