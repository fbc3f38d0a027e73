"""One training worker's run, set up once by ``llmflow.train.loop.setup``: where the rank sits
(``Topology``), its sharded model and optimizers, its data and its objective (``Run``), and
the helpers every objective shares to give the model a micro-batch in this rank's layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from llmflow import runtime
from llmflow.mesh import ParallelLayout, build_mesh, validate_layout
from llmflow.models import CausalLM, ModelConfig, is_lora_param
from llmflow.models.context_parallel import held_positions, shard_sequence
from llmflow.models.parallelize import parallelize_decoder
from llmflow.probe import Dumper
from llmflow.train.config import TrainConfig
from llmflow.train.routing import RoutingLog
from llmflow.weights import CheckpointMeta, load_model
from llmflow.weights.sharded_loading import load_sharded, meta_model, sharded_source

Batch = dict[str, torch.Tensor | None]


@dataclass
class Topology:
    """Where this rank sits: its data- and pipeline-parallel coordinates and the meshes to
    shard over."""

    layout: ParallelLayout
    dp_rank: int
    dp_group: Any
    mesh: Any
    pp_rank: int = 0
    pp_group: Any = None
    tied_group: Any = None
    """Under pp with tied embeddings: the group of this rank's first- and last-stage peers
    (same dp and tp coordinates), which add up the tied weight's two gradients."""
    expert_replicate_group: Any = None
    """Under ep < dp: the ranks holding the same experts, which add up their gradients."""
    tp_group: Any = None
    """Under tp: this rank's tensor-parallel group (a mixture of experts sums its gradients over it)."""
    cp_rank: int = 0
    cp_group: Any = None
    """Under cp: this rank's context-parallel group, whose ranks hold shards of the same sequences."""
    routing_group: Any = None
    """The ranks that share a micro-batch's tokens (dp, and the sequence shards of cp and tp): a
    mixture of experts' auxiliary loss counts its experts' assignments over them."""


def topology(config: TrainConfig, env: runtime.DistEnv, model_config: ModelConfig) -> Topology:
    layout = ParallelLayout.of_world(env.world_size, config.pp, config.tp, config.dp, config.ep, config.cp)
    validate_layout(layout, env.world_size, model_config)
    if not dist.is_initialized():
        return Topology(layout, 0, None, None)
    mesh = build_mesh(layout, env.device.type)
    topo = Topology(layout, mesh["dp"].get_local_rank(), mesh["dp"].get_group(), mesh)
    if 1 < layout.ep < layout.dp:
        topo.expert_replicate_group = mesh["dp_replicate"].get_group()
    if layout.tp > 1:
        topo.tp_group = mesh["tp"].get_group()
    if layout.cp > 1:
        topo.cp_rank, topo.cp_group = mesh["cp"].get_local_rank(), mesh["cp"].get_group()
    token_dims = (*(("dp_replicate", "ep") if layout.ep > 1 else ("dp",)),
                  *(("cp",) if layout.cp > 1 else ()), *(("tp",) if layout.tp > 1 else ()))
    topo.routing_group = mesh[token_dims]._flatten("tokens").get_group() if len(token_dims) > 1 else topo.dp_group
    if layout.pp > 1:
        topo.pp_rank, topo.pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
        if model_config.tie_word_embeddings:
            ends = mesh.mesh[[0, -1]].reshape(2, -1).T.tolist()  # [first, last] of every (dp, cp, tp)
            topo.tied_group, _ = dist.new_subgroups_by_enumeration(ends)
    return topo


def trainable_state(model: torch.nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """What a checkpoint stores of the model: every weight, or only the adapters."""
    state = get_model_state_dict(model)
    return {k: v for k, v in state.items() if is_lora_param(k)} if lora else state


@dataclass
class Run:
    """One worker's training, set up once: the sharded model, its optimizer, the data, the
    objective and where this rank sits."""

    config: TrainConfig
    env: runtime.DistEnv
    topo: Topology
    parts: list[CausalLM]
    """This rank's model: the whole model, or under pp its pipeline stages, in stage order."""
    optimizers: list[torch.optim.Optimizer]
    """One optimizer per part (each part's state is named by the part's parameter names)."""
    trainable: list[torch.nn.Parameter]
    samples: Any
    vocab_size: int
    """The model's real vocabulary: data ids at or above it are refused."""
    sharded: bool
    """Whether FSDP2 shards the model (it then averages gradients over the dp ranks)."""
    accumulation: int
    """Micro-batches per step on this rank (the pipeline's microbatches under pp)."""
    meta: CheckpointMeta
    """What every checkpoint of this run records (its step and samples added on save)."""
    dumper: Dumper | None
    parameter_order: list[str]
    """Every parameter name of the whole model in order: ranks holding different stages
    name the first non-finite gradient by it."""
    objective: Any
    """The training method's part of every step: an ``llmflow.train.objectives`` Objective."""
    dtype: torch.dtype
    """The compute dtype."""
    pipeline: Any = None
    """The torch.distributed.pipelining schedule of this rank's stages (pp > 1)."""
    pipeline_loss: Any = None
    """The pipeline schedule's loss function (the objective's)."""
    experts: list[torch.nn.Parameter] = field(default_factory=list)
    """The experts expert parallelism split over the ep ranks (DTensors on the "ep" mesh)."""
    moe_replicated: list[torch.nn.Parameter] = field(default_factory=list)
    """Under tp: the MoE blocks' other trainable weights, whole on every tp rank."""
    routing: RoutingLog | None = None
    """The experts' routing of the current step (a mixture-of-experts model, pp = 1)."""
    tied_copy: torch.nn.Parameter | None = None
    """Under pp with tied embeddings, on the last stage's ranks: the tied weight's second copy
    (its gradient is summed with the first stage's; the norm counts it once)."""
    start_step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    """The last step's metrics from its objective (``Objective.end_step``)."""

    def state(self, flatten: bool = True) -> dict[str, Any]:
        """What a checkpoint holds: the trainable weights and the optimizer state, each named
        by parameter name (flattened optimizer state: any layout reads it)."""
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        model: dict[str, Any] = {}
        optimizer: dict[str, Any] = {}
        for part, part_optimizer in zip(self.parts, self.optimizers, strict=True):
            model.update(trainable_state(part, self.config.lora is not None))
            optimizer.update(get_optimizer_state_dict(part, part_optimizer, options=options))
        return {"model": model, "optimizer": optimizer}


def held(run: Run, batch: Batch) -> torch.Tensor | None:
    """The positions of ``batch``'s sequences this rank holds under cp (None: all)."""
    layout = run.topo.layout
    if layout.cp == 1:
        return None
    return held_positions(batch["input_ids"].shape[1], run.topo.cp_rank, layout.cp, run.config.cp_algo)


def rank_sum_scale(run: Run) -> int:
    """dp * cp where FSDP averages the gradients over the dp and cp ranks (a loss each rank
    holds a share of is multiplied by it, so that the gradients add up), else 1."""
    return run.topo.layout.dp * run.topo.layout.cp if run.sharded else 1


def sequence_shard(run: Run, batch: Batch) -> Batch:
    """The model's keyword arguments for ``batch`` on this rank: under cp its part of the
    tokens, targets and positions (``shard_sequence``), with the whole sequence's document ids."""
    layout = run.topo.layout
    targets = batch.get("sequence_targets", batch["targets"])
    return shard_sequence(batch["input_ids"], targets, batch["position_ids"], batch["document_ids"],
                          run.topo.cp_rank, layout.cp, run.config.cp_algo)


def model_inputs(run: Run, batch: Batch) -> Batch:
    """``sequence_shard`` of ``batch`` on this rank's device."""
    device = run.env.device
    return {k: (v.to(device) if v is not None else None) for k, v in sequence_shard(run, batch).items()}


def pipeline_run(run: Run, batches: list[Batch], schedule_call) -> list[torch.Tensor]:
    """``batches`` through the pipeline schedule's ``step`` or ``eval``: the micro-batches go
    in as one batch the schedule splits again; every stage gets the labels, positions and
    document ids as keyword arguments. Returns the loss function's values (last stage)."""
    device = run.env.device
    shards = [sequence_shard(run, batch) for batch in batches]
    input_ids, targets, positions = (torch.cat([b[key] for b in shards]).to(device)
                                     for key in ("input_ids", "labels", "position_ids"))
    # A stage after the first sees hidden states (a sequence shard under tp): it takes the positions.
    extra = {"position_ids": positions}
    if any(b["document_ids"] is not None for b in shards):
        extra["document_ids"] = torch.cat([b["document_ids"] if b["document_ids"] is not None
                                           else torch.zeros_like(batch["input_ids"])
                                           for b, batch in zip(shards, batches, strict=True)]).to(device)
    losses: list[torch.Tensor] = []
    reduction = "none" if run.objective.token_losses else "sum"
    schedule_call(input_ids, target=targets, losses=losses, return_outputs=False, labels=targets,
                  loss_reduction=reduction, **extra)
    return losses


def all_reduce_over(tensor: torch.Tensor, *groups: Any, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """``tensor`` reduced in place by ``op`` (a sum by default) over each group of ``groups``
    that exists (None: a dimension of size 1)."""
    for group in groups:
        if group is not None:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def frozen_model(run: Run) -> CausalLM:
    """The run's initial weights once more (a reference model), sharded as the policy is
    (pp = 1), without gradients or optimizer."""
    config = run.config
    source = sharded_source(config.model)
    model = meta_model(source) if source is not None else load_model(config.model, run.env.device)[0]
    parallelize_decoder(model, run.topo.mesh, fsdp_dtype=run.dtype if run.sharded else None, cp_algo=config.cp_algo)
    if source is not None:
        load_sharded(model, [model], source, run.env.device)
    return model.requires_grad_(False)
