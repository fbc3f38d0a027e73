"""Pipeline parallelism for the decoder, applied from outside the model.

The model is cut into ``pp * virtual_stages`` consecutive stages of decoder layers: stage 0
also holds the embedding, the last stage the final norm and the output projection (its
forward returns the summed cross-entropy, so the loss stays fused there). A stage is a
``CausalLM`` holding only its own modules, the very module objects of the whole model, under
their original names (layers sit in a ModuleDict keyed by layer number), so checkpoints,
LoRA and precision dumps see the same names at any layout.

Stages are placed round-robin over the pipeline ranks (Megatron's interleaving): rank r
holds stages r, r + pp, r + 2 pp, ...; with one stage per rank that is the plain split.
``pipeline_schedule`` wraps a rank's stages in ``torch.distributed.pipelining`` stages and
one of its schedules (GPipe, 1F1B, Interleaved1F1B).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from llmflow.models.decoder import CausalLM

SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")
"""Pipeline schedules by the names MindSpeed/Megatron users know them."""


def layer_split(num_layers: int, stages: int, num_layer_list: Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each stage: ``num_layer_list`` (layers per stage, as MindSpeed's
    ``--num-layer-list``) or an even split, earlier stages taking one more when it is uneven."""
    if num_layer_list is None:
        base, extra = divmod(num_layers, stages)
        num_layer_list = [base + (1 if i < extra else 0) for i in range(stages)]
    starts = [sum(num_layer_list[:i]) for i in range(len(num_layer_list))]
    return [range(start, start + count) for start, count in zip(starts, num_layer_list, strict=True)]


def rank_stages(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds (round-robin, Megatron's interleaving)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


def stage_model(model: CausalLM, layers: range, first: bool, last: bool) -> CausalLM:
    """The part of ``model`` one stage runs: ``layers``, plus the embedding when ``first``
    and the norm and output projection when ``last``. Shares the modules of ``model``. With
    tied embeddings the last stage also holds the embedding module (never called there): its
    output projection's weight keeps the embedding's name, as in the whole model."""
    with torch.device("meta"):
        stage = CausalLM(dataclasses.replace(model.config, num_hidden_layers=0))
    decoder = stage.model
    decoder.config = model.config
    stage.config = model.config
    decoder.layers = nn.ModuleDict({str(i): model.model.layers[str(i)] for i in layers})
    decoder.embed_tokens = model.model.embed_tokens if first or (last and model.config.tie_word_embeddings) else None
    decoder.norm = model.model.norm if last else None
    stage.lm_head = model.lm_head if last else None
    decoder.inv_freq, decoder.sliding_inv_freq = model.model.inv_freq, model.model.sliding_inv_freq
    return stage


def split_model(model: CausalLM, pp_rank: int, pp: int, virtual_stages: int = 1,
                num_layer_list: Sequence[int] | None = None) -> list[tuple[int, CausalLM]]:
    """This pipeline rank's stages of ``model``: (stage index, stage model) pairs."""
    num_stages = pp * virtual_stages
    split = layer_split(model.config.num_hidden_layers, num_stages, num_layer_list)
    return [(i, stage_model(model, split[i], i == 0, i == num_stages - 1)) for i in rank_stages(pp_rank, pp, virtual_stages)]


class ScaledLoss:
    """The schedule's loss function: the last stage's output is the micro-batch's summed
    cross-entropy; backward runs on it times ``scale`` (set per step: the data-parallel
    degree over the global batch's target tokens, so the gradients are those of the global
    mean)."""

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, output: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        return output * self.scale


def pipeline_schedule(
    stages: list[tuple[int, nn.Module]],
    num_stages: int,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    group: torch.distributed.ProcessGroup,
):
    """The ``torch.distributed.pipelining`` schedule running this rank's ``stages`` over the
    pipeline process ``group``. Gradients are not rescaled by the schedule: ``loss_fn``
    scales them (``ScaledLoss``)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    wrapped = [PipelineStage(module, index, num_stages, device, group=group) for index, module in stages]
    if schedule == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(wrapped, microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(wrapped) != 1:
        raise ValueError(f"pp_schedule {schedule} runs one stage per rank; {len(wrapped)} need Interleaved1F1B")
    single = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule]
    return single(wrapped[0], microbatches, loss_fn=loss_fn, scale_grads=False)
