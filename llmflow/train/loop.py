"""The training loop a torchrun worker runs.

Start-up: every rank builds the whole model from ``config.model`` (a Hugging Face
directory or a checkpoint), adds LoRA adapters (seeded, identical on every rank), then
the parallel plan shards it (tensor parallel, activation checkpointing, FSDP2). When
``config.out`` holds a checkpoint, the trained weights (or adapters), optimizer state and
each rank's RNG state are loaded from it, resharded to this run's layout.

A step takes the global batch of samples ``[step * global_batch, (step + 1) *
global_batch)``; each data-parallel rank takes its slice of every micro-batch. The loss
is the mean over every target token of the global batch (summed per rank, divided by the
global count), so any (dp, tp) layout and any accumulation computes the same loss as one
process. The learning rate is a function of the step, so resuming needs only the step.

Every step checks its loss and gradient norm before the optimizer uses them: NaN or ±Inf
stops the run with ``NonFiniteError`` naming the step and the first parameter whose
gradient is not finite, before anything is updated or saved, so the run's ``latest``
checkpoint stays the last good one and a rerun resumes from it.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from llmflow import runtime
from llmflow.checkpoint import (
    TOKENIZER_DIR,
    CheckpointMeta,
    NonFiniteError,
    first_nonfinite,
    latest_step_dir,
    load_checkpoint,
    load_rng_state,
    resume_note,
    save_checkpoint,
)
from llmflow.convert import copy_tokenizer_files
from llmflow.mesh import ParallelLayout, build_mesh, validate_layout
from llmflow.model_loading import load_model, tokenizer_dir
from llmflow.models import ModelConfig, apply_lora, is_lora_param, lora_tp_plan
from llmflow.models.parallelize import apply_ac, apply_fsdp, apply_tp, layer_tp_plan
from llmflow.probe import Dumper, load_probe_config, seed_all
from llmflow.train.config import TrainConfig
from llmflow.train.data import BlendedSamples, PretrainSamples, SftSamples, check_token_ids, collate
from llmflow.train.metrics import StepTimer, flops_per_token, memory_gib, peak_flops
from llmflow.train.preflight import batch_problems

# --- model ----------------------------------------------------------------------------------------


def trainable_state(model: torch.nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """What a checkpoint stores of the model: every weight, or only the adapters."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    return {k: v for k, v in state.items() if is_lora_param(k)} if lora else state


# --- schedule -------------------------------------------------------------------------------------


def learning_rate(config: TrainConfig, step: int) -> float:
    """LR of optimizer step ``step`` (1-based): linear warmup, then decay to min_lr."""
    o = config.optim
    if step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    if o.decay == "constant":
        return o.lr
    span = max(config.steps - o.warmup_steps, 1)
    progress = min((step - o.warmup_steps) / span, 1.0)
    if o.decay == "linear":
        return o.lr + (o.min_lr - o.lr) * progress
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, config: TrainConfig, device_type: str) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith("bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": config.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device_type in ("cuda", "npu")
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.optim.lr, betas=config.optim.betas, eps=config.optim.eps, fused=fused or None
    )


# --- the run --------------------------------------------------------------------------------------


@dataclass
class Topology:
    """Where this rank sits: its data-parallel coordinates and the meshes to shard over."""

    layout: ParallelLayout
    dp_rank: int
    dp_group: Any
    mesh: Any


def topology(config: TrainConfig, env: runtime.DistEnv, model_config: ModelConfig) -> Topology:
    dp = config.dp or max(env.world_size // config.tp, 1)
    layout = ParallelLayout(dp=dp, tp=config.tp)
    validate_layout(layout, env.world_size, model_config)
    if not dist.is_initialized():
        return Topology(layout, 0, None, None)
    mesh = build_mesh(layout, env.device.type)
    return Topology(layout, mesh["dp"].get_local_rank(), mesh["dp"].get_group(), mesh)


def data_source(config: TrainConfig):
    d = config.data
    if d.kind == "sft":
        return SftSamples(d.paths[0], config.seed)
    if config.seq_length is None:
        raise ValueError("seq_length is required for pretraining")
    parts = [PretrainSamples(p, config.seq_length, config.seed + i, d.document_attention) for i, p in enumerate(d.paths)]
    if len(parts) == 1:
        return parts[0]
    return BlendedSamples(parts, d.weights or [1.0] * len(parts), config.steps * config.global_batch_size)


def rng_state(device_type: str) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device_type != "cpu":
        state["device"] = torch.get_device_module(device_type).get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], device_type: str) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state:
        torch.get_device_module(device_type).set_rng_state(state["device"])


def train(config: TrainConfig) -> dict[str, float]:
    """Run (or resume) the training ``config`` describes; returns the last step's metrics."""
    if config.deterministic:
        seed_all(config.seed)  # before the process group: HCCL reads its switch at start-up
    env = runtime.init_distributed()
    device_type = env.device.type
    dtype = runtime.resolve_dtype(config.dtype, device_type)
    torch.manual_seed(config.seed)

    model, hf_config = load_model(config.model, env.device)
    if env.is_main:
        _copy_tokenizer(Path(config.model), Path(config.out))
    topo = topology(config, env, model.config)
    dp = topo.layout.dp
    per_step = config.micro_batch_size * dp
    for problem in batch_problems(config.global_batch_size, config.micro_batch_size, dp):
        raise ValueError(problem)
    accumulation = config.global_batch_size // per_step
    samples = data_source(config)
    vocab_size = int(hf_config["vocab_size"])

    if config.lora is not None:
        apply_lora(model, config.lora, generator=torch.Generator(device=env.device).manual_seed(config.seed))
    if config.tp > 1:
        extra = lora_tp_plan(layer_tp_plan()) if config.lora is not None else None  # wraps every entry
        apply_tp(model, topo.mesh["tp"], extra)
        if config.lora is not None:  # SequenceParallel makes fresh, trainable norm weights
            for name, p in model.named_parameters():
                p.requires_grad_(is_lora_param(name))
    if config.activation_checkpointing:
        apply_ac(model)
    if config.compile:
        for layer in model.model.layers.values():
            layer.compile()
    sharded = topo.mesh is not None and (dp > 1 or dtype != torch.float32)
    if sharded:
        apply_fsdp(model, topo.mesh["dp"], param_dtype=dtype)
    elif dtype != torch.float32:
        raise ValueError(f"dtype {dtype} needs a torchrun launch (mixed precision comes with FSDP2); use dtype=fp32")
    optimizer = build_optimizer(model, config, device_type)
    dumper = Dumper(load_probe_config(config.probe), model) if config.probe else None

    start_step = 0
    out = Path(config.out)
    resume_dir = latest_step_dir(out) if out.exists() else None
    if resume_dir is not None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"model": trainable_state(model, config.lora is not None), "optimizer": get_optimizer_state_dict(model, optimizer)}
        meta = load_checkpoint(resume_dir, state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=config.lora is None))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        start_step = meta.step
        saved_rng = load_rng_state(resume_dir, env.rank)
        if saved_rng is not None and meta.layout == topo.layout.__dict__:
            set_rng_state(saved_rng, device_type)
        if env.is_main:
            print(f"resumed from {resume_dir} at step {start_step} ({meta.consumed_samples} samples consumed)", flush=True)

    meta_template = CheckpointMeta(
        hf_config=hf_config,
        padded_vocab_size=model.config.vocab_size,
        layout=dict(topo.layout.__dict__),
        lora=config.lora.model_dump() if config.lora is not None else None,
        base_checkpoint=str(Path(config.model).resolve()) if config.lora is not None else None,
    )
    run_id = config.mlflow_run_id or os.environ.get("LLMFLOW_MLFLOW_RUN_ID")
    seq_length = samples.seq_length
    flops_token = flops_per_token(model.config, seq_length)
    peak = peak_flops(env.device)
    timer = StepTimer()
    metrics: dict[str, float] = {}
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.train()

    for step in range(start_step + 1, config.steps + 1):
        lr = learning_rate(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        first = (step - 1) * config.global_batch_size
        micro_batches = []
        for m in range(accumulation):
            base = first + m * per_step + topo.dp_rank * config.micro_batch_size
            batch_samples = [samples[base + j] for j in range(config.micro_batch_size)]
            check_token_ids(batch_samples, vocab_size)
            micro_batches.append(collate(batch_samples))
        local_count = sum(int((b["targets"] != -100).sum()) for b in micro_batches)
        count = torch.tensor(float(local_count), device=env.device)
        if topo.dp_group is not None:
            dist.all_reduce(count, group=topo.dp_group)
        total = max(count.item(), 1.0)

        loss_sum = torch.zeros((), device=env.device)
        # msprobe counts steps from 0: probe step s is training step s + 1.
        with dumper.step(step - 1) if dumper else nullcontext():
            for m, batch in enumerate(micro_batches):
                if sharded:
                    model.set_requires_gradient_sync(m == accumulation - 1)
                tensors = {k: (v.to(env.device) if v is not None else None) for k, v in batch.items()}
                loss = model(tensors["input_ids"], labels=tensors["targets"], document_ids=tensors["document_ids"], loss_reduction="sum")
                # FSDP averages gradients over dp ranks; scaling by dp makes that a global-token mean.
                (loss * ((dp if sharded else 1) / total)).backward()
                loss_sum += loss.detach()
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in trainable if p.grad is not None])
        if topo.dp_group is not None:
            dist.all_reduce(loss_sum, group=topo.dp_group)
        loss_value, norm_value = finite_step(step, loss_sum / total, grad_norm, model, out)
        if config.optim.clip_grad:
            torch.nn.utils.clip_grads_with_norm_(trainable, config.optim.clip_grad, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = timer.lap()

        if step % config.log_interval == 0 or step == config.steps:
            tokens = config.global_batch_size * seq_length
            metrics = {
                "loss": loss_value,
                "lr": lr,
                "grad_norm": norm_value,
                "tokens_per_s": tokens / seconds,
                "samples_per_s": config.global_batch_size / seconds,
                "memory_gib": memory_gib(env.device),
            }
            if peak is not None:
                metrics["mfu"] = flops_token * tokens / seconds / (peak * env.world_size)
            if env.is_main:
                _report(step, config.steps, metrics, run_id)
                timer.lap()  # logging time is not step time (the first MLflow call imports mlflow)
        if step == config.steps or (config.save_interval and step % config.save_interval == 0):
            _save(model, optimizer, config, step, meta_template, device_type)
            timer.lap()  # checkpoint time is not step time

    runtime.destroy_distributed()
    return metrics


def finite_step(step: int, loss: torch.Tensor, grad_norm: torch.Tensor, model: torch.nn.Module, out: Path) -> tuple[float, float]:
    """The step's loss and total gradient norm as numbers (the step's one host sync; a
    DTensor norm is completed across ranks first, so every rank sees the same values), or
    ``NonFiniteError`` when either is NaN or ±Inf (Megatron's check_for_nan_in_loss_and_grad),
    naming the step and the first parameter whose gradient holds NaN or ±Inf (one
    all-reduce, only then). Call it before clipping, which would spread a NaN to every gradient."""
    norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    loss_value, norm_value = torch.stack([loss.float(), norm.float()]).tolist()
    if math.isfinite(loss_value) and math.isfinite(norm_value):
        return loss_value, norm_value
    first = first_nonfinite((_clean_name(name), p.grad) for name, p in model.named_parameters() if p.grad is not None)
    if first is not None:
        where = f"first non-finite gradient: {first}"
    else:
        where = "every gradient is finite" + ("" if math.isfinite(norm_value) else "; their norm overflows")
    raise NonFiniteError(f"step {step}: loss {loss_value}, grad_norm {norm_value} ({where}); training stopped, {resume_note(out)}")


def _clean_name(name: str) -> str:
    """A parameter's name as the checkpoint stores it (without activation-checkpointing wrappers)."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def _copy_tokenizer(source: Path, out: Path) -> None:
    """The run directory carries the tokenizer, so export and inference find it."""
    found = tokenizer_dir(source)
    if found is not None and not (out / TOKENIZER_DIR / "tokenizer.json").is_file():
        copy_tokenizer_files(found, out / TOKENIZER_DIR)


def _save(model, optimizer, config: TrainConfig, step: int, meta: CheckpointMeta, device_type: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": trainable_state(model, config.lora is not None), "optimizer": get_optimizer_state_dict(model, optimizer)}
    meta = meta.model_copy(update={"consumed_samples": step * config.global_batch_size})
    path = save_checkpoint(config.out, step, state, meta, keep=config.keep_last, rng_state=rng_state(device_type))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"saved checkpoint {path}", flush=True)


def _report(step: int, steps: int, metrics: dict[str, float], run_id: str | None) -> None:
    mfu = f"{metrics['mfu']:.1%}" if "mfu" in metrics else "n/a"
    print(
        f"step {step}/{steps} | loss {metrics['loss']:.6f} | lr {metrics['lr']:.3e} | grad_norm {metrics['grad_norm']:.4f} | "
        f"{metrics['tokens_per_s']:.0f} tokens/s | {metrics['samples_per_s']:.2f} samples/s | mfu {mfu} | "
        f"mem {metrics['memory_gib']:.2f} GiB",
        flush=True,
    )
    if run_id:
        from llmflow import tracking

        tracking.log_metrics(run_id, metrics, step=step)
