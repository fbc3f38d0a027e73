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

The ranks of a Ulysses context-parallel group (cp=2 against cp=1, ``merge_context_parallel``)
hold contiguous shards of every sequence, in cp-rank order, and the attention kernel's head
shards of the whole sequence. Nothing in a plain tensor's record says which it is, so a value
is put together only where its shapes and values tell:

- a value whose shape differs from the other run's by the ranks' ratio along one dimension
  (the sequence, or the kernel's heads) is concatenated along it; where that dimension has
  batch x the rank's positions (the batch flattened with the sequence, as the loss takes
  its tokens), each sample's positions are concatenated. A non-constant value that is the
  same on every rank is left uncompared: values of each rank's own positions (indices
  counted from its first one) are no shards of the whole's;
- a value of the other run's shape that every rank holds alike (the weights, the whole
  sequence's document ids and masks) is taken once; one that differs between the ranks is a
  result over each rank's own positions (the loss, a partial sum) and is left uncompared;
- gradients: the training loop multiplies each rank's loss by dp x cp (FSDP2 averages the
  gradients over those ranks), so a cp rank's gradients are cp times a run's without cp,
  and are divided by cp once put together. The gradient of a value every rank holds whole
  (a weight) is each rank's part, from its own positions: the parts are added up in tensor
  mode (their mean, with the division) and left uncompared in the other modes;
- a non-tensor argument must be the same on every rank; an integer cp times smaller than
  the other run's is a size of the rank's part of the sequence, and is left uncompared, as
  are the arguments that differ from the other run's in a call given tensors of other
  shapes (Ulysses repeats the key/value heads when cp does not divide them, and the
  attention kernel then runs without grouped-query attention);
- API calls the training loop made outside the model's forward are left uncompared: there
  it works on each rank's part of the batch and share of the loss.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from llmflow.probe.compare.reading import UNMATCHED, WARNING, Join, Leaf, RankDump, load_tensor

_STATS = ("Max", "Min", "Mean", "Norm")
_GRADIENT = re.compile(r"\.(backward|parameters_grad)(\.\d+)?$")
"""The dump.json entries that hold gradients: backward calls and parameters_grad."""

CP_OUTSIDE = ("made outside the model's forward (by the training loop, on each cp rank's part of the batch and share "
              "of the loss): not merged across the cp ranks")
CP_LOCAL = ("the same on every cp rank though shaped as a shard: values of each rank's own positions (such as indices "
            "counted from its first one), not shards of the whole")
CP_REDUCTION = ("different on each cp rank in the whole's shape: a result over each rank's own positions (a partial "
                "sum, such as the loss), not merged")
CP_SHAPE = "shape {shape} on each of the {ranks} cp ranks does not make the other run's {other}"
_SHAPE = CP_SHAPE.partition("{")[0]
CP_ARGUMENT = ("an argument of a call whose tensors on the cp ranks do not make the other run's shapes (Ulysses repeats "
               "the key/value heads to one per query head when cp does not divide them): not compared")
CP_SIZE = "{value} on each of the {ranks} cp ranks against {other}: a size of each rank's part of the sequence, not the whole's"
CP_GRADIENT_PARTS = ("each cp rank's part of the gradient of a value they all hold (from its own positions): statistics "
                     "cannot be combined into their sum's")


def _same_entries(ranks: list[RankDump]) -> Iterator[tuple[Leaf, list[Leaf | None]]]:
    """Each value of the first rank's dump with the same-named value of every rank (None
    where a rank has none), in rank order."""
    by_name = [{leaf.name: leaf for leaf in rank.leaves} for rank in ranks[1:]]
    for leaf in ranks[0].leaves:
        yield leaf, [leaf, *(names.get(leaf.name) for names in by_name)]


def merge_ranks(ranks: list[RankDump], other: RankDump, hints: dict[str, Leaf] | None = None) -> RankDump:
    """The dumps of ``ranks`` (one tensor-parallel group, in rank order) as one dump, laid out
    to compare with ``other`` (a run with ``other.ranks`` ranks). ``hints`` gives, by name,
    whole values to take a plain tensor's shard dimension from instead of ``other``'s (the
    value a previous pipeline stage sent, for the one a stage received)."""
    hints = hints or {}
    first = ranks[0]
    reference = {leaf.name: leaf for leaf in other.leaves}
    merged = []
    for leaf, shards in _same_entries(ranks):
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


def merge_context_parallel(ranks: list[RankDump], other: RankDump, outside: set[str], tokens: tuple[int, int]) -> RankDump:
    """The dumps of ``ranks`` (one Ulysses context-parallel group, in cp-rank order) as one
    dump, laid out to compare with ``other`` (a run with ``other.ranks`` ranks); the entries
    in ``outside`` (the training loop's API calls outside the model's forward) are left
    uncompared; ``tokens``: the batch size and each rank's positions of the model's input.
    See the module's docstring for what is put together and how."""
    first = ranks[0]
    reference = {leaf.name: leaf for leaf in other.leaves}
    merged = []
    for leaf, shards in _same_entries(ranks):
        if leaf.entry in outside:
            merged.append(_uncompared(leaf, CP_OUTSIDE))
        elif any(shard is None for shard in shards):
            merged.append(_uncompared(leaf, "not dumped by every rank of the group"))
        elif not leaf.is_tensor:
            merged.append(_cp_value(shards, reference.get(leaf.name), other.ranks))
        else:
            gradient = _GRADIENT.search(leaf.entry) is not None
            merged.append(_cp_tensor(shards, reference.get(leaf.name), other.ranks, first.mode, gradient, tokens))
    # A call given other tensors than the other run's may take other arguments with them.
    reshaped = {leaf.entry for leaf in merged if leaf.problem is not None and leaf.problem[1].startswith(_SHAPE)}
    for i, leaf in enumerate(merged):
        counterpart = reference.get(leaf.name)
        if (leaf.entry in reshaped and not leaf.is_tensor and leaf.problem is None and counterpart is not None
                and counterpart.record != leaf.record):
            merged[i] = _uncompared(leaf, CP_ARGUMENT)
    name = f"{first.name}-{ranks[-1].name.removeprefix('rank')}"
    return RankDump(name, first.mode, merged, first.stacks, ranks=len(ranks))


def _cp_value(shards: list[Leaf], reference: Leaf | None, reference_ranks: int) -> Leaf:
    first = shards[0]
    if any(shard.record != first.record for shard in shards[1:]):
        return _uncompared(first, "a value that differs between the cp ranks")
    value = first.record.get("value")
    other = reference.record.get("value") if reference is not None else None
    if (type(value) is int and type(other) is int and value != other
            and value * len(shards) == other * reference_ranks):
        return _uncompared(first, CP_SIZE.format(value=value, ranks=len(shards), other=other))
    return first


def _cp_tensor(shards: list[Leaf], reference: Leaf | None, reference_ranks: int, mode: str, gradient: bool,
               tokens: tuple[int, int]) -> Leaf:
    first = shards[0]
    if first.record.get("placements") is not None:
        return _uncompared(first, "a DTensor under context parallelism: not merged")
    shape = first.record["shape"]
    if any(shard.record["shape"] != shape for shard in shards[1:]):
        return _uncompared(first, f"shapes differ between the cp ranks: {[s.record['shape'] for s in shards]}")
    alike = all(_same_record(shard, first) for shard in shards[1:])
    dim = _shard_dim(shards, reference, reference_ranks)
    if dim is not None:
        if alike and first.record.get("Max") != first.record.get("Min"):
            return _uncompared(first, CP_LOCAL)
        batch, positions = tokens
        flattened = batch > 1 and shape[dim] == batch * positions
        whole = _concatenate(shards, dim, mode, batch if flattened else None)
        return _unscaled(whole, len(shards), mode) if gradient else whole
    if alike:
        return _unscaled(first, len(shards), mode) if gradient else first
    if reference is not None and reference.is_tensor and reference.record["shape"] != shape:
        return _uncompared(first, CP_SHAPE.format(shape=shape, ranks=len(shards), other=reference.record["shape"]))
    if not gradient:
        return _uncompared(first, CP_REDUCTION)
    if mode != "tensor":
        return _uncompared(first, CP_GRADIENT_PARTS)
    return _reduce(shards, "avg", mode)  # the parts' sum, divided by cp as every gradient


def _uncompared(leaf: Leaf, reason: str) -> Leaf:
    return replace(leaf, problem=(UNMATCHED, reason))


def _unscaled(leaf: Leaf, ranks: int, mode: str) -> Leaf:
    """A cp group's gradient divided by its ``ranks``, which the training loop multiplied each
    rank's loss by."""
    if leaf.problem is not None:
        return leaf
    if mode == "md5":
        return _uncompared(leaf, f"a gradient {ranks} times a run's without cp (the training loop's loss scale): the "
                                 "CRC-32 of its quotient cannot be computed")
    record = dict(leaf.record)
    record.update({stat: record[stat] / ranks for stat in _STATS if type(record.get(stat)) in (int, float)})
    return replace(leaf, record=record, scale=leaf.scale / ranks)


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


def _concatenate(shards: list[Leaf], dim: int, mode: str, samples: int | None = None) -> Leaf:
    """The shards joined along ``dim``; with ``samples``, ``dim`` holds that many samples'
    positions one after the other, and each sample's shards are joined."""
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
    return _merged(shards, record, ("cat", dim) if samples is None else ("cat_samples", (dim, samples)), problem)


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
    for rank, shard in enumerate(shards[1:], start=1):
        if not _same_record(shard, first):
            return replace(first, problem=(WARNING, f"a replica whose copy on rank {rank} of the group differs from rank 0's"))
    return first


def _same_record(a: Leaf, b: Leaf) -> bool:
    """Whether two ranks' records of a tensor agree: statistics and CRC-32."""
    return all(_same(a.record.get(k), b.record.get(k)) for k in (*_STATS, "md5"))


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
