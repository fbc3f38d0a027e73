"""Instruction and preference data layouts -> conversations (lists of ``{"role", "content"}``
messages) and preference pairs.

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

Preference layouts (``to_pair``) give a ``Pair``: the prompt (a conversation ending with a
user message) and the chosen and rejected assistant responses:

- ``pairwise`` (TRL's preference layout): ``prompt``, ``chosen``, ``rejected``; the prompt
  is text (one user message) or a list of role/content messages, each response text (one
  assistant message) or a list holding one assistant message. Without a prompt (TRL's
  implicit prompt), ``chosen`` and ``rejected`` are whole conversations that share every
  message but the last, the response;
- ``alpaca`` (LLaMA-Factory's and MindSpeed-LLM's pairwise layout): ``instruction``,
  ``input`` (optional), ``chosen``, ``rejected`` (texts), optional ``system`` and
  ``history`` as in the instruction layout;
- ``sharegpt`` (LLaMA-Factory's): ``conversations`` (from/value messages ending with a
  human turn), ``chosen`` and ``rejected`` (one ``{"from": "gpt", "value": ...}`` message
  each), optional ``system``.

A response that is empty (or only whitespace), or a chosen response equal to the rejected
one, is an ``InputError`` naming the row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

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
PreferenceFormat = Literal["pairwise", "alpaca", "sharegpt"]
PREFERENCE_KEYS: dict[str, dict[str, str]] = {
    "pairwise": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "role": "role", "content": "content"},
    "alpaca": {"instruction": "instruction", "input": "input", "chosen": "chosen", "rejected": "rejected", "system": "system", "history": "history"},
    "sharegpt": {"conversations": "conversations", "chosen": "chosen", "rejected": "rejected", "system": "system", "from": "from", "value": "value"},
}
PREFERENCE_COLUMNS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "pairwise": (("chosen", "rejected"), ("prompt",)),
    "alpaca": (("instruction", "chosen", "rejected"), ("input", "system", "history")),
    "sharegpt": (("conversations", "chosen", "rejected"), ("system",)),
}
MESSAGE_ROLES = {r: r for r in ("system", "user", "assistant")}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


def resolve_keys(fmt: str, key_map: Mapping[str, str] | None, preference: bool = False) -> dict[str, str]:
    """The record keys of layout ``fmt`` (a preference layout when ``preference``) after
    renaming by ``key_map``."""
    layouts = PREFERENCE_KEYS if preference else DEFAULT_KEYS
    if fmt not in layouts:
        kind = "preference" if preference else "instruction"
        raise InputError(f"unknown {kind} format {fmt!r}; expected one of {', '.join(layouts)}")
    keys = dict(layouts[fmt])
    unknown = sorted(set(key_map or {}) - set(keys))
    if unknown:
        raise InputError(f"--map-keys: {unknown} are not keys of the {fmt} format; its keys are {sorted(keys)}")
    keys.update(key_map or {})
    return keys


def record_columns(fmt: str, keys: Mapping[str, str], preference: bool = False) -> tuple[list[str], list[str]]:
    """(required, optional) record columns of layout ``fmt`` (a preference layout when
    ``preference``) under ``keys``."""
    required, optional = (PREFERENCE_COLUMNS if preference else COLUMNS)[fmt]
    return [keys[k] for k in required], [keys[k] for k in optional]


def to_messages(fmt: str, record: Mapping[str, Any], keys: Mapping[str, str], where: str) -> list[Message]:
    """The conversation in ``record``; ``where`` ("data.jsonl: line 7") prefixes errors."""
    if fmt == "alpaca":
        messages = _alpaca_prompt(record, keys, where)
        messages.append({"role": "assistant", "content": _text(record[keys["output"]], where, keys["output"])})
    elif fmt == "sharegpt":
        messages = _sharegpt(record, keys, where)
    else:
        messages = _listed(record[keys["messages"]], where, keys["messages"], keys["role"], keys["content"], MESSAGE_ROLES)
    _check_turns(messages, where)
    return messages


class Pair(NamedTuple):
    """A preference pair: the prompt conversation and the two assistant responses."""

    prompt: list[Message]
    chosen: Message
    rejected: Message


def to_pair(fmt: str, record: Mapping[str, Any], keys: Mapping[str, str], where: str) -> Pair:
    """The preference pair in ``record`` (layout ``fmt`` of ``PREFERENCE_KEYS``); ``where``
    prefixes errors."""
    if fmt == "pairwise":
        pair = _pairwise(record, keys, where)
    else:
        if fmt == "alpaca":
            prompt = _alpaca_prompt(record, keys, where)
            chosen, rejected = ({"role": "assistant", "content": _text(record[keys[k]], where, keys[k])} for k in ("chosen", "rejected"))
        else:
            prompt = _sharegpt(record, keys, where)
            chosen, rejected = (
                _message(record[keys[k]], where, keys[k], keys["from"], keys["value"], SHAREGPT_ROLES) for k in ("chosen", "rejected")
            )
        pair = Pair(prompt, chosen, rejected)
    _check_pair(pair, keys, where)
    return pair


def _pairwise(record: Mapping[str, Any], keys: Mapping[str, str], where: str) -> Pair:
    role, content = keys["role"], keys["content"]
    prompt = record.get(keys["prompt"])
    if prompt is None:  # TRL's implicit prompt: two conversations that differ in their last message
        chosen, rejected = (record[keys[k]] for k in ("chosen", "rejected"))
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise InputError(
                f"{where}: no {keys['prompt']!r}, so {keys['chosen']!r} and {keys['rejected']!r} must be conversations "
                f"(lists of {role}/{content} messages) sharing their prompt, got {type(chosen).__name__} and {type(rejected).__name__}"
            )
        chosen = _listed(chosen, where, keys["chosen"], role, content, MESSAGE_ROLES)
        rejected = _listed(rejected, where, keys["rejected"], role, content, MESSAGE_ROLES)
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == len(chosen) == len(rejected):
            raise InputError(f"{where}: {keys['chosen']!r} and {keys['rejected']!r} are the same conversation, so there is no preference to learn")
        if not len(chosen) == len(rejected) == shared + 1:
            raise InputError(
                f"{where}: without {keys['prompt']!r}, {keys['chosen']!r} and {keys['rejected']!r} must share every message "
                f"but the last (the prompt, then one response each); they share {shared} of {len(chosen)} and {len(rejected)} messages"
            )
        return Pair(chosen[:shared], chosen[-1], rejected[-1])
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = _listed(prompt, where, keys["prompt"], role, content, MESSAGE_ROLES)
    return Pair(messages, *(_response(record[keys[k]], where, keys[k], role, content) for k in ("chosen", "rejected")))


def _response(value: Any, where: str, key: str, role_key: str, content_key: str) -> Message:
    """A pairwise response: text, or a list holding one assistant message."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, list) and len(value) == 1:
        return _listed(value, where, key, role_key, content_key, MESSAGE_ROLES)[0]
    raise InputError(f"{where}: {key!r} must be text or a list of one assistant message, got {_shown(value)}")


def _check_pair(pair: Pair, keys: Mapping[str, str], where: str) -> None:
    for name, response in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        if response["role"] != "assistant":
            raise InputError(f"{where}: {keys[name]!r} must be an assistant message, got role {response['role']!r}")
        if not response["content"].strip():
            raise InputError(f"{where}: {keys[name]!r} is an empty response")
    if not pair.prompt or pair.prompt[-1]["role"] != "user":
        order = " -> ".join(m["role"] for m in pair.prompt) or "no message"
        raise InputError(f"{where}: the prompt must end with a user message (got {order})")
    if pair.chosen["content"] == pair.rejected["content"]:
        raise InputError(f"{where}: {keys['chosen']!r} and {keys['rejected']!r} are the same response, so there is no preference to learn")
    _check_turns([*pair.prompt, pair.chosen], where)


def _text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: {key!r} holds {type(value).__name__}, expected text")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _alpaca_prompt(record: Mapping[str, Any], keys: Mapping[str, str], where: str) -> list[Message]:
    """The system message, history turns and user message of an alpaca record."""
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
    return messages


def _sharegpt(record: Mapping[str, Any], keys: Mapping[str, str], where: str) -> list[Message]:
    """The conversation of a sharegpt record, its ``system`` column as the first message."""
    messages = _listed(record[keys["conversations"]], where, keys["conversations"], keys["from"], keys["value"], SHAREGPT_ROLES)
    system = record.get(keys["system"])
    if system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": _text(system, where, keys["system"])})
    return messages


def _listed(turns: Any, where: str, list_key: str, role_key: str, content_key: str, roles: Mapping[str, str]) -> list[Message]:
    if not isinstance(turns, list):
        raise InputError(f"{where}: {list_key!r} holds {type(turns).__name__}, expected a list of messages")
    return [_message(turn, where, f"{list_key}[{i}]", role_key, content_key, roles) for i, turn in enumerate(turns)]


def _message(turn: Any, where: str, name: str, role_key: str, content_key: str, roles: Mapping[str, str]) -> Message:
    if not isinstance(turn, Mapping) or role_key not in turn or content_key not in turn:
        raise InputError(f"{where}: {name} must be an object with {role_key!r} and {content_key!r}, got {turn!r}")
    role = turn[role_key]
    if role not in roles:
        raise InputError(f"{where}: {name}: role {role!r} is not one of {sorted(roles)}")
    return {"role": roles[role], "content": _text(turn[content_key], where, f"{name}.{content_key}")}


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
