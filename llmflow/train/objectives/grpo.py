"""GRPO and its kin (DAPO, Dr. GRPO, GSPO, BNPO): online reinforcement learning on verifiable
rewards, inside the training job (``llmflow.train.grpo`` holds the rollouts, rewards,
prompts and the loss's math).

A generation batch is ``global_batch_size x steps_per_generation`` completions: prompts
``[g P, (g + 1) P)`` of the seeded prompt order (P = that / ``num_generations``), each sampled
``num_generations`` times in a row, completion c's group the ``num_generations`` around it.
It serves ``steps_per_generation x num_iterations`` optimizer steps: step part p takes
completions ``[p G, (p + 1) G)`` (G the global batch), split over micro-batches and
data-parallel ranks as samples are, and each rank samples the completions it trains on
(``llmflow.train.grpo.rollout``). Rewards are gathered over the ranks for the group
advantages; then each rank scores its completions with the trainer's forward (the "old"
log-probs, the entropy, and under ``beta > 0`` the reference's) and keeps that buffer in
``{out}/rollouts/`` with the generation's record, so that a run resumed inside a generation
trains on what the uninterrupted run trained on.

On-policy (one step per generation, ``num_iterations`` 1, TRL's default) the weights that
sampled are the weights the step differentiates, so the scoring forward is skipped, as in
TRL: the old log-probs are the loss forward's own, detached (every ratio 1), and that forward
also gives the entropy and the sampler-vs-trainer difference.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llmflow.data.tokenizer import eos_token_ids, load_tokenizer
from llmflow.models.blocks.rotary import positions_from_documents
from llmflow.models.config import ModelConfig, text_config
from llmflow.models.lora import adapters_off
from llmflow.train.config import TrainConfig
from llmflow.train.data import ShuffledEpochs
from llmflow.train.grpo.loss import (
    CLIP_SUMS,
    StepCounts,
    aggregate,
    clip_statistics,
    group_advantages,
    nanstd,
    token_terms,
)
from llmflow.train.grpo.prompts import PromptRow, read_prompt_rows, render_prompts
from llmflow.train.grpo.rewards import RewardScorer
from llmflow.train.grpo.rollout import SamplerSettings, sample
from llmflow.train.objectives.base import Objective
from llmflow.train.run import Batch, Run, all_reduce_over, frozen_model, model_inputs, rank_sum_scale
from llmflow.weights import latest_step_dir, tokenizer_dir

LAYOUTS = "dp, tp and ep (with LoRA or full weights)"
"""The layouts GRPO's rollouts run in."""
OVERLONG = "soft_overlong_punishment"
ROLLOUTS = "rollouts"


class PromptSet:
    """A GRPO run's prompts, rendered with the run's chat template, visited in a seeded order
    that is redrawn every epoch."""

    def __init__(self, config: TrainConfig) -> None:
        path = Path(config.data.paths[0])
        self.rows = read_prompt_rows(path)
        tokenizer = tokenizer_dir(config.model)
        if tokenizer is None:
            raise FileNotFoundError(f"model {config.model}: no tokenizer (tokenizer.json) beside it")
        render_prompts(self.rows, tokenizer, config.rl.template)
        self.num_samples = len(self.rows)
        self.seq_length = max(len(row.prompt_ids) for row in self.rows) + config.rl.max_completion_length
        """The longest prompt and completion together."""
        self._order = ShuffledEpochs(self.num_samples, config.seed)

    def __getitem__(self, g: int) -> PromptRow:
        return self.rows[self._order.item(g)]


@dataclass
class Generation:
    """This rank's share of one generation batch, ready to train on."""

    index: int
    batches: list[list[Batch]]
    """[step part][micro-batch]: completion batches with their advantages and log-probs."""
    tokens_per_step: float
    """The generation batch's counted completion tokens over its steps (dapo's normaliser)."""
    metrics: dict[str, float]
    """The generation's rewards and lengths, with the entropy and sampler drift of its scoring
    forward when it has one (TRL's names)."""


def completion_seed(seed: int, generation: int, completion: int) -> int:
    """The sampling seed of completion ``completion`` of generation ``generation``."""
    return int(np.random.SeedSequence([seed, generation, completion]).generate_state(1)[0])


def completion_batch(prompts: list[list[int]], completions: list[list[int]], multiple: int = 1) -> Batch:
    """Prompt-and-completion rows, right-padded (the padding a document of its own) to a
    multiple of ``multiple`` positions, whose targets are the completion tokens."""
    sequences = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = -(-max(len(s) for s in sequences) // multiple) * multiple
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    targets = torch.full_like(input_ids, -100)
    documents = torch.ones_like(input_ids)
    for i, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        ids = torch.tensor(sequence)
        input_ids[i, :len(sequence)] = ids
        documents[i, :len(sequence)] = 0
        targets[i, len(prompt) - 1:len(sequence) - 1] = ids[len(prompt):]
    return {"input_ids": input_ids, "targets": targets, "document_ids": documents,
            "position_ids": positions_from_documents(documents)}


def scatter_tokens(values: list[list[float]], targets: torch.Tensor) -> torch.Tensor:
    """Per-completion token values placed at their target positions of ``targets`` [B, W] (0 elsewhere)."""
    out = torch.zeros(targets.shape, dtype=torch.float32)
    for i, row in enumerate(values):
        out[i, (targets[i] != -100).nonzero().squeeze(1)] = torch.tensor(row, dtype=torch.float32)
    return out


class Grpo(Objective):
    """``method: grpo`` with ``config.rl``'s settings (TRL's GRPOTrainer)."""

    token_losses = True
    loss_over_cp = False

    def __init__(self) -> None:
        self.generation: Generation | None = None
        self.scorer: RewardScorer | None = None
        self.reference: Any = None
        """beta > 0 with full weights: the frozen initial model, sharded as the policy."""
        self.counts: StepCounts | None = None
        self.stats: list[torch.Tensor] = []
        self.extremes: list[torch.Tensor] = []
        self.sampled: list[tuple[torch.Tensor, torch.Tensor]] = []
        """On-policy: each micro-batch's ``sampler_sums`` from the loss forward."""
        self.started = 0.0

    def samples(self, config: TrainConfig) -> PromptSet:
        return PromptSet(config)

    def problems(self, config: TrainConfig, layout: Any, model: ModelConfig | None) -> list[str]:
        unsupported = [f"{name}={size}" for name, size in (("pp", layout.pp), ("cp", layout.cp)) if size > 1]
        if unsupported:
            return [f"method grpo: {', '.join(unsupported)} is not supported; GRPO's rollouts run at {LAYOUTS}"]
        linear = model is not None and any(model.is_linear_layer(i) for i in range(model.num_hidden_layers))
        if layout.tp > 1 and linear:
            # A decoding step under tp also feeds tp - 1 copies of the token (rollout.py); attention
            # takes them back out of its KV cache, a linear-attention layer's recurrent state cannot.
            return [(f"method grpo: tp={layout.tp} rollouts need attention layers only, and {model.model_type} "
                     "has linear-attention layers; use dp or ep")]
        return []

    def model_kwargs(self) -> dict[str, Any]:
        return {**self.scoring(), "return_entropy": self.on_policy}

    def scoring(self) -> dict[str, Any]:
        """The forward's keyword arguments that score completions as the sampler drew them."""
        return {"temperature": self._rl.temperature}

    @property
    def on_policy(self) -> bool:
        """Whether every step trains on a generation sampled by its own weights."""
        return self._rl.num_iterations == 1 and self._rl.steps_per_generation == 1

    def prepare(self, run: Run) -> None:
        self._rl = run.config.rl
        self.scorer = RewardScorer(self._rl.rewards, self._rl.reward_timeout_s, self._rl.reward_workers)
        self.scorer.start()
        tok_dir = tokenizer_dir(run.config.model)
        self.tokenizer = load_tokenizer(tok_dir)
        self.sampler = SamplerSettings(
            max_new_tokens=self._rl.max_completion_length, temperature=self._rl.temperature, top_p=self._rl.top_p,
            top_k=self._rl.top_k, eos_token_ids=tuple(eos_token_ids(tok_dir, run.meta.hf_config)),
            vocab_size=int(text_config(run.meta.hf_config)["vocab_size"]))
        if self._rl.beta and run.config.lora is None:
            self.reference = frozen_model(run)

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()

    # --- the step ---------------------------------------------------------------------------------

    def micro_batches(self, run: Run, step: int) -> list[Batch]:
        rl = self._rl
        per_generation = rl.steps_per_generation * rl.num_iterations
        index = (step - 1) // per_generation
        if self.generation is None or self.generation.index != index:
            starts = (step - 1) % per_generation == 0
            self.generation = ((None if starts else load_generation(run, index, self.local_completions(run)))
                               or self.roll_out(run, index))
        return self.generation.batches[(step - 1) % rl.steps_per_generation]

    def begin_step(self, run: Run, batches: list[Batch]) -> float:
        layout = run.topo.layout
        self.counts = StepCounts(float(run.config.global_batch_size), self.generation.tokens_per_step,
                                 float(run.accumulation * layout.dp))
        self.stats, self.extremes, self.sampled, self.started = [], [], [], time.perf_counter()
        return 1.0

    def micro_loss(self, run: Run, output: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        device = run.env.device
        mask, advantages = batch["mask"].to(device), batch["advantages"].to(device)
        reference = batch["ref_logps"].to(device) if batch.get("ref_logps") is not None else None
        if self.on_policy:
            nll, entropy = output
            old = -nll.detach()
            self.sampled.append(sampler_sums(old.float().cpu(), entropy.float().cpu(), batch))
        else:
            nll, old = output, batch["old_logps"].to(device)
        terms = token_terms(-nll, old, reference, advantages, mask, self._rl)
        loss = aggregate(terms.losses, mask, self._rl, self.counts)
        with torch.no_grad():
            sums, count, lowest, highest = clip_statistics(terms.ratio, advantages, mask, self._rl)
            kl = (terms.kl * mask).sum() if terms.kl is not None else torch.zeros((), device=device)
            self.stats.append(torch.cat([sums, count.reshape(1), kl.reshape(1), mask.sum().reshape(1)]))
            self.extremes.append(torch.stack([-lowest, highest]))
        return loss * rank_sum_scale(run), loss

    def end_step(self, run: Run) -> dict[str, float]:
        sums = all_reduce_over(torch.stack(self.stats).sum(0), run.topo.dp_group)
        extremes = all_reduce_over(torch.stack(self.extremes).amax(0), run.topo.dp_group, op=dist.ReduceOp.MAX)
        low, high, region, count, kl, tokens = sums.tolist()
        metrics = dict(zip(CLIP_SUMS, (x / max(count, 1.0) for x in (low, high, region)), strict=True))
        metrics["clip_ratio/low_min"] = -float(extremes[0]) if torch.isfinite(extremes[0]) else 0.0
        metrics["clip_ratio/high_max"] = float(extremes[1]) if torch.isfinite(extremes[1]) else 0.0
        if self._rl.beta:
            metrics["kl"] = kl / max(tokens, 1.0)
        metrics["time/update_s"] = time.perf_counter() - self.started
        if self.sampled:
            metrics |= sampler_metrics(self.sampled, run)
        return metrics | self.generation.metrics

    def step_line(self, metrics: dict[str, float]) -> str:
        return (f" | reward {metrics['reward']:.4f} | reward_std {metrics['reward_std']:.4f} | "
                f"completion_len {metrics['completions/mean_length']:.1f} | "
                f"clip_region {metrics['clip_ratio/region_mean']:.4f}")

    # --- rollouts ---------------------------------------------------------------------------------

    def local_completions(self, run: Run) -> list[list[list[int]]]:
        """The generation-batch indices of this rank's completions, [step part][micro-batch]."""
        config, layout = run.config, run.topo.layout
        mb = config.micro_batch_size
        return [[[p * config.global_batch_size + m * mb * layout.dp + run.topo.dp_rank * mb + j for j in range(mb)]
                 for m in range(run.accumulation)] for p in range(self._rl.steps_per_generation)]

    def roll_out(self, run: Run, index: int) -> Generation:
        """Sample, score and prepare generation ``index`` (every rank together)."""
        started = time.perf_counter()
        rl, config = self._rl, run.config
        prompts_per_generation = config.global_batch_size * rl.steps_per_generation // rl.num_generations
        first_prompt = index * prompts_per_generation
        layout = self.local_completions(run)
        order = [c for part in layout for micro in part for c in micro]
        rows = {c: run.samples[first_prompt + c // rl.num_generations] for c in order}
        sampled = self.sample_rows(run, index, order, rows)
        local = self.score(order, rows, sampled)
        everything = gather_records(local, run.topo.dp_group)
        rewards = torch.tensor(np.stack([r["rewards"] for r in everything]), dtype=torch.float32)
        weights = torch.tensor([*self.scorer.weights, *([1.0] if rl.soft_punish_cache else [])])
        total = (rewards * weights).nansum(dim=1)
        total[torch.isnan(rewards).all(dim=1)] = float("nan")
        advantages, zero_std = group_advantages(total, rl.num_generations, rl.scale_rewards)
        batches, scored = self.prepare_batches(run, layout, sampled, rows, advantages)
        counted = sum(r["counted_tokens"] for r in everything)
        metrics = self.rollout_metrics(everything, rewards, total, zero_std, run)
        if scored:
            metrics |= sampler_metrics(scored, run)
        metrics["time/rollout_s"] = time.perf_counter() - started
        generation = Generation(index, batches, counted / rl.steps_per_generation, metrics)
        records = [{**r, "reward": float(total[r["completion"]]), "advantage": float(advantages[r["completion"]])}
                   for r in everything]
        save_generation(run, generation, records, self.reward_names(), layout)
        return generation

    def reward_names(self) -> list[str]:
        return [*self.scorer.functions, *([OVERLONG] if self._rl.soft_punish_cache else [])]

    def sample_rows(self, run: Run, index: int, order: list[int], rows: dict[int, PromptRow]) -> dict[int, Any]:
        """Each of this rank's completions sampled: {completion: (tokens, sampler log-probs, truncated)}."""
        model = run.parts[0]
        chunk = self._rl.rollout_batch_size or len(order)
        out: dict[int, Any] = {}
        model.eval()
        try:
            for start in range(0, len(order), chunk):
                part = order[start:start + chunk]
                done = sample(model, [rows[c].prompt_ids for c in part],
                              [completion_seed(run.config.seed, index, c) for c in part], self.sampler,
                              sequence_multiple=run.topo.layout.tp)
                for c, tokens, logps, cut in zip(part, done.tokens, done.logps, done.truncated, strict=True):
                    out[c] = (tokens, logps, cut)
        finally:
            model.train()
        return out

    def score(self, order: list[int], rows: dict[int, PromptRow], sampled: dict[int, Any]) -> list[dict[str, Any]]:
        """This rank's completions' records with every reward (NaN where not applicable)."""
        texts = [self.tokenizer.decode(sampled[c][0], skip_special_tokens=True) for c in order]
        matrix = self.scorer.score([rows[c].prompt for c in order], texts, [sampled[c][0] for c in order],
                                   [rows[c].reward_columns() for c in order],
                                   [rows[c].where for c in order])
        if self._rl.soft_punish_cache:
            matrix = np.concatenate([matrix, [[self.overlong(len(sampled[c][0]))] for c in order]], axis=1)
        masked = self._rl.mask_truncated_completions
        return [{"completion": c, "where": rows[c].where, "prompt": self.tokenizer.decode(rows[c].prompt_ids, skip_special_tokens=False),
                 "completion_ids": sampled[c][0], "text": text, "rewards": matrix[i].tolist(),
                 "truncated": sampled[c][2], "length": len(sampled[c][0]),
                 "counted_tokens": 0 if masked and sampled[c][2] else len(sampled[c][0])}
                for i, (c, text) in enumerate(zip(order, texts, strict=True))]

    def overlong(self, length: int) -> float:
        """DAPO's soft overlong punishment of a completion of ``length`` tokens (TRL's)."""
        limit, cache = self._rl.max_completion_length, self._rl.soft_punish_cache
        if length <= limit - cache:
            return 0.0
        return (limit - cache - length) / cache if length <= limit else -1.0

    @torch.no_grad()
    def prepare_batches(self, run: Run, layout: list[list[list[int]]], sampled: dict[int, Any],
                        rows: dict[int, PromptRow], advantages: torch.Tensor
                        ) -> tuple[list[list[Batch]], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The micro-batches of every step part with the old (and reference) log-probs from the
        trainer's forward (on-policy: the sampler's log-probs, for the loss forward to compare),
        and each scored micro-batch's ``sampler_sums``."""
        model = run.parts[0]
        scored = []
        batches = []
        for part in layout:
            part_batches = []
            for micro in part:
                batch = completion_batch([rows[c].prompt_ids for c in micro], [sampled[c][0] for c in micro],
                                         run.topo.layout.tp)
                counted = torch.tensor([0.0 if self._rl.mask_truncated_completions and sampled[c][2] else 1.0
                                        for c in micro]).unsqueeze(1)
                batch |= {"mask": (batch["targets"] != -100).float() * counted, "advantages": advantages[micro].clone(),
                          "sampler_logps": scatter_tokens([sampled[c][1] for c in micro], batch["targets"])}
                inputs = model_inputs(run, batch)
                if not self.on_policy:
                    nll, token_entropy = model(**inputs, loss_reduction="none", return_entropy=True, **self.scoring())
                    batch["old_logps"] = -nll.float().cpu()
                    scored.append(sampler_sums(batch["old_logps"], token_entropy.float().cpu(), batch))
                if self._rl.beta:
                    batch["ref_logps"] = self.reference_logps(run, inputs)
                part_batches.append(batch)
            batches.append(part_batches)
        return batches, scored

    def reference_logps(self, run: Run, inputs: Batch) -> torch.Tensor:
        """The reference model's log-probs of a micro-batch: the base under LoRA, else the frozen copy."""
        if self.reference is not None:
            return -self.reference(**inputs, loss_reduction="none", **self.scoring()).float().cpu()
        model = run.parts[0]
        with adapters_off(model):
            return -model(**inputs, loss_reduction="none", **self.scoring()).float().cpu()

    def rollout_metrics(self, records: list[dict[str, Any]], rewards: torch.Tensor, total: torch.Tensor,
                        zero_std: torch.Tensor, run: Run) -> dict[str, float]:
        """TRL's generation metrics of the whole generation batch: rewards and lengths."""
        lengths = torch.tensor([float(r["length"]) for r in records])
        truncated = torch.tensor([r["truncated"] for r in records])
        ended = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
        metrics = {
            "reward": torch.nanmean(total).item(), "reward_std": nanstd(total).item(),
            "frac_reward_zero_std": zero_std.float().mean().item(),
            "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item(),
        }
        for i, name in enumerate(self.reward_names()):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards[:, i]).item()
            metrics[f"rewards/{name}/std"] = nanstd(rewards[:, i]).item()
        return metrics


def sampler_sums(trainer_logps: torch.Tensor, entropy: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's sums [sampler-vs-trainer log-prob difference, completion tokens, entropy
    of the counted tokens, counted tokens] and its largest difference, from the trainer's
    log-probs and entropies [B, W] of its completion tokens."""
    scored = (batch["targets"] != -100).float()
    difference = (trainer_logps - batch["sampler_logps"]).abs() * scored
    mask = batch["mask"]
    sums = torch.stack([difference.sum(), scored.sum(), (entropy * mask).sum(), mask.sum()]).double()
    return sums, difference.max().double()


def sampler_metrics(parts: list[tuple[torch.Tensor, torch.Tensor]], run: Run) -> dict[str, float]:
    """The entropy and sampler-drift metrics (TRL's names) of every rank's micro-batches'
    ``sampler_sums`` (``parts``: this rank's)."""
    sums = all_reduce_over(torch.stack([s for s, _ in parts]).sum(0), run.topo.dp_group)
    largest = all_reduce_over(torch.stack([m for _, m in parts]).max(), run.topo.dp_group, op=dist.ReduceOp.MAX)
    difference, scored, entropy, counted = sums.tolist()
    return {"entropy": entropy / max(counted, 1.0),
            "sampling/sampling_logp_difference/mean": difference / max(scored, 1.0),
            "sampling/sampling_logp_difference/max": largest.item()}


def gather_records(records: list[dict[str, Any]], group: Any) -> list[dict[str, Any]]:
    """Every rank's completion records, in completion order, on every rank."""
    if group is not None:
        parts: list[list[dict[str, Any]]] = [[] for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(parts, records, group=group)
        records = [r for part in parts for r in part]
    return sorted(records, key=lambda r: r["completion"])


# --- the run directory's record of every generation ----------------------------------------------


def rollouts_dir(run: Run) -> Path:
    return Path(run.config.out) / ROLLOUTS


def buffer_path(run: Run, index: int) -> Path:
    return rollouts_dir(run) / f"generation_{index:06d}.rank{run.env.rank:05d}.pt"


def save_generation(run: Run, generation: Generation, records: list[dict[str, Any]], names: list[str],
                    completions: list[list[list[int]]]) -> None:
    """This rank's buffer of ``generation`` (what a resumed run trains on) with the indices of
    its ``completions`` ([step part][micro-batch], ``Grpo.local_completions``), rank 0's record
    of every completion (``generation_{index}.jsonl``) and a few in MLflow; buffers no resume
    can need again (their steps are all before the latest checkpoint's) go."""
    directory = rollouts_dir(run)
    directory.mkdir(parents=True, exist_ok=True)
    rl = run.config.rl
    path = buffer_path(run, generation.index)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"completions": completions, "batches": generation.batches, "tokens_per_step": generation.tokens_per_step,
                "metrics": generation.metrics}, tmp)
    os.replace(tmp, path)
    per_generation = rl.steps_per_generation * rl.num_iterations
    latest = latest_step_dir(Path(run.config.out))
    done = int(latest.name.rsplit("_", 1)[1]) if latest is not None else 0
    for old in directory.glob(f"generation_*.rank{run.env.rank:05d}.pt"):
        index = int(old.name.split("_")[1].split(".")[0])
        if (index + 1) * per_generation <= done:
            old.unlink()
    if not run.env.is_main:
        return
    first = generation.index * per_generation + 1
    lines = []
    for r in records:
        line = {"generation": generation.index, "steps": [first, first + per_generation - 1], **r,
                "rewards": dict(zip(names, r["rewards"], strict=True))}
        line.pop("counted_tokens")
        lines.append(json.dumps(line, ensure_ascii=False, allow_nan=True))
    jsonl = directory / f"generation_{generation.index:06d}.jsonl"
    tmp = jsonl.with_name(jsonl.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, jsonl)
    log_completions(run, generation.index, records[:rl.logged_completions], names)


def load_generation(run: Run, index: int, completions: list[list[list[int]]]) -> Generation | None:
    """The buffer of ``generation`` this rank saved, when every rank has one of the
    ``completions`` it trains on now; None on every rank otherwise (the run resumed in
    another layout, whose ranks hold other completions: the generation is sampled again)."""
    path = buffer_path(run, index)
    saved = torch.load(path, weights_only=False) if path.is_file() else None
    if not on_every_rank(saved is not None and saved.get("completions") == completions, run):
        if run.env.is_main:
            print(f"rollouts: no buffer of generation {index} for this layout; sampling it again", flush=True)
        return None
    return Generation(index, saved["batches"], saved["tokens_per_step"], saved["metrics"])


def on_every_rank(flag: bool, run: Run) -> bool:
    """Whether ``flag`` holds on every rank of the run (a collective)."""
    value = torch.tensor(float(flag), device=run.env.device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def log_completions(run: Run, index: int, records: list[dict[str, Any]], names: list[str]) -> None:
    """A few of the generation's completions appended to the run's MLflow table ``completions.json``
    (generation, prompt, completion, rewards, advantage)."""
    run_id = run.config.mlflow_run_id or os.environ.get("LLMFLOW_MLFLOW_RUN_ID")
    if not run_id or not records:
        return
    from mlflow import MlflowClient

    table = {"generation": [index] * len(records), "prompt": [r["prompt"] for r in records],
             "completion": [r["text"] for r in records], "advantage": [r["advantage"] for r in records],
             "truncated": [r["truncated"] for r in records],
             **{f"reward/{name}": [r["rewards"][i] for r in records] for i, name in enumerate(names)}}
    # One table, appended to (each table file would add an entry to a run tag MLflow cuts at 8000 characters).
    MlflowClient().log_table(run_id, table, "completions.json")

