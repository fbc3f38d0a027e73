"""Expert parallelism, applied from outside the model: the experts of every MoE layer are
split over the ranks of an "ep" mesh dimension (dim 0 of each stacked projection and of
gpt-oss's per-expert biases, ``Shard(0)``: rank r holds experts [r E/ep, (r + 1) E/ep)), and each layer's tokens travel
to the ranks holding their experts and back with two all-to-alls.

``MoE.forward`` hands its experts the (token, choice) rows sorted by expert with the count
per expert. Here, before the experts run, the rows go to the rank of their expert (an
all-to-all of the counts, then of the rows), arriving grouped by source rank, and are
regrouped by local expert for the grouped matmul; afterwards the inverse regrouping and
all-to-all bring every row back to where it came from, in its original order. Both
all-to-alls carry gradients. Every rank computes with its own experts only: the routing is
dropless, whatever the load.

The experts' gradients are made whole by ``sum_gradients`` (the training loop calls it after
backward): each expert's gradient already holds every ep rank's tokens; the ranks holding the
same experts in other ep groups ("dp_replicate"), and under tensor parallelism the other
ranks of the sequence, add theirs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor

from llmflow.models.blocks.moe import MoE


class _Dispatch:
    """What the way back needs of one forward's dispatch (set on the way there)."""

    sent: list[int]
    received: list[int]
    order: torch.Tensor
    """For each row of the regrouped (by local expert) order, its row in arrival order."""


def _dispatch(module: nn.Module, inputs: tuple[torch.Tensor, ...], mesh: DeviceMesh):
    rows, counts, *scale = inputs
    group = mesh.get_group()
    ranks = mesh.size()
    local = counts.numel() // ranks
    # [ranks, local]: how many rows this rank sends to each rank's each expert, then receives.
    sending = counts.view(ranks, local)
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending, group=group)
    state = _Dispatch()
    state.sent = sending.sum(1).tolist()
    state.received = receiving.sum(1).tolist()
    # Arrival order is (source rank, local expert): regroup to (local expert, source rank).
    sizes = receiving.flatten()
    starts = (sizes.cumsum(0) - sizes).view(ranks, local).t().flatten()
    lengths = receiving.t().flatten()
    state.order = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths) + torch.arange(
        int(lengths.sum()), device=rows.device)
    module._dispatch = state
    arrived = [all_to_all_single_autograd(t, state.received, state.sent, group)[state.order] for t in (rows, *scale)]
    return arrived[0], receiving.sum(0), *arrived[1:]


def _combine(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    state = module._dispatch
    arrival_order = torch.empty_like(output).index_copy(0, state.order, output)
    return all_to_all_single_autograd(arrival_order, state.sent, state.received, mesh.get_group())


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split the experts of every MoE layer of ``model`` over the 1-D ``mesh``, in place."""
    for module in model.modules():
        if isinstance(module, MoE):
            distribute_module(module.experts, mesh, _shard_experts, input_fn=_dispatch, output_fn=_combine)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``apply_ep`` split (DTensors on the "ep" mesh; not those FSDP shards)."""
    return [p for module in model.modules() if isinstance(module, MoE)
            for p in module.experts.parameters() if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("ep",)]


def sum_gradients(params: list[nn.Parameter], groups: list[dist.ProcessGroup | None], scale: float = 1.0) -> None:
    """Sum the gradients of ``params`` (this rank's part of each) over each of ``groups`` in
    turn (None: skipped), then multiply them by ``scale``."""
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        for group in groups:
            if group is not None:
                dist.all_reduce(grad, group=group)
        if scale != 1.0:
            grad.mul_(scale)


def moe_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the MoE blocks that ``apply_ep`` did not split (the router, the shared
    expert, and the experts without expert parallelism)."""
    split = {id(p) for p in expert_parameters(model)}
    return [p for module in model.modules() if isinstance(module, MoE) for p in module.parameters()
            if id(p) not in split]
