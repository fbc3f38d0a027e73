"""``method: grpo`` checked before launch: every problem of the prompts, the rewards, the
batch and the layout reported at once, one line each, before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmflow.mesh import ParallelLayout
from llmflow.models import ModelConfig
from llmflow.train.config import TrainConfig, load_train_config
from llmflow.train.objectives import objective_for
from llmflow.train.preflight import PreflightError, check_training


@pytest.fixture(scope="module")
def assets(sample_assets) -> dict[str, Path]:
    sample = sample_assets()
    return {"model": sample / "model", "prompts": sample / "rl" / "rl_train.jsonl"}


def config(assets, out: Path, **overrides) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": str(assets["model"]), "out": str(out), "method": "grpo",
        "data": {"kind": "prompts", "paths": [str(assets["prompts"])]}, "steps": 2,
        "micro_batch_size": 4, "global_batch_size": 8, "rl": {"num_generations": 4, "max_completion_length": 16},
        **overrides,
    })


def problems(cfg: TrainConfig, nproc: int = 1) -> list[str]:
    with pytest.raises(PreflightError) as caught:
        check_training(cfg, nproc, report=lambda _: None)
    return caught.value.problems


def test_a_good_config_passes_and_plans_the_rollout(assets, tmp_path):
    plan = check_training(config(assets, tmp_path / "run", rl={"num_generations": 4, "max_completion_length": 16,
                                                                 "beta": 0.04}), 1, report=lambda _: None)
    names = [term.name for term in plan.terms]
    assert any(name.startswith("rollout KV cache") for name in names)
    assert any(name.startswith("reference model (beta > 0)") for name in names)


def test_grpo_needs_prompts_and_whole_groups():
    with pytest.raises(ValueError, match="method=grpo trains on data.kind prompts"):
        load_train_config(None, ["model=m", "out=o", "method=grpo", "steps=1", "data.kind=sft", "data.paths=[d]"])
    with pytest.raises(ValueError, match="global_batch_size=6 must be a multiple of rl.num_generations=4"):
        load_train_config(None, ["model=m", "out=o", "method=grpo", "steps=1", "data.kind=prompts", "data.paths=[d]",
                                 "global_batch_size=6", "rl.num_generations=4"])


def test_every_problem_of_prompts_rewards_and_layout_at_once(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n"
                   + json.dumps({"question": "", "answer": "3"}) + "\n")
    cfg = config(assets, tmp_path / "run", data={"kind": "prompts", "paths": [str(bad)]}, pp=2,
                 rl={"num_generations": 4, "rewards": [{"function": "gsm8k_flexible"}, {"function": "nowhere:reward"},
                                                       {"function": "gsm8k_strictly"}]})
    found = problems(cfg, nproc=2)
    assert any("method grpo: pp=2 is not supported; GRPO's rollouts run at dp, tp and ep" in p for p in found), found
    assert any(str(bad) in p and "line 2" in p for p in found), found
    assert any(p.startswith("reward nowhere:reward: cannot import nowhere") for p in found), found
    assert any(p.startswith("reward gsm8k_strictly: not a built-in reward") for p in found), found


def test_a_prompt_that_leaves_no_room_for_the_completion_is_named(assets, tmp_path):
    context = json.loads((assets["model"] / "config.json").read_text())["max_position_embeddings"]
    found = problems(config(assets, tmp_path / "run", rl={"num_generations": 4, "max_completion_length": context - 8}))
    assert found and all("over max_prompt_tokens 8" in p and "rl.max_completion_length" in p for p in found), found
    assert any("rl_train.jsonl: line 1:" in p for p in found), found


def test_tensor_parallel_rollouts_of_a_model_with_linear_attention_are_refused(assets, tmp_path):
    """A decoding step under tp feeds copies of its token that attention takes back out of its
    KV cache and a Gated DeltaNet's recurrent state cannot: a Qwen3.5 at tp=2 is refused in one
    line, the same model at dp=2 is not."""
    model = ModelConfig.from_hf({"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
                                 "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16})
    cfg = config(assets, tmp_path / "run")
    grpo = objective_for("grpo")
    assert grpo.problems(cfg, ParallelLayout.of_world(2, tp=2), model) == [
        "method grpo: tp=2 rollouts need attention layers only, and qwen3_5_text has linear-attention layers; use dp or ep"]
    assert grpo.problems(cfg, ParallelLayout.of_world(2), model) == []
