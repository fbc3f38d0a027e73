"""The process group as the checkpoint code sees it: collective under torchrun, a plain
single process without one."""

from __future__ import annotations

import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if distributed() else 0


def barrier() -> None:
    if distributed():
        dist.barrier()
