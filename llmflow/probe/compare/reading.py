"""Reading dumps in msprobe's layout: the values of a rank folder's dump.json, in its order,
with their call stacks and (tensor mode) their saved tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from llmflow.probe.dump.dumper import LAYOUT, TENSOR_DIR
from llmflow.probe.dump.records import DTENSOR_TYPE, TENSOR_TYPE

Join = tuple[Literal["cat"], int] | tuple[Literal["cat_samples"], tuple[int, int]] | tuple[Literal["sum", "avg"], None]

PASS, WARNING, ERROR, UNMATCHED = "pass", "warning", "error", "N/A"
"""The results of a compared value, msprobe's."""


@dataclass
class Leaf:
    """One compared value of a dump: a tensor or a non-tensor argument."""

    name: str
    """Row name, e.g. Functional.linear.0.forward.input.0."""
    entry: str
    """The dump.json entry it belongs to, e.g. Functional.linear.0.forward."""
    side: str
    """input, parameters or output."""
    record: dict[str, Any]
    files: tuple[Path, ...] = ()
    """The saved tensor (tensor mode): one file, or one per rank when ranks were merged."""
    join: Join | None = None
    """How the files of merged ranks make the whole tensor: concatenated along a dimension
    (``("cat_samples", (dim, n))``: ``dim`` holds n samples' positions one after the other,
    and each sample's parts are concatenated), or summed (averaged) partial results."""
    scale: float = 1.0
    """What the whole tensor is multiplied by: a context-parallel group's gradients (see
    ``merge.merge_context_parallel``)."""
    problem: tuple[str, str] | None = None
    """(result, message) the comparison gives this value whatever its numbers: set when the
    ranks' values could not be put together."""

    @property
    def is_tensor(self) -> bool:
        return self.record.get("type") in (TENSOR_TYPE, DTENSOR_TYPE)


@dataclass
class RankDump:
    """One rank folder's dump, or the ranks of a tensor-parallel group put together."""

    name: str
    """The rank folder's name (rank0), or the first and last merged ones (rank0-1)."""
    mode: str
    """tensor, statistics or md5."""
    leaves: list[Leaf]
    """Every value, in dump.json's order (the order the calls finished)."""
    stacks: dict[str, list[str]]
    """Entry name -> call stack."""
    ranks: int = 1
    """How many ranks' dumps this holds."""


def leaves(dump: dict[str, Any], rank_dir: Path) -> list[Leaf]:
    """The values of the dump.json of ``rank_dir``, in its order, saved tensors with their files."""
    found: list[Leaf] = []
    for entry, value in dump["data"].items():
        if ".parameters_grad" in entry:  # older msprobe versions write no call count after it
            for pname, grads in value.items():  # msprobe names the rows {entry}.{param}
                _walk(grads[0] if len(grads) == 1 else grads, f"{entry}.{pname}", entry, "output", found)
            continue
        for key, part in value.items():
            side = key if key in ("output", "parameters") else "input"
            _walk(part, f"{entry}.{side}", entry, side, found)
    for leaf in found:
        if "data_name" in leaf.record:
            leaf.files = (rank_dir / TENSOR_DIR / leaf.record["data_name"],)
    return found


def _walk(value: Any, name: str, entry: str, side: str, found: list[Leaf]) -> None:
    if isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, f"{name}.{i}", entry, side, found)
    elif isinstance(value, dict) and isinstance(value.get("type"), str):
        # msprobe names a saved tensor's row after its file (a keyword argument: "kwargs", not "input").
        found.append(Leaf(value["data_name"].removesuffix(".pt") if "data_name" in value else name, entry, side, value))
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{name}.{key}", entry, side, found)
    elif value is None:  # an argument left out (a bias of None): a row, as msprobe makes
        found.append(Leaf(name, entry, side, {"type": "None", "value": None}))


def read_stacks(rank_dir: Path) -> dict[str, list[str]]:
    """Entry name -> call stack, from stack.json in msprobe's grouped layout
    ({"0": [[names], [frames]]}) or its older one ({name: [frames]})."""
    path = rank_dir / "stack.json"
    stacks: dict[str, list[str]] = {}
    for key, value in (json.loads(path.read_text()) if path.is_file() else {}).items():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
            stacks.update({name: value[1] for name in value[0]})
        else:
            stacks[key] = value
    return stacks


def read_rank(rank_dir: Path) -> RankDump:
    """The dump in the rank folder ``rank_dir``."""
    dump = json.loads((rank_dir / "dump.json").read_text())
    found = leaves(dump, rank_dir)
    if dump.get("task") == "tensor":
        mode = "tensor"
    else:
        mode = "md5" if any("md5" in leaf.record for leaf in found) else "statistics"
    return RankDump(rank_dir.name, mode, found, read_stacks(rank_dir))


@dataclass
class RankLayout:
    """Where a rank sat, from the layout.json llmflow's dumper writes beside dump.json."""

    rank: int | None
    stages: list[int | None]
    """The pipeline stage of each module the dumper recorded (one per stage this rank held)."""
    num_stages: int
    pipeline_group: list[int] | None
    """Global ranks of the rank's pipeline group, in stage-rank order; None outside pipelining."""
    meshes: list[dict[str, Any]]
    """Device meshes of the DTensor parameters: {"dims": [...], "ranks": nested lists}."""
    calls: list[dict[str, Any]]
    """Each forward call of a stage, in order: {"stage": s, "counts": {key: [first, end)}}."""
    cp_group: list[int] | None = None
    """Global ranks of the rank's context-parallel group, in cp-rank order; None without context parallelism."""
    cp_algo: str | None = None
    """How the cp ranks share the sequence: "ulysses" (contiguous shards in cp-rank order) or "ring"."""

    @property
    def tp_group(self) -> list[int] | None:
        """The global ranks of this rank's tensor-parallel group (the "tp" dimension of a mesh
        holding it), or None when no DTensor parameter lies on a tensor-parallel mesh."""
        for mesh in self.meshes:
            if "tp" not in mesh["dims"] or self.rank is None:
                continue
            ranks = np.array(mesh["ranks"])
            where = np.argwhere(ranks == self.rank)
            if len(where):
                index = list(where[0])
                index[mesh["dims"].index("tp")] = slice(None)
                return ranks[tuple(index)].tolist()
        return None

    @property
    def placement(self) -> tuple:
        """What two runs must share to be compared rank by rank."""
        return tuple(self.stages), self.num_stages, self.pipeline_group, self.tp_group, self.cp_group, self.cp_algo


def read_layout(rank_dir: Path) -> RankLayout | None:
    """The layout.json of ``rank_dir``; None for a dump without one (msprobe's, or an older llmflow's)."""
    path = rank_dir / LAYOUT
    if not path.is_file():
        return None
    tree = json.loads(path.read_text(encoding="utf-8"))
    return RankLayout(tree.get("rank"), tree["stages"], tree["num_stages"], tree.get("pipeline_group"),
                      tree.get("meshes", []), tree.get("calls", []), tree.get("cp_group"), tree.get("cp_algo"))


def rank_dirs(path: Path) -> dict[str, Path]:
    """The rank folders of a step folder by name, or ``path`` itself when it is one."""
    if (path / "dump.json").is_file():
        return {path.name: path}
    found = {p.name: p for p in sorted(path.iterdir()) if p.name.startswith("rank") and (p / "dump.json").is_file()}
    if not found:
        raise FileNotFoundError(f"{path}: no dump.json in it or in rank folders under it")
    return dict(sorted(found.items(), key=lambda item: _rank_number(item[0])))


def _rank_number(name: str) -> int:
    digits = name.removeprefix("rank")
    return int(digits) if digits.isdigit() else -1


def load_tensor(leaf: Leaf) -> torch.Tensor:
    """The saved tensor of ``leaf``, the merged ranks' files put together."""
    parts = [torch.load(path, map_location="cpu", weights_only=True) for path in leaf.files]
    whole = _joined(parts, leaf.join)
    return whole * leaf.scale if leaf.scale != 1 else whole


def _joined(parts: list[torch.Tensor], join: Join | None) -> torch.Tensor:
    if join is None:
        return parts[0]
    how, where = join
    if how == "cat":
        return torch.cat(parts, dim=where)
    if how == "cat_samples":
        dim, samples = where
        return torch.cat([part.unflatten(dim, (samples, -1)) for part in parts], dim=dim + 1).flatten(dim, dim + 1)
    total = torch.stack(parts).sum(dim=0)
    return total / len(parts) if how == "avg" else total


def load_array(leaf: Leaf) -> np.ndarray:
    """``load_tensor`` as a numpy array: complex as magnitude, half precisions and bool as float32."""
    tensor = load_tensor(leaf)
    if tensor.is_complex():
        tensor = tensor.abs()
    if tensor.dtype in (torch.bfloat16, torch.float16, torch.bool):
        tensor = tensor.float()  # numpy has no bfloat16
    return tensor.numpy()
