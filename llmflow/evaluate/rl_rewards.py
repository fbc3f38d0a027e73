"""The held-out reward stage of online RL: a model's greedy completion of every prompt of a
held-out prompt file (GRPO's layouts, rendered with its chat template), scored by the run's
reward functions. What the finetune-eval flow measures before and after GRPO.

``{out}/completions.jsonl`` holds one line per prompt (where, prompt, completion, each reward),
``manifest.json`` (written last) the scores: ``reward`` (the weighted reward's mean) and
``reward_accuracy`` (the share of prompts whose every applicable reward is 1.0: for a
verifier such as gsm8k_flexible, the share answered right).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.infer.batch import generate_batches
from llmflow.infer.generate import GenerateConfig
from llmflow.infer.generator import load_generator
from llmflow.runtime import detect_device_type
from llmflow.train.grpo.config import RLConfig
from llmflow.train.grpo.prompts import read_prompt_rows, render_prompts
from llmflow.train.grpo.rewards import RewardScorer, weighted

STAGE = "heldout-rewards"
COMPLETIONS = "completions.jsonl"


class HeldoutRewardsConfig(BaseModel):
    """Score a model's greedy completions of held-out prompts with reward functions."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: Path
    """Hugging Face model directory or checkpoint."""
    prompts: Path
    """JSON-lines or parquet prompts with their answers, in a layout GRPO reads."""
    out: Path
    """Output directory: completions.jsonl and manifest.json (replaced as a whole)."""
    rl: RLConfig = RLConfig()
    """The GRPO settings whose rewards, reward time limit, chat template and
    max_completion_length the scoring uses."""
    batch_size: int = Field(default=16, ge=1)
    """Prompts generated together (greedy: the completions do not depend on it)."""


def heldout_rewards(config: HeldoutRewardsConfig) -> Path:
    """Generate and score; writes ``config.out`` and returns it."""
    rl = config.rl
    rows = read_prompt_rows(config.prompts)
    generator = load_generator(config.model, detect_device_type())
    prompts = render_prompts(rows, generator.tokenizer_dir, rl.template)
    results = generate_batches(generator, prompts, GenerateConfig(max_new_tokens=rl.max_completion_length),
                               config.batch_size)
    with RewardScorer(rl.rewards, rl.reward_timeout_s, rl.reward_workers) as scorer:
        matrix = scorer.score([row.prompt for row in rows], [r.text for r in results], [r.tokens for r in results],
                              [row.reward_columns() for row in rows],
                              [row.where for row in rows])
    total = weighted(matrix, scorer.weights)
    correct = np.all(np.isnan(matrix) | (matrix == 1.0), axis=1) & ~np.isnan(matrix).all(axis=1)
    scores = {"reward": float(np.nanmean(total)), "reward_accuracy": float(correct.mean()), "prompts": len(rows)}
    out = Path(config.out).expanduser().resolve()
    with atomic_directory(out) as work:
        with open(work / COMPLETIONS, "w", encoding="utf-8") as f:
            for row, result, rewards in zip(rows, results, matrix, strict=True):
                record = {"where": row.where, "prompt": row.prompt, "completion": result.text,
                          "rewards": dict(zip(scorer.functions, rewards.tolist(), strict=True))}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        write_json_atomic(work / MANIFEST, manifest_payload(
            STAGE, config.model_dump(mode="json"), [file_record(work / COMPLETIONS, work)], **scores))
    return out
