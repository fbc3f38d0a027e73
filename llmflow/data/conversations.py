"""Instruction data layouts -> conversations (lists of ``{"role", "content"}`` messages).

- ``alpaca``: ``instruction``, ``input`` (optional, appended to the instruction after a
  blank line), ``output``, optional ``system`` and ``history`` ([[user, assistant], ...]
  turns before this one), as Stanford Alpaca and LLaMA-Factory lay them out;
- ``sharegpt``: ``conversations`` = [{"from": "human"|"gpt"|"system", "value": ...}, ...]
  and an optional ``system`` column;
- ``messages``: ``messages`` = [{"role": "system"|"user"|"assistant", "content": ...}, ...]
  (the OpenAI chat layout).

``key_map`` renames any of these keys, the inner ones included (``{"conversations":
"dialog", "from": "speaker"}``). A conversation is an optional system message followed by
user and assistant messages taking turns, starting with the user and holding at least
one assistant message; anything else is an ``InputError`` naming the row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from llmflow.data.readers import InputError

Format = Literal["alpaca", "sharegpt", "messages"]
Message = dict[str, str]

DEFAULT_KEYS: dict[str, dict[str, str]] = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system", "history": "history"},
    "sharegpt": {"conversations": "conversations", "system": "system", "from": "from", "value": "value"},
    "messages": {"messages": "messages", "role": "role", "content": "content"},
}
# Which record columns each layout needs and may use (by their default names).
COLUMNS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input", "system", "history")),
    "sharegpt": (("conversations",), ("system",)),
    "messages": (("messages",), ()),
}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


def resolve_keys(fmt: str, key_map: Mapping[str, str] | None) -> dict[str, str]:
    """The record keys of layout ``fmt`` after renaming by ``key_map``."""
    if fmt not in DEFAULT_KEYS:
        raise InputError(f"unknown instruction format {fmt!r}; expected one of {', '.join(DEFAULT_KEYS)}")
    keys = dict(DEFAULT_KEYS[fmt])
    unknown = sorted(set(key_map or {}) - set(keys))
    if unknown:
        raise InputError(f"--map-keys: {unknown} are not keys of the {fmt} format; its keys are {sorted(keys)}")
    keys.update(key_map or {})
    return keys


def record_columns(fmt: str, keys: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(required, optional) record columns of layout ``fmt`` under ``keys``."""
    required, optional = COLUMNS[fmt]
    return [keys[k] for k in required], [keys[k] for k in optional]


def to_messages(fmt: str, record: Mapping[str, Any], keys: Mapping[str, str], where: str) -> list[Message]:
    """The conversation in ``record``; ``where`` ("data.jsonl: line 7") prefixes errors."""
    if fmt == "alpaca":
        messages = _alpaca(record, keys, where)
    elif fmt == "sharegpt":
        messages = _listed(record, keys, where, keys["conversations"], keys["from"], keys["value"], SHAREGPT_ROLES)
        system = record.get(keys["system"])
        if system and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": _text(system, where, keys["system"])})
    else:
        messages = _listed(record, keys, where, keys["messages"], keys["role"], keys["content"], {r: r for r in ("system", "user", "assistant")})
    _check_turns(messages, where)
    return messages


def _text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: {key!r} holds {type(value).__name__}, expected text")
    return value


def _alpaca(record: Mapping[str, Any], keys: Mapping[str, str], where: str) -> list[Message]:
    messages: list[Message] = []
    if system := record.get(keys["system"]):
        messages.append({"role": "system", "content": _text(system, where, keys["system"])})
    history = record.get(keys["history"]) or []
    if not isinstance(history, list):
        raise InputError(f"{where}: {keys['history']!r} must be a list of [instruction, response] pairs")
    for turn in history:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise InputError(f"{where}: {keys['history']!r} must be a list of [instruction, response] pairs, got {turn!r}")
        messages.append({"role": "user", "content": _text(turn[0], where, keys["history"])})
        messages.append({"role": "assistant", "content": _text(turn[1], where, keys["history"])})
    prompt = _text(record[keys["instruction"]], where, keys["instruction"])
    extra = record.get(keys["input"])
    if extra:
        prompt = f"{prompt}\n\n{_text(extra, where, keys['input'])}"
    messages.append({"role": "user", "content": prompt})
    messages.append({"role": "assistant", "content": _text(record[keys["output"]], where, keys["output"])})
    return messages


def _listed(
    record: Mapping[str, Any], keys: Mapping[str, str], where: str, list_key: str, role_key: str, content_key: str, roles: Mapping[str, str]
) -> list[Message]:
    turns = record[list_key]
    if not isinstance(turns, list):
        raise InputError(f"{where}: {list_key!r} holds {type(turns).__name__}, expected a list of messages")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or role_key not in turn or content_key not in turn:
            raise InputError(f"{where}: {list_key}[{i}] must be an object with {role_key!r} and {content_key!r}, got {turn!r}")
        role = turn[role_key]
        if role not in roles:
            raise InputError(f"{where}: {list_key}[{i}]: role {role!r} is not one of {sorted(roles)}")
        messages.append({"role": roles[role], "content": _text(turn[content_key], where, f"{list_key}[{i}].{content_key}")})
    return messages


def _check_turns(messages: list[Message], where: str) -> None:
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    for i, message in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            order = " -> ".join(m["role"] for m in messages)
            raise InputError(
                f"{where}: message {i + len(messages) - len(body)} is {message['role']!r} where {expected!r} was expected; "
                f"a conversation is [system], user, assistant, user, assistant, ... (got {order})"
            )
    if not any(m["role"] == "assistant" for m in body):
        raise InputError(f"{where}: no assistant message, so nothing to train on")
