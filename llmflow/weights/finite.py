"""NaN and ±Inf in weights and gradients: refused on load, on save and at every step."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmflow.weights.errors import CheckpointError
from llmflow.weights.process_group import distributed


def all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``tensor``'s device: no value of ``tensor`` is NaN or ±Inf.
    One reduction pass (min and max propagate NaN), no copy of the tensor and no host sync."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.element_size() == 1:  # float8: no min/max kernel
        tensor = tensor.float()
    return torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


def nonfinite_message(tensor: torch.Tensor) -> str:
    """How many values of ``tensor`` are NaN and how many ±Inf, for an error message."""
    return f"{int(torch.isnan(tensor).sum())} NaN and {int(torch.isinf(tensor).sum())} Inf values of {tensor.numel()}"


def check_finite(tensor: torch.Tensor, where: str | Path, name: str) -> None:
    """Refuse a weight that holds NaN or ±Inf, naming the file (or directory) and the tensor."""
    if not bool(all_finite(tensor)):
        raise CheckpointError(
            f"{where}: tensor {name!r} holds non-finite numbers ({nonfinite_message(tensor)}); "
            "the file is damaged or the model diverged"
        )


def named_tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state dict (dicts and lists), by dotted path."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from named_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]], order: list[str] | None = None) -> str | None:
    """The first name, in ``order`` (every name any rank passes), whose tensor holds NaN or
    ±Inf on any rank, or None. Looks at each rank's own shards of DTensors. Under a process
    group it is a collective (one all-reduce agrees on the first); ranks may pass different
    names (pipeline stages), and without ``order`` the ranks' names are gathered, rank by rank."""
    from torch.distributed.tensor import DTensor

    names, flags = [], []
    for name, tensor in named:
        names.append(name)
        flags.append(all_finite(tensor.to_local() if isinstance(tensor, DTensor) else tensor))
    if order is None:
        order = names
        if distributed():
            gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, names)
            order = list(dict.fromkeys(name for rank_names in gathered for name in rank_names))
    device = flags[0].device if flags else None
    finite = torch.stack(flags).tolist() if flags else []
    first = torch.tensor(min((order.index(n) for n, ok in zip(names, finite, strict=True) if not ok), default=len(order)),
                         device=device)
    if distributed():
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    index = int(first)
    return order[index] if index < len(order) else None
