"""This rank's part of a parameter a parallel plan split (``models/parallelize.py``,
``models/expert_parallel.py``), for blocks that compute with it beside plain tensors."""

from __future__ import annotations

import sys

import torch


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local shard when it is a DTensor, else ``tensor`` itself. DTensor is looked
    up, not imported: importing it takes a second, and a DTensor exists only where the code
    that made it has imported it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor
