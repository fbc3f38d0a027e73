"""Reward functions of the GRPO tests, importable by name (``grpo_rewards:parity``) in the
reward workers and by TRL in the test process: deterministic functions of the completion's
token ids, with TRL's reward-function signature."""

from __future__ import annotations


def parity(prompts: list, completions: list, completion_ids: list[list[int]], **columns: list) -> list[float]:
    """A reward in [0, 1) that differs between most completions of a group."""
    return [(sum(ids) * 7 + len(ids)) % 11 / 11 for ids in completion_ids]


def length(prompts: list, completions: list, completion_ids: list[list[int]], **columns: list) -> list[float]:
    """Shorter is better."""
    return [1.0 / len(ids) for ids in completion_ids]
