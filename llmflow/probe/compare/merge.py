"""Put the dumps of the ranks of one tensor-parallel group together, so that a run can be
compared with a run of another layout (tp=2 against tp=1): each value is rebuilt as the
whole tensor the model computes.

Each rank dumps its own shard, as msprobe does. How the shards of a value make the whole:

- a DTensor's record carries its placements (msprobe's ``"placements"``): ``Shard(d)``
  concatenates the ranks' shards along ``d``, ``Replicate`` takes rank 0's copy, and
  ``Partial`` (a sum not yet reduced across ranks) sums them;
- a plain tensor (parallel styles hand plain local tensors to the model's code, e.g. the
  sequence-sharded residual stream) is concatenated along the one dimension where its
  shape differs from the other run's by the ratio of the ranks (a shard of the sequence,
  of the heads, of the columns), and is a replica where the shapes agree.

Statistics combine as msprobe's parallel merge combines them (``msprobe/visualization/builder/graph_merger.py``,
``TPMerger``): Max of the maxima, Min of the minima, the mean of the means (weighted by the
shards' sizes), the root of the sum of the squared norms. What cannot be combined from
statistics (partial sums; the CRC-32 of shards) is left uncompared with the reason, and a
replica whose copies differ between ranks is flagged: a tensor-parallel bug of its own.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from llmflow.probe.compare.reading import UNMATCHED, WARNING, Join, Leaf, RankDump, load_tensor

_STATS = ("Max", "Min", "Mean", "Norm")


def merge_ranks(ranks: list[RankDump], other: RankDump, hints: dict[str, Leaf] | None = None) -> RankDump:
    """The dumps of ``ranks`` (one tensor-parallel group, in rank order) as one dump, laid out
    to compare with ``other`` (a run with ``other.ranks`` ranks). ``hints`` gives, by name,
    whole values to take a plain tensor's shard dimension from instead of ``other``'s (the
    value a previous pipeline stage sent, for the one a stage received)."""
    hints = hints or {}
    first = ranks[0]
    by_name = [{leaf.name: leaf for leaf in rank.leaves} for rank in ranks[1:]]
    reference = {leaf.name: leaf for leaf in other.leaves}
    merged = []
    for leaf in first.leaves:
        shards = [leaf, *(names.get(leaf.name) for names in by_name)]
        if any(shard is None for shard in shards):
            merged.append(replace(leaf, problem=(UNMATCHED, "not dumped by every rank of the group")))
        elif not leaf.is_tensor:
            merged.append(leaf)
        elif leaf.name in hints:
            merged.append(_merge_tensor(shards, hints[leaf.name], 1, first.mode))
        else:
            merged.append(_merge_tensor(shards, reference.get(leaf.name), other.ranks, first.mode))
    name = f"{first.name}-{ranks[-1].name.removeprefix('rank')}"
    return RankDump(name, first.mode, merged, first.stacks, ranks=len(ranks))


def _merge_tensor(shards: list[Leaf], reference: Leaf | None, reference_ranks: int, mode: str) -> Leaf:
    placements = shards[0].record.get("placements")
    if placements is not None:
        if len(placements) != 1:
            return replace(shards[0], problem=(UNMATCHED, f"a DTensor on a {len(placements)}-D mesh: only 1-D meshes are merged"))
        (kind, options), = placements[0].items()
        if kind == "Shard":
            return _concatenate(shards, options["dim"], mode)
        if kind == "Partial":
            return _reduce(shards, options.get("reduce_op", "sum"), mode)
        return _replica(shards)
    dim = _shard_dim(shards, reference, reference_ranks)
    return _replica(shards) if dim is None else _concatenate(shards, dim, mode)


def _shard_dim(shards: list[Leaf], reference: Leaf | None, reference_ranks: int) -> int | None:
    """The dimension a plain tensor is sharded along: where its shards' common shape differs
    from the reference's (itself a shard of ``reference_ranks`` ranks) by the ranks' ratio."""
    shape = shards[0].record["shape"]
    if reference is None or any(s.record["shape"] != shape for s in shards):
        return None
    other = reference.record.get("shape")
    if other is None or len(other) != len(shape):
        return None
    differing = [d for d, (a, b) in enumerate(zip(shape, other, strict=True)) if a != b]
    if len(differing) == 1 and shape[differing[0]] * len(shards) == other[differing[0]] * reference_ranks:
        return differing[0]
    return None


def _concatenate(shards: list[Leaf], dim: int, mode: str) -> Leaf:
    records = [s.record for s in shards]
    record = dict(records[0])
    shape = list(record["shape"])
    shape[dim] = sum(r["shape"][dim] for r in records)
    record["shape"] = shape
    record.update(_combined_statistics(records))
    problem = None
    if mode == "md5":
        record.pop("md5", None)
        problem = (UNMATCHED, f"sharded along dim {dim}: the CRC-32 of shards cannot be combined")
    return _merged(shards, record, ("cat", dim), problem)


def _reduce(shards: list[Leaf], reduce_op: str, mode: str) -> Leaf:
    if mode != "tensor" or reduce_op not in ("sum", "avg"):
        reason = "statistics cannot be combined" if mode != "tensor" else f"reduce_op {reduce_op} is not merged"
        return replace(shards[0], problem=(UNMATCHED, f"partial results on each rank (Partial({reduce_op})): {reason}"))
    join: Join = (reduce_op, None)
    record = dict(shards[0].record)
    whole = load_tensor(replace(shards[0], files=tuple(f for s in shards for f in s.files), join=join))
    x = whole.float()
    record.update(zip(_STATS, (x.max().item(), x.min().item(), x.mean().item(), x.norm().item()), strict=True))
    return _merged(shards, record, join, None)


def _replica(shards: list[Leaf]) -> Leaf:
    first = shards[0]
    keys = (*_STATS, "md5")
    for rank, shard in enumerate(shards[1:], start=1):
        if any(not _same(shard.record.get(k), first.record.get(k)) for k in keys):
            return replace(first, problem=(WARNING, f"a replica whose copy on rank {rank} of the group differs from rank 0's"))
    return first


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _merged(shards: list[Leaf], record: dict[str, Any], join: Join, problem: tuple[str, str] | None) -> Leaf:
    files = tuple(f for s in shards for f in s.files)
    return replace(shards[0], record=record, files=files, join=join if files else None, problem=problem)


def _combined_statistics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Max, Min, Mean and Norm of the concatenation of tensors with these records."""
    if any(not isinstance(r.get(stat), (int, float)) for r in records for stat in _STATS[:2]):
        return {stat: None for stat in _STATS}
    combined: dict[str, Any] = {"Max": max(r["Max"] for r in records), "Min": min(r["Min"] for r in records),
                                "Mean": None, "Norm": None}
    if all(isinstance(r.get("Mean"), (int, float)) for r in records):
        sizes = [math.prod(r["shape"]) for r in records]
        combined["Mean"] = sum(r["Mean"] * n for r, n in zip(records, sizes, strict=True)) / sum(sizes)
    if all(isinstance(r.get("Norm"), (int, float)) for r in records):
        combined["Norm"] = math.sqrt(sum(r["Norm"] ** 2 for r in records))
    return combined
