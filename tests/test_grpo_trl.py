"""``method: grpo`` against TRL 1.16's ``GRPOTrainer`` on the same tiny random Qwen2 (fp32),
with the completions pinned on both sides (TRL's ``rollout_func``; ours replaces the sampler
of ``llmflow.train.objectives.grpo``) and deterministic rewards of the completions' ids
(``tests/grpo_rewards.py``, run by llmflow's reward workers and by TRL in-process).

Both train 3 optimizer steps with AdamW (epsilon 1e-4, see ``ADAM_EPS``) at a constant learning rate of 0.02, ``num_iterations:
2`` (steps 1 and 2 on generation 0, step 3 on generation 1), so the second step's importance
ratios move away from 1 and clip; one micro-batch per step on one process (TRL's
per_device_train_batch_size = the step's completions). TRL's dataset holds the prompts in the
order llmflow's seeded prompt order visits them, unshuffled. Compared: every completion's
advantage, each step's loss, kl and clip ratios (TRL's logged metrics), and every parameter
after the 3 steps. One case is on-policy (``num_iterations: 1``, a generation per step), where
both sides skip the scoring forward; its entropy is compared too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from llmflow.train.config import TrainConfig
from llmflow.train.data import ShuffledEpochs
from llmflow.train.grpo.prompts import read_prompt_rows, render_prompts
from llmflow.train.objectives import grpo as grpo_objective

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

ATOL = 1e-5
"""Largest |difference| of an advantage, a parameter element or a logged metric (fp32; a
metric above 1 relative to its size)."""
SEED = 1234
ADAM_EPS = 1e-4
"""AdamW's epsilon on both sides: at the default 1e-8, Adam's first steps move an element by
about the learning rate whatever its gradient's size, so the float32 noise of a gradient near
zero (1e-9 where the two forwards round differently) moves it by up to 4e-5."""
PROMPTS = 8
GENERATIONS = 4
BATCH = 8  # completions per step: 2 prompts x 4 generations
MAX_COMPLETION = 10
IM_END, PAD = 868, 866


def pinned(prompt_ids: list[int], j: int) -> list[int]:
    """The j-th pinned completion of a prompt: 3 to 10 ids, ending with <|im_end|> unless its
    length is the limit (a truncated completion)."""
    h = sum((i + 1) * t for i, t in enumerate(prompt_ids))
    length = 3 + (h + 5 * j) % (MAX_COMPLETION - 2)
    body = [300 + (h * 31 + j * 17 + 13 * k) % 400 for k in range(length)]
    return body if length == MAX_COMPLETION else [*body[:-1], IM_END]


def truncated(ids: list[int]) -> bool:
    return ids[-1] not in (IM_END, PAD)


@pytest.fixture(scope="module")
def assets(sample_assets, sample_tokenizer_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grpo-trl")
    lines = (sample_assets() / "rl" / "rl_train.jsonl").read_text().splitlines(keepends=True)[:PROMPTS]
    (root / "prompts.jsonl").write_text("".join(lines))
    model = sample_tokenizer_model("qwen2", max_position_embeddings=256)
    return {"model": model, "prompts": root / "prompts.jsonl", "root": root}


def ours(assets, out: Path, rl: dict, lora: dict | None, monkeypatch) -> tuple[dict[str, torch.Tensor], list, list, dict]:
    """Three steps of llmflow's GRPO in this process: the parameters after them, each step's
    metrics, every completion's advantage and the initial LoRA adapters."""
    from llmflow.train.loop import setup, train_step

    def sample_rows(self, run, index, order, rows):
        return {c: (pinned(rows[c].prompt_ids, c % GENERATIONS), [0.0] * len(pinned(rows[c].prompt_ids, c % GENERATIONS)),
                    truncated(pinned(rows[c].prompt_ids, c % GENERATIONS))) for c in order}

    monkeypatch.setattr(grpo_objective.Grpo, "sample_rows", sample_rows)
    shutil.rmtree(out, ignore_errors=True)
    config = TrainConfig.model_validate({
        "model": str(assets["model"]), "out": str(out), "method": "grpo",
        "data": {"kind": "prompts", "paths": [str(assets["prompts"])]}, "steps": 3, "seed": SEED,
        "micro_batch_size": BATCH, "global_batch_size": BATCH, "lora": lora,
        "optim": {"lr": 0.02, "decay": "constant", "betas": [0.9, 0.999], "eps": ADAM_EPS, "clip_grad": 1.0},
        "rl": {"num_generations": GENERATIONS, "num_iterations": 2, "max_completion_length": MAX_COMPLETION,
               "rewards": [{"function": "grpo_rewards:parity"}, {"function": "grpo_rewards:length", "weight": 0.5}],
               "template": "chatml", **rl},
    })
    run = setup(config)
    initial = {name: p.detach().clone() for name, p in run.parts[0].named_parameters() if "lora_" in name}
    metrics, advantages = [], []
    try:
        for step in (1, 2, 3):
            loss, _, _ = train_step(run, step)
            metrics.append(run.metrics | {"loss": loss})
            if step in (1, 3):
                advantages += [float(b["advantages"][i]) for part in run.objective.generation.batches
                               for b in part for i in range(len(b["advantages"]))]
    finally:
        run.objective.close()
    return {name: p.detach().clone() for name, p in run.parts[0].named_parameters()}, metrics, advantages, initial


def peft_name(name: str) -> str:
    """A LoRA parameter's PEFT name: ``model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``."""
    return "base_model.model." + name.replace(".weight", ".default.weight") if "lora_" in name else name


def theirs(assets, out: Path, rl: dict, lora: dict | None, adapters: dict) -> tuple[dict[str, torch.Tensor], list, list]:
    """The same three steps with TRL's GRPOTrainer (under LoRA, PEFT's adapters start from ours)."""
    import grpo_rewards
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = read_prompt_rows(assets["prompts"])
    render_prompts(rows, assets["model"], "chatml")
    order = ShuffledEpochs(len(rows), SEED)
    visited = [rows[order.item(g)] for g in range(len(rows))]
    ids = {row.prompt: row.prompt_ids for row in rows}

    def rollout(prompts, trainer):
        prompt_ids = [ids[p] for p in prompts]
        completions = [pinned(p, i % GENERATIONS) for i, p in enumerate(prompt_ids)]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": [[0.0] * len(c) for c in completions]}

    peft = None
    if lora is not None:
        from peft import LoraConfig

        peft = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, seed=SEED, per_device_train_batch_size=BATCH,
        num_generations=GENERATIONS, max_steps=3, learning_rate=0.02, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", shuffle_dataset=False,
        max_completion_length=MAX_COMPLETION, reward_weights=[1.0, 0.5], optim="adamw_torch",
        adam_epsilon=ADAM_EPS, dataloader_num_workers=0, **({"num_iterations": 2} | rl),
    )
    trainer = GRPOTrainer(
        model=str(assets["model"]), reward_funcs=[grpo_rewards.parity, grpo_rewards.length], args=args,
        train_dataset=Dataset.from_list([{"prompt": row.prompt} for row in visited]),
        processing_class=AutoTokenizer.from_pretrained(assets["model"]), rollout_func=rollout, peft_config=peft,
    )
    if lora is not None:
        own = dict(trainer.model.named_parameters())
        with torch.no_grad():
            for name, value in adapters.items():
                own[peft_name(name)].copy_(value)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return params, logged, list(trainer._logs["advantages"])


CASES = {
    "dapo": {"loss_type": "dapo"},
    "grpo-kl": {"loss_type": "grpo", "beta": 0.04},
    "bnpo-sequence-batch": {"loss_type": "bnpo", "importance_sampling_level": "sequence", "scale_rewards": "batch"},
    "dr_grpo-none": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "gspo-kl": {"loss_type": "dapo", "importance_sampling_level": "sequence", "beta": 0.04},
    "grpo-sequence-none": {"loss_type": "grpo", "importance_sampling_level": "sequence", "scale_rewards": "none"},
    "dapo-clip-higher-masked": {"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True},
    "bnpo-kl-batch": {"loss_type": "bnpo", "beta": 0.04, "scale_rewards": "batch", "temperature": 0.8},
    "on-policy-kl": {"loss_type": "grpo", "beta": 0.04, "num_iterations": 1, "temperature": 0.8},
}
"""Every case but ``on-policy-kl`` trains two steps on each generation (``num_iterations`` 2).
On-policy, both sides skip the scoring forward: the ratio is taken against the loss forward's
own detached log-probs (1 everywhere, nothing clips), and that forward's entropy is logged."""
METRICS = ("loss", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
           "clip_ratio/high_max")


def compare(mine, trl, rl: dict, lora: dict | None) -> None:
    our_params, our_metrics, our_advantages, _ = mine
    trl_params, trl_metrics, trl_advantages = trl
    # TRL keeps the completions of its last logging window: generation 1's.
    np.testing.assert_allclose(our_advantages[-BATCH:], trl_advantages, atol=ATOL, rtol=0)
    assert len(trl_metrics) == 3
    on_policy = rl.get("num_iterations") == 1
    for step, (a, b) in enumerate(zip(our_metrics, trl_metrics, strict=True), start=1):
        for name in METRICS + (("kl",) if rl.get("beta") else ()) + (("entropy",) if on_policy else ()):
            # relative past 1: the kl of a policy far from its reference reaches 10 and more
            assert abs(a[name] - b[name]) <= ATOL * max(1.0, abs(b[name])), (step, name, a[name], b[name])
    if on_policy:
        assert all(m["clip_ratio/region_mean"] == 0 for m in our_metrics)
    else:
        assert any(m["clip_ratio/region_mean"] > 0 for m in our_metrics), "no ratio was clipped: the check is too weak"
    trained = [name for name in our_params if lora is None or "lora_" in name]
    assert trained
    for name in trained:
        torch.testing.assert_close(our_params[name], trl_params[peft_name(name)], atol=ATOL, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_grpo_matches_trl(assets, case, monkeypatch):
    rl = CASES[case]
    compare(ours(assets, assets["root"] / f"ours-{case}", rl, None, monkeypatch),
            theirs(assets, assets["root"] / f"trl-{case}", rl, None, {}), rl, None)


def test_lora_grpo_matches_peft(assets, monkeypatch):
    """LoRA on every attention and MLP projection against TRL with PEFT's adapters (started
    from ours), the KL to the reference (the base, adapters off, on both sides) included."""
    rl, lora = {"loss_type": "dapo", "beta": 0.04}, {"rank": 4, "alpha": 8}
    mine = ours(assets, assets["root"] / "ours-lora", rl, lora, monkeypatch)
    compare(mine, theirs(assets, assets["root"] / "trl-lora", rl, lora, mine[3]), rl, lora)
