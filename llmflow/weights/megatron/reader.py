"""Reading a Megatron-LM / MindSpeed-LLM checkpoint without megatron-core or a process group,
one layer of one tensor at a time.

A checkpoint root holds ``latest_checkpointed_iteration.txt`` (an iteration number, or
"release") and the iteration's directory (``iter_0001000/`` or ``release/``), which is either
megatron-core's ``torch_dist`` format (``.metadata``, ``*.distcp``, ``common.pt``,
``metadata.json``) or the legacy per-rank layout
(``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt``, each rank's own shards of its
pipeline stage's layers, numbered from 0 in each stage, and of its expert-parallel rank's
experts, numbered from 0 in each rank). Either reads as the whole tensors of ``layout.py``,
one layer at a time, by canonical key (``decoder.layers.{i}.{name}``, ``i`` the global layer).

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
from llmflow.weights.megatron.layout import (
    EMBEDDING,
    EXPERT_FC1,
    EXPERT_FC2,
    LAYERS,
    NORM_ALIASES,
    OUTPUT,
    Spec,
    layer_key,
    merge_shards,
)

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})((?:_\d{3}){0,2})$")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# A legacy file's routed experts: SequentialMLP's local experts, or TEGroupedMLP's GroupedLinear
# weights (one per local expert); the legacy GroupedMLP's weight1/weight2 are not read.
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_LEGACY_GROUPED_MLP = ("mlp.experts.weight1", "mlp.experts.weight2")
_EXPERT_NAMES = {"linear_fc1": EXPERT_FC1, "linear_fc2": EXPERT_FC2}


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
            f"directory); found {sorted(p.name for p in root.iterdir())[:10]}"
        )
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


@dataclass(frozen=True)
class _DcpTensor:
    """Where a torch_dist checkpoint holds one canonical tensor: its stored key, and its index
    on that key's stacked layer axis (None: the key holds it alone)."""

    key: str
    layer: int | None


@dataclass(frozen=True)
class _LegacyTensor:
    """Where legacy rank files hold one canonical tensor: the key in the files of pipeline
    stage ``stage`` (and of each expert-parallel rank, for routed experts), merged over the
    tensor-parallel ranks as ``merge`` merges in a file of the layer spec ``spec``."""

    stage: int
    key: str
    merge: str
    experts: tuple[tuple[int, str], ...] = ()
    """Routed experts: (expert-parallel rank, key in its files) of each expert in global order."""
    spec: Spec = "local"


def canonical_name(name: str) -> str:
    """A layer tensor's canonical name from any spec's (``pre_mlp_layernorm.weight``, the local
    spec's ``input_layernorm.weight``: the fused names; the Transformer Engine spec's fused MLA
    latent norms: the local spec's ``q_layernorm``/``kv_layernorm``)."""
    return NORM_ALIASES.get(name, name)


def legacy_spec(names: list[str]) -> Spec:
    """The layer spec whose modules saved a legacy file of tensors ``names``: the Transformer
    Engine spec fuses norms into linear layers (``*.layer_norm_weight``), the local spec never
    does. It tells how MLA's down projections are split (``merge_shards``)."""
    return "transformer_engine" if any(name.endswith(".layer_norm_weight") for name in names) else "local"


@dataclass
class MegatronCheckpoint:
    """An opened checkpoint: its format, args and iteration, and its tensors by canonical key
    (outside the layers the torch_dist key; a layer's ``decoder.layers.{i}.{name}``)."""

    directory: Path
    format: str
    """torch_dist or legacy."""
    args: Any
    """Megatron-LM's argparse namespace (None when the checkpoint has none)."""
    iteration: int | None
    shapes: dict[str, tuple[int, ...]]
    """Shape of each tensor (one layer's, for a layer tensor), by canonical key."""
    dtypes: dict[str, torch.dtype]
    skipped: list[str] = field(default_factory=list)
    """What the checkpoint holds beside the model and is not read (optimizer, RNG states)."""
    _reader: OpenedReader | None = None
    _dcp: dict[str, _DcpTensor] = field(default_factory=dict)
    _ranks: dict[tuple[int, int, int], dict[str, torch.Tensor]] | None = None
    """Legacy: each (tensor, pipeline, expert) parallel rank's model state."""
    _legacy: dict[str, _LegacyTensor] = field(default_factory=dict)
    _recent: dict[str, torch.Tensor] = field(default_factory=dict)
    """The last tensors read: q, k and v (gate and up) come from one read."""

    def summary(self) -> dict[str, Any]:
        """What a manifest records of the source."""
        return {
            "directory": str(self.directory),
            "format": self.format,
            "iteration": self.iteration,
            "skipped": self.skipped,
        }

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor of canonical key ``key`` (one layer's, for a layer tensor)."""
        if key not in self._recent:
            if len(self._recent) >= 2:
                self._recent.pop(next(iter(self._recent)))
            self._recent[key] = self._read_dcp(key) if self.format == "torch_dist" else self._read_legacy(key)
        return self._recent[key]

    def read_rows(self, key: str, out: torch.Tensor) -> None:
        """The first ``len(out)`` rows of ``key`` (a vocabulary matrix) read straight into ``out``."""
        if self.format == "torch_dist":
            self._load_box(key, (0,) * out.dim(), out)
        else:
            out.copy_(self._read_legacy(key)[: out.shape[0]])

    def _read_dcp(self, key: str) -> torch.Tensor:
        stored, shape = self._dcp[key], self.shapes[key]
        if stored.layer is None:
            out = torch.empty(shape, dtype=self.dtypes[key])
            self._load_box(stored.key, (0,) * len(shape), out)
            return out
        out = torch.empty((1, *shape), dtype=self.dtypes[key])
        self._load_box(stored.key, (stored.layer,) + (0,) * len(shape), out)
        return out[0]

    def _load_box(self, key: str, offsets: tuple[int, ...], out: torch.Tensor) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({}, storage_reader=self._reader, planner=SliceLoadPlanner(key, offsets, out), no_dist=True)

    def _read_legacy(self, key: str) -> torch.Tensor:
        assert self._ranks is not None
        where, tp = self._legacy[key], 1 + max(t for t, _, _ in self._ranks)

        def whole(ep: int, name: str) -> torch.Tensor:
            return merge_shards(where.merge, [self._ranks[(t, where.stage, ep)][name] for t in range(tp)], where.spec)

        if where.experts:
            return torch.stack([whole(ep, name) for ep, name in where.experts])
        return whole(0, where.key)


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
    shapes, dtypes, stored, skipped = {}, {}, {}, set()
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(("optimizer.", "rng_state", "rerun_state_machine")):
            skipped.add(key.split(".", 1)[0].split("/", 1)[0])
            continue
        if not isinstance(meta, TensorStorageMetadata) or "_extra_state" in key:
            continue
        shape, dtype = tuple(meta.size), meta.properties.dtype
        own = _LAYER_KEY.match(key)
        if own is not None:  # one layer's own key (dense and MoE layers mixed)
            places = {layer_key(canonical_name(own[2]), int(own[1])): (_DcpTensor(key, None), shape)}
        elif key.startswith(LAYERS):  # layers stacked on dim 0
            name = canonical_name(key.removeprefix(LAYERS))
            places = {layer_key(name, i): (_DcpTensor(key, i), shape[1:]) for i in range(shape[0])}
        else:
            places = {key: (_DcpTensor(key, None), shape)}
        for canonical, (where, own_shape) in places.items():
            stored[canonical], shapes[canonical], dtypes[canonical] = where, own_shape, dtype
    return MegatronCheckpoint(
        directory,
        "torch_dist",
        common.get("args"),
        common.get("iteration"),
        shapes,
        dtypes,
        sorted(skipped),
        _reader=reader,
        _dcp=stored,
    )


def _rank_files(directory: Path) -> dict[tuple[int, ...], Path]:
    """Each rank file by the numbers of its directory name (tensor rank, then the others)."""
    files = {}
    for path in sorted(directory.glob(f"mp_rank_*/{LEGACY_FILE}")):
        match = _RANK_DIR.match(path.parent.name)
        if match is None:
            raise CheckpointError(
                f"{path.parent}: expected mp_rank_TT, mp_rank_TT_PPP, mp_rank_TT_EEE or mp_rank_TT_PPP_EEE"
            )
        files[(int(match[1]), *(int(n) for n in match[2].split("_")[1:]))] = path
    return files


def _rank_axes(
    files: dict[tuple[int, ...], Path], loaded: dict[tuple[int, ...], Any]
) -> dict[tuple[int, ...], tuple[int, int, int]]:
    """(tensor, pipeline, expert) rank of each file. Megatron-LM names a rank mp_rank_TT, then
    _PPP with pipeline parallelism, then _EEE with expert parallelism, so one number after TT
    is a pipeline or an expert rank: ``args`` say which, else the files do (every
    expert-parallel rank holds the embedding, only the first pipeline stage does)."""
    suffixes = {len(rank) for rank in files}
    if len(suffixes) > 1:
        raise CheckpointError(
            f"{next(iter(files.values())).parents[1]}: rank directories of different layouts "
            f"({sorted(p.parent.name for p in files.values())[:6]})"
        )
    if suffixes == {1}:
        return {rank: (rank[0], 0, 0) for rank in files}
    if suffixes == {3}:
        return {rank: (rank[0], rank[1], rank[2]) for rank in files}
    args = next(iter(loaded.values())).get("args")
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    pp = getattr(args, "pipeline_model_parallel_size", None) or 1
    if ep > 1 or pp > 1:
        expert = ep > 1 and pp == 1
    else:
        expert = all(EMBEDDING in state.get("model", {}) for state in loaded.values())
    return {rank: (rank[0], 0, rank[1]) if expert else (rank[0], rank[1], 0) for rank in files}


def rank_dir_name(tp: int, pp: int, ep: int, pipeline: bool, expert: bool) -> str:
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pipeline else "") + (f"_{ep:03d}" if expert else "")


def _open_legacy(directory: Path) -> MegatronCheckpoint:
    files = _rank_files(directory)
    if not files:
        raise CheckpointError(
            f"--megatron {directory}: neither torch_dist (metadata.json) nor legacy (mp_rank_*/{LEGACY_FILE}) files"
        )
    loaded = {rank: load_pickled(path, mmap=True) for rank, path in files.items()}
    axes = _rank_axes(files, loaded)
    paths = {axes[rank]: path for rank, path in files.items()}
    saved = next(iter(loaded.values())).get("args")  # the sizes it was saved at, when it says
    sizes = [
        getattr(saved, name, None) or 1
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")
    ]
    tp, pp, ep = (max(sizes[axis], 1 + max(rank[axis] for rank in paths)) for axis in range(3))
    missing = [
        rank_dir_name(t, p, e, pp > 1, ep > 1)
        for t in range(tp)
        for p in range(pp)
        for e in range(ep)
        if (t, p, e) not in paths
    ]
    if missing:
        raise CheckpointError(
            f"{directory}: ranks {missing} are missing (found {len(files)} rank directories of a "
            f"tp={tp}, pp={pp}" + (f", ep={ep}" if ep > 1 else "") + " layout); copy the whole "
            "iteration directory"
        )
    first = loaded[next(rank for rank in files if axes[rank] == (0, 0, 0))]
    if "model" not in first:
        chunks = sorted(k for k in first if re.fullmatch(r"model\d+", k))
        raise CheckpointError(
            f"{paths[(0, 0, 0)]}: no 'model' state"
            + (f" but {chunks}: virtual pipeline stages are not supported" if chunks else f"; keys {sorted(first)}")
        )
    args = first.get("args")
    expert_tp = getattr(args, "expert_tensor_parallel_size", None)
    if expert_tp not in (None, tp):
        raise CheckpointError(
            f"{paths[(0, 0, 0)]}: args.expert_tensor_parallel_size={expert_tp} differs from the "
            f"files' tensor-parallel size {tp}; llmflow reads experts split as the other layers"
        )
    ranks = {axes[rank]: state["model"] for rank, state in loaded.items()}
    stage_layers = [len({int(m[1]) for k in ranks[(0, p, 0)] if (m := _LAYER_KEY.match(k))}) for p in range(pp)]
    shapes, dtypes, legacy = {}, {}, {}

    def place(canonical: str, where: _LegacyTensor, sample: list[torch.Tensor]) -> None:
        whole = merge_shards(
            where.merge, [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in sample], where.spec
        )
        shapes[canonical] = (len(where.experts), *whole.shape) if where.experts else tuple(whole.shape)
        dtypes[canonical], legacy[canonical] = whole.dtype, where

    spec = legacy_spec(list(first["model"]))
    for stage in range(pp):
        offset, state = sum(stage_layers[:stage]), ranks[(0, stage, 0)]
        for key, tensor in state.items():
            if not isinstance(tensor, torch.Tensor) or "_extra_state" in key:
                continue
            own = _LAYER_KEY.match(key)
            if own is None:
                if not (key == OUTPUT and pp > 1 and not _untied(args)):  # the last stage's copy of a shared embedding
                    place(key, _LegacyTensor(stage, key, key), [ranks[(t, stage, 0)][key] for t in range(tp)])
                continue
            local, name = int(own[1]), own[2]
            if name in _LEGACY_GROUPED_MLP:
                raise CheckpointError(
                    f"{paths[(0, stage, 0)]}: {key} is the legacy GroupedMLP's (moe_grouped_gemm "
                    "without Transformer Engine), which llmflow does not read; save it as "
                    "torch_dist, or with SequentialMLP or TEGroupedMLP"
                )
            expert = _SEQUENTIAL_EXPERT.match(name) or _GROUPED_EXPERT.match(name)
            if expert is None:
                where = _LegacyTensor(stage, key, canonical_name(name), spec=spec)
                place(layer_key(where.merge, offset + local), where, [ranks[(t, stage, 0)][key] for t in range(tp)])
            elif int(expert[1] if expert.re is _SEQUENTIAL_EXPERT else expert[2]) == 0:
                merge = _EXPERT_NAMES[expert[2] if expert.re is _SEQUENTIAL_EXPERT else expert[1]]
                experts = _expert_keys(ranks, paths, stage, local, key, expert, ep)
                where = _LegacyTensor(stage, key, merge, experts)
                place(layer_key(merge, offset + local), where, [ranks[(t, stage, 0)][key] for t in range(tp)])
    skipped = sorted(k for k in first if k in ("optimizer", "opt_param_scheduler", "rng_state", "rerun_state_machine"))
    return MegatronCheckpoint(
        directory, "legacy", args, first.get("iteration"), shapes, dtypes, skipped, _ranks=ranks, _legacy=legacy
    )


def _expert_keys(
    ranks: dict[tuple[int, int, int], dict[str, Any]],
    paths: dict[tuple[int, int, int], Path],
    stage: int,
    local: int,
    first_key: str,
    first: re.Match,
    ep: int,
) -> tuple[tuple[int, str], ...]:
    """(expert-parallel rank, key) of every routed expert of one layer's linear, in global
    order: each rank's local experts, numbered from 0 in its files, follow the previous rank's."""
    sequential = first.re is _SEQUENTIAL_EXPERT
    linear = first[2] if sequential else first[1]
    counts, keys = [], []
    for rank in range(ep):
        own = [
            int(m[1] if sequential else m[2])
            for k in ranks[(0, stage, rank)]
            if (lm := _LAYER_KEY.match(k))
            and int(lm[1]) == local
            and (m := first.re.match(lm[2]))
            and (m[2] if sequential else m[1]) == linear
        ]
        counts.append(len(own))
        if sorted(own) != list(range(len(own))):
            raise CheckpointError(
                f"{paths[(0, stage, rank)]}: local experts {sorted(own)} of {first_key} are not numbered 0, 1, ..."
            )
        stem = first_key[: first_key.index(".mlp.") + 1]
        keys += [
            (
                rank,
                stem
                + (
                    f"mlp.experts.local_experts.{j}.{linear}.weight"
                    if sequential
                    else f"mlp.experts.{linear}.weight{j}"
                ),
            )
            for j in range(len(own))
        ]
    if len(set(counts)) > 1:
        raise CheckpointError(
            f"{paths[(0, stage, counts.index(min(counts)))]}: holds {min(counts)} local experts of "
            f"{first_key} where another expert-parallel rank holds {max(counts)}"
        )
    return tuple(keys)


def _untied(args: Any) -> bool:
    return bool(getattr(args, "untie_embeddings_and_output_weights", True))
