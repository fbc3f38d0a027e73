"""The training loop a torchrun worker runs.

``setup``: every rank builds the model from ``config.model`` (a Hugging Face directory or a
checkpoint) on the meta device, adds LoRA adapters, cuts its pipeline stages, and
``parallelize_decoder`` shards them (tensor parallel, activation checkpointing, FSDP2); then
the rank loads only its shards (``weights/sharded_loading.py``; adapters seeded, the values
one process gives them). A LoRA checkpoint's base is loaded whole first, as one process would. When
``config.out`` holds a checkpoint, ``resume`` loads the trained weights (or adapters),
optimizer state and each rank's RNG state from it, resharded to this run's layout.
``train_step`` is one optimizer step (``forward_backward`` over this rank's micro-batches);
``train`` loops over the steps, logging and saving.

A step's micro-batches, their loss and its normalisers come from the run's objective
(``llmflow.train.objectives``, one module per ``method``): next-token prediction takes the
global batch of samples ``[step * global_batch, (step + 1) * global_batch)``, each
data-parallel rank its slice of every micro-batch, and its loss is the mean over every
target token of the global batch (summed per rank, divided by the global count), so any
(dp, tp) layout and any accumulation computes the same loss as one process; every objective
normalises so. The learning rate is a function of the step, so resuming needs only the step.

Every step checks its loss and gradient norm before the optimizer uses them: NaN or ±Inf
stops the run with ``NonFiniteError`` naming the step and the first parameter whose
gradient is not finite, before anything is updated or saved, so the run's ``latest``
checkpoint stays the last good one and a rerun resumes from it.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from llmflow import runtime
from llmflow.models import apply_lora
from llmflow.models.config import text_config
from llmflow.models.context_parallel import context_parallel_problems
from llmflow.models.expert_parallel import expert_parameters, moe_parameters, sum_gradients
from llmflow.models.parallelize import parallelize_decoder
from llmflow.models.pipeline import pipeline_schedule, split_model
from llmflow.probe import Dumper, PipelinePlace, load_probe_config, seed_all
from llmflow.train.config import TrainConfig
from llmflow.train.metrics import StepTimer, flops_per_token, memory_gib, peak_flops
from llmflow.train.objectives import objective_for
from llmflow.train.preflight import batch_problems, moe_problems, pipeline_problems
from llmflow.train.routing import RoutingLog, SequenceLoss, aux_loss_coefficient
from llmflow.train.run import (
    Batch,
    Run,
    all_reduce_over,
    model_inputs,
    pipeline_run,
    rank_sum_scale,
    topology,
    trainable_state,
)
from llmflow.weights import (
    CheckpointMeta,
    NonFiniteError,
    carry_tokenizer,
    first_nonfinite,
    latest_step_dir,
    load_checkpoint,
    load_model,
    load_rng_state,
    optimizer_state_flattened,
    resume_note,
    save_checkpoint,
)
from llmflow.weights.carried import Carried, carry_untrained, untrained_tensors
from llmflow.weights.sharded_loading import load_sharded, meta_model, sharded_source

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


def same_mesh_sets(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """``params`` in sets that each live on one device mesh (plain tensors together): a
    multi-tensor op (the optimizer's update, the gradient norm) takes DTensors of one mesh.
    Meshes differ where parallelisms meet: the experts expert parallelism splits (on "ep"),
    a mixture of experts' other weights under tp (FSDP's "dp" only, beside the (dp, tp) rest)."""
    sets: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        key = (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.mesh.flatten().tolist())) if isinstance(p, DTensor) else None
        sets.setdefault(key, []).append(p)
    return list(sets.values())


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith("bias") else decay).append(p)
    groups = [{"params": params, "weight_decay": weight_decay}
              for kind, weight_decay in ((decay, config.optim.weight_decay), (no_decay, 0.0))
              for params in same_mesh_sets(kind)]
    # Fused on every device: CUDA's and Ascend's kernels, and on the CPU torch's fused kernel,
    # about 5x the for-each one (one pass per parameter instead of one per arithmetic step,
    # and no temporaries the size of a parameter).
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.optim.lr, betas=config.optim.betas, eps=config.optim.eps, fused=True
    )


# --- the run --------------------------------------------------------------------------------------


def data_source(config: TrainConfig) -> Any:
    """The run's data, addressed by global sample index (its objective's)."""
    return objective_for(config.method).samples(config)


def rng_state(device_type: str) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device_type != "cpu":
        state["device"] = torch.get_device_module(device_type).get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], device_type: str) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state:
        torch.get_device_module(device_type).set_rng_state(state["device"])


def setup(config: TrainConfig) -> Run:
    """Start this worker: process group, model (LoRA adapters added, split into pipeline stages,
    then sharded), optimizer, data and the probe; resumed from the run directory's latest
    checkpoint when there is one."""
    if config.deterministic:
        seed_all(config.seed)  # before the process group: HCCL reads its switch at start-up
    env = runtime.init_distributed()
    dtype = runtime.resolve_dtype(config.dtype, env.device.type)
    torch.manual_seed(config.seed)

    # A Hugging Face directory or a full-weight checkpoint: built on the meta device, sharded,
    # then each rank loads its shard (load_sharded below). A LoRA checkpoint: its base whole.
    source = sharded_source(config.model)
    if source is None:
        model, hf_config = load_model(config.model, env.device)
    else:
        model, hf_config = meta_model(source), source.hf_config
    # What the decoder does not hold (a vision tower): kept, untrained, beside the run's checkpoints;
    # a LoRA run's stays with its base.
    carried = untrained_tensors(Path(config.model)) if config.lora is None else Carried()
    if env.is_main:
        carry_tokenizer(Path(config.model), Path(config.out))
        carry_untrained(carried, Path(config.out))
        if carried.tensors:
            print(carried.line(), flush=True)
    topo = topology(config, env, model.config)
    layout = topo.layout
    objective = objective_for(config.method)
    problems = batch_problems(config.global_batch_size, config.micro_batch_size, layout.dp)
    problems += pipeline_problems(config, layout.dp, model.config.num_hidden_layers)
    problems += moe_problems(config, model.config)
    problems += objective.problems(config, layout, model.config)
    if problems:
        raise ValueError("; ".join(problems))
    samples = objective.samples(config)
    problems = context_parallel_problems(model.config, layout.cp, samples.seq_length, layout.tp, config.cp_algo)
    if problems:
        raise ValueError("; ".join(problems))
    sharded = topo.mesh is not None and (layout.dp * layout.cp > 1 or dtype != torch.float32)
    if not sharded and dtype != torch.float32:
        raise ValueError(f"dtype {dtype} needs a torchrun launch (mixed precision comes with FSDP2); use dtype=fp32")

    if config.lora is not None:  # on the meta device the adapters are initialised by load_sharded
        apply_lora(model, config.lora, generator=torch.Generator(device=env.device).manual_seed(config.seed))
    parameter_order = [name for name, _ in model.named_parameters()]
    stages = [(0, model)]
    pipeline = None
    if layout.pp > 1:
        stages = split_model(model, topo.pp_rank, layout.pp, config.virtual_stages or 1, config.num_layer_list)
        pipeline = PipelinePlace([index for index, _ in stages], layout.pp * (config.virtual_stages or 1),
                                 topo.pp_group)
    parts = [part for _, part in stages]
    for part in parts:
        parallelize_decoder(part, topo.mesh, lora=config.lora is not None,
                            activation_checkpointing=config.activation_checkpointing, compile=config.compile,
                            fsdp_dtype=dtype if sharded else None, reshard_after_forward=layout.pp == 1,
                            cp_algo=config.cp_algo)
    if source is not None:
        load_sharded(model, parts, source, env.device, config.seed if config.lora is not None else None)
    accumulation = config.global_batch_size // (config.micro_batch_size * layout.dp)
    experts = [p for part in parts for p in expert_parameters(part) if p.requires_grad]
    moe_replicated = [p for part in parts for p in moe_parameters(part) if p.requires_grad] if layout.tp > 1 else []
    run = Run(
        config=config, env=env, topo=topo, parts=parts,
        optimizers=[build_optimizer(part, config) for part in parts],
        trainable=[p for part in parts for p in part.parameters() if p.requires_grad], samples=samples,
        vocab_size=int(text_config(hf_config)["vocab_size"]), sharded=sharded, accumulation=accumulation,
        meta=CheckpointMeta(
            hf_config=hf_config,
            padded_vocab_size=model.config.vocab_size,
            layout=dict(layout.__dict__),
            lora=config.lora.model_dump() if config.lora is not None else None,
            base_checkpoint=str(Path(config.model).resolve()) if config.lora is not None else None,
            carried=carried.counts,
        ),
        dumper=Dumper(load_probe_config(config.probe), parts, pipeline) if config.probe else None,
        parameter_order=parameter_order, objective=objective, dtype=dtype,
        experts=experts, moe_replicated=moe_replicated,
    )
    if model.config.num_experts and pipeline is None:
        sequence_loss = (SequenceLoss(config.router_seq_aux_loss_coef, topo.dp_group, (topo.cp_group, topo.tp_group))
                         if config.router_seq_aux_loss_coef else None)
        run.routing = RoutingLog(parts, topo.routing_group,
                                 aux_loss_coefficient(config.router_aux_loss_coef, hf_config), sequence_loss)
    if pipeline is not None:
        run.pipeline_loss = objective.pipeline_loss(run)
        run.pipeline = pipeline_schedule(stages, pipeline.num_stages, config.pp_schedule,
                                         accumulation, run.pipeline_loss, env.device, topo.pp_group)
        if hasattr(run.pipeline_loss, "schedule"):  # a loss that tells the schedule's shape inference apart
            run.pipeline_loss.schedule = run.pipeline
        held = pipeline.stages
        if model.config.tie_word_embeddings and pipeline.num_stages - 1 in held and 0 not in held:
            run.tied_copy = parts[-1].lm_head.weight
    objective.prepare(run)  # before resuming: the initial weights are the model's
    resume(run)
    return run


def resume(run: Run) -> None:
    """Load the run directory's latest checkpoint into ``run``, resharded to this layout
    (and each rank's RNG state when the layout is the one it was saved under)."""
    out = Path(run.config.out)
    resume_dir = latest_step_dir(out) if out.exists() else None
    if resume_dir is None:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    flatten = optimizer_state_flattened(resume_dir)
    if not flatten and run.topo.layout.pp > 1:
        raise ValueError(
            f"{resume_dir} holds its optimizer state in the layout written before pipeline parallelism, which only "
            "pp=1 reads: resume it at pp=1 until its next checkpoint, then at any pp"
        )
    state = run.state(flatten)
    meta = load_checkpoint(resume_dir, state)
    lora = run.config.lora is not None
    for part, part_optimizer in zip(run.parts, run.optimizers, strict=True):
        own = {name: state["model"][name] for name in trainable_state(part, lora)}
        set_model_state_dict(part, own, options=StateDictOptions(strict=not lora))
        set_optimizer_state_dict(part, part_optimizer, state["optimizer"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    run.start_step = meta.step
    saved_rng = load_rng_state(resume_dir, run.env.rank)
    if saved_rng is not None and same_layout(meta.layout, run.meta.layout):
        set_rng_state(saved_rng, run.env.device.type)
    if run.env.is_main:
        print(f"resumed from {resume_dir} at step {run.start_step} ({meta.consumed_samples} samples consumed)", flush=True)


def same_layout(saved: dict[str, int], current: dict[str, int]) -> bool:
    """Whether a checkpoint's layout is this run's (a layout recorded without pp, ep or cp had 1)."""
    return {"pp": 1, "ep": 1, "cp": 1, **saved} == {"pp": 1, "ep": 1, "cp": 1, **current}


def forward_backward(run: Run, batches: list[Batch]) -> torch.Tensor:
    """Gradients of the step's objective over ``batches`` (this rank's micro-batches; the
    objective normalises each one's share); returns this rank's share of the reported loss."""
    if run.pipeline is not None:
        return pipeline_forward_backward(run, batches)
    objective = run.objective
    model = run.parts[0]
    reduction = "none" if objective.token_losses else "sum"
    loss_sum = torch.zeros((), device=run.env.device)
    for m, batch in enumerate(batches):
        if run.sharded:
            model.set_requires_gradient_sync(m == len(batches) - 1)
        output = model(**model_inputs(run, batch), loss_reduction=reduction, **objective.model_kwargs())
        loss, reported = objective.micro_loss(run, output, batch)
        aux = run.routing.after_forward() if run.routing is not None else None
        if aux is not None:
            # The mean over the step's micro-batches of each one's loss (of which this rank holds a share).
            loss = loss + aux * rank_sum_scale(run) / len(batches)
        loss.backward()
        loss_sum += reported.detach()
    return loss_sum


def pipeline_forward_backward(run: Run, batches: list[Batch]) -> torch.Tensor:
    """``forward_backward`` through the pipeline schedule (``pipeline_run``); the last stage's
    loss function is the objective's. Returns the reported loss share on the last stage's
    ranks, zero elsewhere."""
    run.objective.begin_pipeline_step(run, batches)
    scaled = pipeline_run(run, batches, run.pipeline.step)
    if not scaled:
        return torch.zeros((), device=run.env.device)
    return torch.stack([loss.detach() for loss in scaled]).sum() / run.pipeline_loss.scale


def sync_tied_gradients(run: Run) -> None:
    """Under pp with tied embeddings, add up the gradients the first stage (embedding) and the
    last stage (output projection) computed for the one tied weight, so both copies step alike."""
    if run.topo.tied_group is None:
        return
    for part in run.parts:
        embed = part.model.embed_tokens
        if embed is not None and embed.weight.grad is not None:
            grad = embed.weight.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=run.topo.tied_group)


def total_grad_norm(run: Run) -> torch.Tensor:
    """The total gradient norm over every parameter of the whole model (each rank's shards and
    stages combined; the tied weight counted once), the same on every rank."""
    squares = []
    for params in same_mesh_sets(run.trainable):
        grads = [p.grad for p in params if p.grad is not None and p is not run.tied_copy]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=run.env.device)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    norm = torch.stack(squares).sum().sqrt() if squares else torch.zeros((), device=run.env.device)
    if run.topo.pp_group is not None:
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=run.topo.pp_group)
        norm = squared.sqrt()
    return norm


def train_step(run: Run, step: int) -> tuple[float, float, float]:
    """One optimizer step; returns its loss, gradient norm (before clipping) and learning rate."""
    config, objective = run.config, run.objective
    lr = learning_rate(config, step)
    for optimizer in run.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
    batches = objective.micro_batches(run, step)
    if run.routing is not None:
        run.routing.reset()
    total = objective.begin_step(run, batches)
    # msprobe counts steps from 0: probe step s is training step s + 1.
    with run.dumper.step(step - 1) if run.dumper else nullcontext():
        loss_sum = forward_backward(run, batches)
    if run.moe_replicated:  # under tp each rank routed its own tokens: add up what they gave
        sum_gradients(run.moe_replicated, [run.topo.tp_group])
    if run.experts:  # they hold this ep group's tokens, and FSDP does not average them over dp
        sum_gradients(run.experts, [run.topo.expert_replicate_group, run.topo.cp_group, run.topo.tp_group],
                      1 / rank_sum_scale(run))
    sync_tied_gradients(run)
    norm = total_grad_norm(run)
    # The loss lives on the last stage; each dp rank has its share, and so may each cp rank.
    all_reduce_over(loss_sum, run.topo.pp_group, run.topo.dp_group,
                    run.topo.cp_group if objective.loss_over_cp else None)
    run.metrics = objective.end_step(run)
    loss_value, norm_value = finite_step(step, loss_sum / total, norm, run.parts, Path(config.out), run.parameter_order)
    if config.optim.clip_grad:
        for params in same_mesh_sets(run.trainable):
            torch.nn.utils.clip_grads_with_norm_(params, config.optim.clip_grad, norm)
    for optimizer in run.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if run.routing is not None and config.router_bias_update_rate:
        run.routing.update_biases(config.router_bias_update_rate)
    return loss_value, norm_value, lr


def train(config: TrainConfig) -> dict[str, float]:
    """Run (or resume) the training ``config`` describes; returns the last step's metrics."""
    run = setup(config)
    env = run.env
    run_id = config.mlflow_run_id or os.environ.get("LLMFLOW_MLFLOW_RUN_ID")
    seq_length = run.samples.seq_length
    flops_token = flops_per_token(run.parts[0].config, seq_length)
    peak = peak_flops(env.device)
    timer = StepTimer()
    metrics: dict[str, float] = {}
    for part in run.parts:
        part.train()

    for step in range(run.start_step + 1, config.steps + 1):
        loss_value, norm_value, lr = train_step(run, step)
        seconds = timer.lap()
        # Step 1 always: a fresh run's first loss is its sanity check (about ln(vocabulary) from random weights).
        if step == 1 or step % config.log_interval == 0 or step == config.steps:
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
            if run.routing is not None:
                metrics |= run.routing.metrics()
            metrics |= run.metrics
            if env.is_main:
                _report(step, config.steps, metrics, run.objective.step_line(metrics), run_id)
                timer.lap()  # logging time is not step time (the first MLflow call imports mlflow)
        if step == config.steps or (config.save_interval and step % config.save_interval == 0):
            _save(run, step)
            timer.lap()  # checkpoint time is not step time

    run.objective.close()
    runtime.destroy_distributed()
    return metrics


def finite_step(step: int, loss: torch.Tensor, grad_norm: torch.Tensor, parts: list[torch.nn.Module], out: Path,
                order: list[str] | None = None) -> tuple[float, float]:
    """The step's loss and total gradient norm as numbers (the step's one host sync; both are
    the same on every rank), or ``NonFiniteError`` when either is NaN or ±Inf (Megatron's
    check_for_nan_in_loss_and_grad), naming the step and the first parameter of ``parts``
    whose gradient holds NaN or ±Inf (one all-reduce, only then), first in ``order`` (every
    parameter name of the whole model) where ranks hold different parts. Call it before
    clipping, which would spread a NaN to every gradient."""
    loss_value, norm_value = torch.stack([loss.float(), grad_norm.float()]).tolist()
    if math.isfinite(loss_value) and math.isfinite(norm_value):
        return loss_value, norm_value
    named = ((_clean_name(name), p.grad) for part in parts for name, p in part.named_parameters() if p.grad is not None)
    first = first_nonfinite(named, order=order)
    if first is not None:
        where = f"first non-finite gradient: {first}"
    else:
        where = "every gradient is finite" + ("" if math.isfinite(norm_value) else "; their norm overflows")
    raise NonFiniteError(
        f"step {step}: loss {loss_value}, grad_norm {norm_value} ({where}); training stopped, {resume_note(out)}"
    )


def _clean_name(name: str) -> str:
    """A parameter's name as the checkpoint stores it (without activation-checkpointing wrappers)."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def _save(run: Run, step: int) -> None:
    config = run.config
    meta = run.meta.model_copy(update={"consumed_samples": step * config.global_batch_size})
    path = save_checkpoint(config.out, step, run.state(), meta, keep=config.keep_last,
                           rng_state=rng_state(run.env.device.type))
    if run.env.is_main:
        print(f"saved checkpoint {path}", flush=True)


def _report(step: int, steps: int, metrics: dict[str, float], objective_line: str, run_id: str | None) -> None:
    mfu = f"{metrics['mfu']:.1%}" if "mfu" in metrics else "n/a"
    extra = (f" | moe_aux_loss {metrics['moe_aux_loss']:.6f} | max_expert_load {metrics['moe_max_expert_load']:.2f}"
               if "moe_aux_loss" in metrics else "")
    extra += (f" | moe_seq_aux_loss {metrics['moe_seq_aux_loss']:.6f}" if "moe_seq_aux_loss" in metrics else "")
    extra += objective_line
    print(
        f"step {step}/{steps} | loss {metrics['loss']:.6f} | lr {metrics['lr']:.3e} | grad_norm {metrics['grad_norm']:.4f} | "
        f"{metrics['tokens_per_s']:.0f} tokens/s | {metrics['samples_per_s']:.2f} samples/s | mfu {mfu} | "
        f"mem {metrics['memory_gib']:.2f} GiB{extra}",
        flush=True,
    )
    if run_id:
        from llmflow import tracking

        tracking.log_metrics(run_id, metrics, step=step)
