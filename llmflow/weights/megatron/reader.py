"""Reading a Megatron-LM / MindSpeed-LLM checkpoint without megatron-core or a process group,
one layer of one tensor at a time.

A checkpoint root holds ``latest_checkpointed_iteration.txt`` (an iteration number, or
"release") and the iteration's directory (``iter_0001000/`` or ``release/``), which is either
megatron-core's ``torch_dist`` format (``.metadata``, ``*.distcp``, ``common.pt``,
``metadata.json``) or the legacy per-rank layout (``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt``,
each rank's own shards of its pipeline stage's layers, numbered from 0 in each stage). Either
reads as the global, whole tensors of ``layout.py``.

torch_dist tensors are read through torch.distributed.checkpoint itself, one chunk range at a
time (``SliceLoadPlanner``); a legacy rank file is memory-mapped, so only the pages of the
tensors read are touched. ``args`` (Megatron-LM's argparse namespace) is read from
``common.pt`` or the rank files: it may hold megatron classes (enums), which read as
placeholders when megatron is not installed.
"""

from __future__ import annotations

import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from llmflow.weights.errors import CheckpointError
from llmflow.weights.megatron.layout import LAYERS, LOCAL_NORM_NAMES, OUTPUT, merge_shards

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


class _Placeholder:
    """Stands for a class of the checkpoint's pickle that cannot be imported here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Placeholder,), {"__module__": module})


class _TolerantPickle:
    """A pickle module for torch.load whose unpickler survives missing classes."""

    Unpickler = _TolerantUnpickler
    __name__ = "llmflow_tolerant_pickle"

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return _TolerantUnpickler(file, **kwargs).load()


def load_pickled(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` of a Megatron file (args are an argparse namespace, so not weights-only)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_TolerantPickle)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{path}: cannot read it ({type(error).__name__}: {error})") from error


def iteration_dir(root: Path) -> Path:
    """The directory of the iteration ``root``'s tracker file names (``root`` itself when it
    is an iteration directory)."""
    if not root.is_dir():
        raise CheckpointError(f"--megatron {root}: not a directory")
    if (root / "metadata.json").is_file() or any(root.glob(f"mp_rank_*/{LEGACY_FILE}")):
        return root
    tracker = root / TRACKER
    if not tracker.is_file():
        raise CheckpointError(
            f"--megatron {root}: no {TRACKER} (expected a Megatron-LM checkpoint root, or one iter_NNNNNNN "
            f"directory); found {sorted(p.name for p in root.iterdir())[:10]}")
    text = tracker.read_text().strip()
    if text == "release":
        directory = root / "release"
    elif text.isdigit():
        directory = root / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"{tracker}: {text!r} is neither an iteration number nor 'release'")
    if not directory.is_dir():
        raise CheckpointError(f"{tracker} names iteration {text}, but {directory} does not exist")
    return directory


class OpenedReader(dcp.FileSystemReader):
    """A DCP reader that reads the checkpoint's metadata once and serves it to every load (a
    conversion loads each layer of each tensor on its own)."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SliceLoadPlanner(LoadPlanner):
    """Loads one box of one tensor of a DCP checkpoint into ``out`` (whose shape is the box's
    ``sizes``), reading only the stored chunks that overlap it."""

    def __init__(self, fqn: str, offsets: tuple[int, ...], out: torch.Tensor) -> None:
        self.fqn, self.offsets, self.out = fqn, offsets, out

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata[self.fqn]
        box = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.out.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.fqn, stored, [box]))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"{self.fqn}: expected a tensor, the checkpoint holds bytes")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


@dataclass
class MegatronCheckpoint:
    """An opened checkpoint: its format, args and iteration, and its tensors by global key."""

    directory: Path
    format: str
    """torch_dist or legacy."""
    args: Any
    """Megatron-LM's argparse namespace (None when the checkpoint has none)."""
    iteration: int | None
    shapes: dict[str, tuple[int, ...]]
    """Global shape of each tensor, by torch_dist key (layers stacked on dim 0)."""
    dtypes: dict[str, torch.dtype]
    skipped: list[str] = field(default_factory=list)
    """What the checkpoint holds beside the model and is not read (optimizer, RNG states)."""
    _reader: OpenedReader | None = None
    _ranks: dict[tuple[int, int], dict[str, torch.Tensor]] | None = None
    _stage_layers: list[int] | None = None
    _recent: dict[tuple[str, int | None], torch.Tensor] = field(default_factory=dict)
    """The last tensors read: q, k and v (gate and up) come from one read."""

    def summary(self) -> dict[str, Any]:
        """What a manifest records of the source."""
        return {"directory": str(self.directory), "format": self.format, "iteration": self.iteration,
                "skipped": self.skipped}

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The global tensor ``key``, or its layer ``layer`` (layer tensors)."""
        if (key, layer) not in self._recent:
            if len(self._recent) >= 2:
                self._recent.pop(next(iter(self._recent)))
            read = self._read_dcp if self.format == "torch_dist" else self._read_legacy
            self._recent[(key, layer)] = read(key, layer)
        return self._recent[(key, layer)]

    def read_rows(self, key: str, out: torch.Tensor) -> None:
        """The first ``len(out)`` rows of ``key`` (a vocabulary matrix) read straight into ``out``."""
        if self.format == "torch_dist":
            self._load_box(key, (0,) * out.dim(), out)
        else:
            out.copy_(self._read_legacy(key, None)[: out.shape[0]])

    def _read_dcp(self, key: str, layer: int | None) -> torch.Tensor:
        shape = self.shapes[key]
        if layer is None:
            out = torch.empty(shape, dtype=self.dtypes[key])
            self._load_box(key, (0,) * len(shape), out)
            return out
        out = torch.empty((1, *shape[1:]), dtype=self.dtypes[key])
        self._load_box(key, (layer,) + (0,) * (len(shape) - 1), out)
        return out[0]

    def _load_box(self, key: str, offsets: tuple[int, ...], out: torch.Tensor) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({}, storage_reader=self._reader, planner=SliceLoadPlanner(key, offsets, out), no_dist=True)

    def _read_legacy(self, key: str, layer: int | None) -> torch.Tensor:
        assert self._ranks is not None and self._stage_layers is not None
        tp = 1 + max(t for t, _ in self._ranks)
        name = key.removeprefix(LAYERS)
        if layer is None:
            stage = 0 if key != OUTPUT and "final_layernorm" not in key else len(self._stage_layers) - 1
            local = key
        else:
            stage, local_index = _stage_of(layer, self._stage_layers)
            local = f"{LAYERS}{local_index}.{_legacy_name(self._ranks[(0, stage)], local_index, name)}"
        return merge_shards(name if layer is not None else key, [self._ranks[(t, stage)][local] for t in range(tp)])


def _stage_of(layer: int, stage_layers: list[int]) -> tuple[int, int]:
    """(pipeline stage, index within it) of a global layer."""
    for stage, count in enumerate(stage_layers):
        if layer < count:
            return stage, layer
        layer -= count
    raise IndexError(layer)


def _legacy_name(state: dict[str, torch.Tensor], local: int, name: str) -> str:
    """A layer tensor's name in a legacy rank file: the torch_dist name, or the local spec's own."""
    if f"{LAYERS}{local}.{name}" in state:
        return name
    return next((own for own, common in LOCAL_NORM_NAMES.items() if common == name), name)


def _stacked_name(name: str) -> str:
    return LOCAL_NORM_NAMES.get(name, name)


def open_checkpoint(root: Path) -> MegatronCheckpoint:
    """The checkpoint under ``root`` (a root with its tracker file, or an iteration directory)."""
    directory = iteration_dir(root)
    if (directory / "metadata.json").is_file():
        return _open_torch_dist(directory)
    return _open_legacy(directory)


def _open_torch_dist(directory: Path) -> MegatronCheckpoint:
    reader = OpenedReader(directory)
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError, ValueError, pickle.UnpicklingError, AttributeError, ModuleNotFoundError) as error:
        raise CheckpointError(f"{directory / '.metadata'}: cannot read the torch_dist metadata ({error})") from error
    common = load_pickled(directory / "common.pt") if (directory / "common.pt").is_file() else {}
    shapes, dtypes, skipped = {}, {}, set()
    for key, stored in metadata.state_dict_metadata.items():
        if key.startswith(("optimizer.", "rng_state", "rerun_state_machine")):
            skipped.add(key.split(".", 1)[0].split("/", 1)[0])
        elif isinstance(stored, TensorStorageMetadata) and "_extra_state" not in key:
            shapes[key], dtypes[key] = tuple(stored.size), stored.properties.dtype
    return MegatronCheckpoint(directory, "torch_dist", common.get("args"), common.get("iteration"), shapes, dtypes,
                              sorted(skipped), _reader=reader)


def _rank_files(directory: Path) -> dict[tuple[int, int], Path]:
    files = {}
    for path in sorted(directory.glob(f"mp_rank_*/{LEGACY_FILE}")):
        match = _RANK_DIR.match(path.parent.name)
        if match is None:
            raise CheckpointError(f"{path.parent}: expected mp_rank_TT or mp_rank_TT_PPP (expert parallelism is not "
                                  "supported)")
        files[(int(match[1]), int(match[2] or 0))] = path
    return files


def _open_legacy(directory: Path) -> MegatronCheckpoint:
    files = _rank_files(directory)
    if not files:
        raise CheckpointError(f"--megatron {directory}: neither torch_dist (metadata.json) nor legacy "
                              f"(mp_rank_*/{LEGACY_FILE}) files")
    tp, pp = 1 + max(t for t, _ in files), 1 + max(p for _, p in files)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
               if (t, p) not in files]
    if missing:
        raise CheckpointError(f"{directory}: ranks {missing} are missing (found {len(files)} rank directories of a "
                              f"tp={tp}, pp={pp} layout); copy the whole iteration directory")
    loaded = {rank: load_pickled(path, mmap=True) for rank, path in files.items()}
    first = loaded[(0, 0)]
    if "model" not in first:
        chunks = sorted(k for k in first if re.fullmatch(r"model\d+", k))
        raise CheckpointError(f"{files[(0, 0)]}: no 'model' state" + (
            f" but {chunks}: virtual pipeline stages are not supported" if chunks else f"; keys {sorted(first)}"))
    ranks = {rank: state["model"] for rank, state in loaded.items()}
    stage_layers = [len({int(m[1]) for k in ranks[(0, p)] if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})
                    for p in range(pp)]
    shapes, dtypes = {}, {}
    for stage in range(pp):
        for key, tensor in ranks[(0, stage)].items():
            if not isinstance(tensor, torch.Tensor) or "_extra_state" in key:
                continue
            match = re.match(r"decoder\.layers\.(\d+)\.(.+)$", key)
            if match:
                if int(match[1]) != 0 or stage != 0:
                    continue
                name = _stacked_name(match[2])
                whole = merge_shards(name, [ranks[(t, 0)][key] for t in range(tp)])
                shapes[LAYERS + name] = (sum(stage_layers), *whole.shape)
                dtypes[LAYERS + name] = whole.dtype
            elif not (key == OUTPUT and pp > 1 and not _untied(first.get("args"))):  # the last stage's copy of a shared embedding
                whole = merge_shards(key, [ranks[(t, stage)][key] for t in range(tp)])
                shapes[key], dtypes[key] = tuple(whole.shape), whole.dtype
    skipped = sorted(k for k in first if k in ("optimizer", "opt_param_scheduler", "rng_state", "rerun_state_machine"))
    return MegatronCheckpoint(directory, "legacy", first.get("args"), first.get("iteration"), shapes, dtypes, skipped,
                              _ranks=ranks, _stage_layers=stage_layers)


def _untied(args: Any) -> bool:
    return bool(getattr(args, "untie_embeddings_and_output_weights", True))
