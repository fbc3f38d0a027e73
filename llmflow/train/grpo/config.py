"""The ``rl:`` section of a ``method: grpo`` training config: TRL 1.16's ``GRPOConfig`` names
and defaults, with llmflow's own settings for the rollouts and rewards."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmflow.train.grpo.rewards import RewardConfig


class RLConfig(BaseModel):
    """Online reinforcement learning on verifiable rewards: GRPO and its kin (DAPO, Dr. GRPO,
    GSPO, BNPO), as TRL's GRPOTrainer defines them."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """How token losses are aggregated. grpo: each completion's mean over its tokens, then the
    mean over the step's completions (length-biased); bnpo: the mean over the tokens of each
    rank's micro-batch (depends on the layout, as in TRL); dr_grpo: the sum over the step's
    tokens divided by completions x max_completion_length (Dr. GRPO); dapo (the default): the
    sum over the step's tokens divided by the generation batch's tokens per step (DAPO)."""
    beta: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL estimate to the reference model (the initial weights; under LoRA the
    base with the adapters off). 0 (the default) holds no reference model."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token KL by the importance ratio, making its gradient the unbiased
    reverse-KL gradient (TRL's default since 1.10; DeepSeek-V3.2)."""
    epsilon: float = Field(default=0.2, gt=0)
    """Lower clipping bound of the importance ratio: 1 - epsilon."""
    epsilon_high: float | None = Field(default=None, gt=0)
    """Upper clipping bound: 1 + epsilon_high (DAPO's clip-higher recommends 0.28); default epsilon."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: one importance ratio per token; sequence: one per completion, the exponent of
    its mean per-token log-ratio (GSPO)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the reward's standard deviation within each prompt's group (group),
    over the whole generation batch (batch), or not at all (none, Dr. GRPO)."""
    num_generations: int = Field(default=8, ge=2)
    """Completions sampled per prompt (a group); global_batch_size must be a multiple of it."""
    num_iterations: int = Field(default=1, ge=1)
    """Optimizer passes over each generation batch (mu in the GRPO paper); after the first the
    policy has moved from the one that sampled, and the importance ratio clips."""
    steps_per_generation: int = Field(default=1, ge=1)
    """Optimizer steps each generation batch is split into (global_batch_size completions each):
    one rollout serves steps_per_generation x num_iterations steps. TRL counts this in
    micro-batches of one device (default its gradient accumulation); llmflow counts optimizer
    steps, so that a layout change leaves the run's batches as they are."""
    max_completion_length: int = Field(default=512, ge=1)
    """Most tokens sampled per completion; longer ones are cut (truncated)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; the log-probs of the loss are those of the logits divided by it, as in TRL."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(default=0, ge=0)
    """Sample from the k most likely tokens only; 0 keeps all."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length (no eos) out of the loss (DAPO)."""
    soft_punish_cache: int | None = Field(default=None, ge=1)
    """DAPO's soft overlong punishment, added as a reward of weight 1: 0 up to
    max_completion_length - soft_punish_cache tokens, then falling linearly to -1 at
    max_completion_length, and -1 beyond (TRL's get_soft_overlong_punishment)."""
    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(function="gsm8k_flexible")],
                                        min_length=1)
    """Reward functions, added up by weight: built in (gsm8k_strict, gsm8k_flexible, math_verify,
    code, format, think_format, qa_match) or a user's module:function with TRL's reward-function
    signature."""
    reward_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds one reward function may take on one completion; a reward that takes longer
    stops the step, naming the function and the row."""
    reward_workers: int = Field(default=2, ge=1)
    """Processes that run the reward functions."""
    template: str = "tokenizer"
    """Chat template the prompts are rendered with: "tokenizer" for the tokenizer's own, or
    alpaca, chatml, qwen, llama2, llama3."""
    rollout_batch_size: int | None = Field(default=None, ge=1)
    """Completions each rank generates at once (the KV cache holds this many rows); default all
    of the rank's completions of the generation batch."""
    logged_completions: int = Field(default=8, ge=0)
    """Completions of each logged step shown in MLflow's table (every rollout is written to
    the run directory's rollouts/ either way)."""

    @model_validator(mode="after")
    def _punishment_fits(self) -> RLConfig:
        if self.soft_punish_cache is not None and self.soft_punish_cache > self.max_completion_length:
            raise ValueError(f"rl.soft_punish_cache={self.soft_punish_cache} exceeds rl.max_completion_length="
                             f"{self.max_completion_length}")
        return self

    @property
    def clip_high(self) -> float:
        """The upper clipping epsilon."""
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon
