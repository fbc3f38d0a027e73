"""The records of dump.json: one per argument or result of a dumped call.

Field names, their order and the non-tensor forms follow msprobe's dump.json reference
(Ascend/mstt, ``debug/accuracy_tools/msprobe/docs/27.dump_json_instruction.md``) and its
PyTorch data processor: a tensor is ``{"type": "torch.Tensor", "dtype", "shape", "Max",
"Min", "Mean", "Norm", "requires_grad"}``, plus ``"md5"`` (the CRC-32 of its bytes, as
msprobe computes it) in md5 mode and ``"data_name"`` (its file under dump_tensor_data/)
in tensor mode; a DTensor is recorded as this rank's shard, of type
``"torch.distributed.tensor.DTensor"`` with ``"device_mesh"`` and ``"placements"``; other
values are ``{"type", "value"}``; None stays null.

Statistics are computed on the tensor's device and read back once per step, not once per
tensor, so dumping does not synchronise the device at every call.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Shard

TENSOR_TYPE = "torch.Tensor"
DTENSOR_TYPE = "torch.distributed.tensor.DTensor"
"""msprobe's type of a DTensor's record, which adds the mesh ("device_mesh", the ranks) and
the "placements" to a tensor's fields."""


def _gap_free(t: torch.Tensor) -> bool:
    """Whether the elements fill one block of memory, in any order (a tensor, a reshape or a
    permutation of it; not a slice with gaps, not an expanded view)."""
    if t.is_contiguous():
        return True
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1)
    return span == t.numel()


PARALLEL_STATISTICS_MIN = 2**18
"""Elements from which a CPU tensor's statistics use the intra-op threads; the probe runs
its other work on one thread (see ``dump._Session._quietly``)."""


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op CPU threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _statistics(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(max, min, mean, L2 norm) as 0-d tensors; half precisions reduced in float32."""
    x = t if t.dtype in (torch.float32, torch.float64) else t.float()
    if x.ndim == 0:
        return (x.clone(),) * 4  # msprobe reports a scalar's value for all four
    # amax and amin run faster than aminmax on CPU.
    return x.amax(), x.amin(), x.mean(), _norm(x)


_NORM_ROWS = 64


def _norm(x: torch.Tensor) -> torch.Tensor:
    # A CPU vector norm over one dimension runs on one thread; the norm of 64 row norms
    # spreads a large tensor over the intra-op threads (and is as deterministic).
    if x.device.type == "cpu" and x.numel() >= PARALLEL_STATISTICS_MIN and x.is_contiguous() and x.numel() % _NORM_ROWS == 0:
        return torch.linalg.vector_norm(torch.linalg.vector_norm(x.view(_NORM_ROWS, -1), dim=1))
    return torch.linalg.vector_norm(x)


def _identity(t: torch.Tensor, any_order: bool) -> tuple | None:
    """What makes two tensors hold the same values: the same memory, layout and version (views
    share their base's version counter, which every in-place write bumps). With ``any_order``
    (``t`` fills one block and only the multiset of values matters, as for statistics), the
    reshapes and permutations of the block count as the same."""
    try:
        version = t._version
    except RuntimeError:  # inference tensors keep no version
        return None
    layout = t.numel() if any_order else (tuple(t.shape), t.stride())
    return t.device, t.dtype, t.data_ptr(), layout, version


def _data_ptr(tensor: torch.Tensor) -> int:
    """Where a tensor's (a DTensor's local shard's) elements start; 0 once its memory is freed."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).data_ptr()


def _placement(placement: Placement) -> dict[str, Any]:
    """msprobe's record of a DTensor placement: {"Shard": {"dim": d}}, {"Replicate": {}} or
    {"Partial": {"reduce_op": "sum"}}."""
    if isinstance(placement, Shard):
        return {"Shard": {"dim": placement.dim}}
    if isinstance(placement, Partial):
        return {"Partial": {"reduce_op": placement.reduce_op}}
    return {"Replicate": {}}


def crc32(t: torch.Tensor) -> str:
    """msprobe's "md5" of a tensor: the CRC-32 of its bytes (bfloat16 widened to float32)."""
    t = t.float() if t.dtype == torch.bfloat16 else t
    return f"{zlib.crc32(t.cpu().contiguous().numpy().tobytes()):08x}"


def _value(value: Any) -> dict[str, Any] | None:
    if isinstance(value, torch.dtype):
        return {"type": "torch.dtype", "value": str(value)}
    if isinstance(value, torch.device):
        return {"type": "torch.device", "value": str(value)}
    if isinstance(value, slice):
        return {"type": "slice", "value": [None if v is None else int(v) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"type": "ellipsis", "value": "..."}
    if isinstance(value, np.generic):
        return {"type": type(value).__name__, "value": value.item()}
    if isinstance(value, (bool, int, float, str)):
        return {"type": type(value).__name__, "value": value}
    return None


class RecordBuilder:
    """Turns the arguments and results of calls into records; statistics are filled in by ``finish``."""

    def __init__(self, md5: bool, tensor_dir: Path | None, threads: int = 1) -> None:
        self.md5 = md5
        self.tensor_dir = tensor_dir
        """Where tensor mode saves each tensor; None in statistics mode."""
        self.threads = threads
        """CPU threads for the statistics of large tensors."""
        self._pending: list[tuple[dict[str, Any], tuple[torch.Tensor, ...]]] = []
        # The output of one call is the input of the next, and a module's inputs and outputs
        # are its APIs': each tensor's statistics are computed once. An entry stays valid
        # while the tensor it was computed on lives and keeps its memory (FSDP2 frees an
        # unsharded parameter's memory after its module ran, and another parameter may get it).
        self._seen: dict[tuple, tuple[weakref.ref, int, tuple[torch.Tensor, ...], str | None]] = {}

    def build(self, value: Any, data_name: str) -> Any:
        """The record of ``value``; ``data_name`` ("Functional.linear.0.forward.input") names its
        tensors' files, extended by the position or key of each nested value."""
        if isinstance(value, torch.Tensor):
            return self._tensor(value, data_name)
        if isinstance(value, torch.Size):
            return {"type": "torch.Size", "value": list(value)}
        if isinstance(value, (list, tuple)):
            return [self.build(v, f"{data_name}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {str(k): self.build(v, f"{data_name}.{k}") for k, v in value.items()}
        return _value(value)

    def _tensor(self, tensor: torch.Tensor, data_name: str) -> dict[str, Any]:
        requires_grad = tensor.requires_grad
        # A DTensor is dumped as this rank's shard, with its layout: no collectives inside
        # hooks, so ranks left out of the dump cannot hang the ones that dump. The comparison
        # puts the shards of the ranks together.
        distributed = isinstance(tensor, DTensor)
        t = (tensor.to_local() if distributed else tensor).detach()
        record: dict[str, Any] = {
            "type": DTENSOR_TYPE if distributed else TENSOR_TYPE,
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "Max": None,
            "Min": None,
            "Mean": None,
            "Norm": None,
            "requires_grad": requires_grad,
        }
        if distributed:
            record["device_mesh"] = tensor.device_mesh.mesh.tolist()
            record["placements"] = [_placement(p) for p in tensor.placements]
        if not t.is_meta:
            self._summarise(record, t, tensor)
        if self.tensor_dir is not None:
            record["data_name"] = f"{data_name}.pt"
            torch.save(t.cpu().clone(memory_format=torch.contiguous_format), self.tensor_dir / record["data_name"])
        return record

    def _summarise(self, record: dict[str, Any], t: torch.Tensor, owner: torch.Tensor) -> None:
        """Fill in (or queue) the statistics of ``record`` and, in md5 mode, its CRC-32."""
        if t.numel() > 0 and t.dtype != torch.bool and not t.is_complex():
            stats, checksum = self._summary(t, owner)
            self._pending.append((record, stats))
        else:
            checksum = crc32(t) if self.md5 else None
            if t.numel() > 0 and t.dtype == torch.bool:
                record["Max"], record["Min"] = bool(t.any()), bool(t.all())  # msprobe: any, all
            elif t.numel() > 0:
                magnitude = t.abs()
                record["Max"], record["Min"], record["Mean"] = (float(v) for v in (magnitude.max(), magnitude.min(), magnitude.mean()))
        if self.md5:
            record["md5"] = checksum

    def _summary(self, t: torch.Tensor, owner: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], str | None]:
        """(statistics, CRC-32 in md5 mode) of a non-empty real tensor, computed once per
        identity; ``owner`` is the caller's tensor, whose life keeps the entry valid."""
        gap_free = _gap_free(t)
        key = _identity(t, any_order=gap_free and not self.md5)  # a CRC-32 depends on the order
        seen = self._seen.get(key) if key is not None else None
        if seen is not None and (holder := seen[0]()) is not None and _data_ptr(holder) == seen[1]:
            return seen[2], seen[3]
        if not gap_free:
            t = t.contiguous()  # reductions over a strided slice run slower than a copy and a pass
        parallel = t.device.type == "cpu" and t.numel() >= PARALLEL_STATISTICS_MIN and self.threads > 1
        with cpu_threads(self.threads) if parallel else contextlib.nullcontext():
            stats = _statistics(t)
        summary = stats, crc32(t) if self.md5 else None
        if key is not None:
            self._seen[key] = (weakref.ref(owner), _data_ptr(owner), *summary)
        return summary

    def finish(self) -> None:
        """Fill in the statistics of every record built so far (one device-to-host copy per
        device and dtype)."""
        groups: dict[tuple, list[tuple[dict[str, Any], tuple[torch.Tensor, ...]]]] = defaultdict(list)
        for record, stats in self._pending:
            groups[stats[0].device, stats[0].dtype].append((record, stats))
        for items in groups.values():
            values = torch.stack([value for _, stats in items for value in stats]).tolist()
            for i, (record, _) in enumerate(items):
                record.update(zip(("Max", "Min", "Mean", "Norm"), values[4 * i : 4 * i + 4], strict=True))
        self._pending.clear()
        self._seen.clear()
