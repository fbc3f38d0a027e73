"""Compare a dump against a benchmark dump, as msprobe's compare does.

Inputs are step folders (``{dump_path}/step{N}``, ranks matched by folder name when both
runs have the same layout) or rank folders. Runs of different layouts are compared whole:
each side's tensor-parallel or context-parallel group is merged into one dump first
(``merge.py``: tp=2 against tp=1, cp=2 against cp=1), and a pipeline run's stages into one
dump of the whole model (``stages.py``: pp=2 against pp=1, also with tensor parallelism in
each stage), which the dumps' layout.json lets the compare lay out. Every tensor (and
non-tensor argument) of the target dump is matched by name with the benchmark's, e.g. ``Functional.linear.0.forward.input.0`` or
``Module.model.norm.RMSNorm.forward.0.parameters.weight``, and gets msprobe's metrics and
result (Ascend/mstt, ``debug/accuracy_tools/msprobe/docs/zh/accuracy_compare/pytorch_accuracy_compare_instruct.md``,
"指标说明", "比对指标计算公式" and "比对结果（Result）"; column names from msprobe's
``CompareConst``):

- tensor mode (task tensor): Cosine, EucDist, MaxAbsErr, MaxRelativeErr, One Thousandth
  Err Ratio, Five Thousandths Err Ratio, computed on the saved tensors;
- statistics mode: differences of max/min/mean/L2 norm and their relative errors, as
  msprobe writes them (percent strings; "0" where the values are equal, "inf" against 0);
- md5 mode: the CRC-32 values, equal or not.

Every column and result equals what ``msprobe compare`` (mindstudio-probe 26.2) writes for the
same dumps, in its row order (a call's inputs, then its parameters, then its outputs). The
one departure is opt-in: ``norm_noise_floor`` (see CompareConfig), which the precision flow
sets when the runs have different tensor-parallel layouts, and advisor.txt then says so.

The output folder gets ``compare_result_{rank}.csv`` per rank (and ``.xlsx`` when openpyxl
is installed), ``advisor.txt``, ``merged_names.json`` when pipeline stages were merged, and
``manifest.json`` (written last).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import CliPositionalArg

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.probe.compare.advisor import advise
from llmflow.probe.compare.merge import merge_context_parallel, merge_ranks
from llmflow.probe.compare.reading import (
    ERROR,
    UNMATCHED,
    WARNING,
    Leaf,
    RankDump,
    RankLayout,
    load_array,
    rank_dirs,
    read_layout,
    read_rank,
)
from llmflow.probe.compare.rows import RankComparison, Row
from llmflow.probe.compare.stages import is_pipelined, outside_calls, pipeline_pair

STAGE = "probe-compare"
MERGED_NAMES = "merged_names.json"
"""Written when pipeline stages were merged: {"target"|"bench": {merged entry: [[rank folder,
its entry there], ...]}}."""


# msprobe's result rules: the checkers of mindstudio-probe 26.2.0
# (msprobe/core/compare/indicator_analysis/algorithm.py), which the documentation's
# "比对结果（Result）" describes. A call's outputs are judged against its inputs and
# parameters, which carry the error that came from upstream: the worst input against the
# worst output.
THOUSANDTH_INPUT_MIN = 0.9
"""tensor mode, error: the inputs' lowest One Thousandth Err Ratio above this..."""
THOUSANDTH_OUTPUT_MAX = 0.1
"""...and the outputs' lowest below this (the code's value; the documentation says 0.6)."""
COSINE_INPUT_MIN = 0.9
"""tensor mode, warning: the inputs' lowest Cosine above this..."""
COSINE_DROP = 0.1
"""...and the outputs' lowest below it by more than this."""
NORM_INPUT_MAX = 0.1
"""statistics mode, error: the inputs' highest norm relative error below this..."""
NORM_OUTPUT_MIN = 0.5
"""...and an output's above this."""
NORM_GROWTH = 10
"""statistics mode, warning: the outputs' highest norm relative error above this many times
the inputs' highest..."""
NORM_OUTPUT_FROM_EXACT = 0.1
"""...or, when the inputs agree exactly, above this."""
CROSS_LAYOUT_NOISE_FLOOR = 1e-5
"""A ``norm_noise_floor`` for runs of different tensor-parallel layouts: two reductions of the
same float32 values in different orders (tp=2 against tp=1, ranks' statistics merged) differ
by about 1e-7, and msprobe's ten-times rule flags one such error against another."""
COSINE_ROUNDED_ABOVE = 0.9999
"""msprobe rounds a Cosine above this to 6 decimals (CompareConst.COSINE_THRESHOLD)."""
UNSUPPORTED = "unsupported"
"""msprobe's cell for a tensor-mode metric it does not compute."""
REDUNDANT_APIS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_with_format", "numpy", "to",
     "__setitem__"}
)
"""APIs msprobe does not judge (their outputs are uninitialised memory or copies)."""

_BASIC = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape", "Bench Tensor Shape",
          "NPU Requires_grad", "Bench Requires_grad"]
_TENSOR = ["Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio"]
_STATISTICS = ["Max diff", "Min diff", "Mean diff", "L2norm diff", "MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr",
               "NormRelativeErr"]
_SUMMARY = ["NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean", "Bench l2norm"]
_TAIL = ["Requires_grad Consistent", "Result", "Err_message", "NPU_Stack_Info"]
HEADERS = {
    "tensor": _BASIC + _TENSOR + _SUMMARY + _TAIL + ["Data_name"],
    "statistics": _BASIC + _STATISTICS + _SUMMARY + _TAIL,
    "md5": _BASIC + ["NPU MD5", "BENCH MD5"] + _TAIL,
}
_STATS = ("Max", "Min", "Mean", "Norm")


class CompareConfig(BaseModel):
    """Compare a dump against a benchmark dump (msprobe's metrics and results) and name the
    first divergence."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    target: CliPositionalArg[Path]
    """The dump under test: a step folder ({dump_path}/step{N}) or one rank folder. With
    another layout than the benchmark's (another tensor- or context-parallel degree, other
    pipeline stages), the ranks of rank 0's tensor-parallel or context-parallel group, or of
    its pipeline group and their tensor-parallel groups, are merged into one dump."""
    bench: CliPositionalArg[Path]
    """The benchmark dump, at the same level."""
    out: Path
    """Output folder: compare_result_{rank}.csv (.xlsx with openpyxl), advisor.txt, merged_names.json
    (pipeline stages merged), manifest.json."""
    norm_noise_floor: float = Field(0.0, ge=0)
    """Statistics mode: norm relative errors below this count as agreement in msprobe's rules
    (0, the default: off, msprobe's own verdicts). For runs of different tensor-parallel
    layouts, whose float32 reductions differ by rounding, 1e-5 (CROSS_LAYOUT_NOISE_FLOOR);
    advisor.txt says when it is on."""


@dataclass
class CompareReport:
    out: Path
    ranks: list[RankComparison]
    advice: str


# --- pairing ranks -------------------------------------------------------------------------------


def rank_pairs(target: Path, bench: Path) -> tuple[list[tuple[str, RankDump, RankDump]], dict[str, Any] | None]:
    """(name, target dump, bench dump) of each rank, and where merged entries came from (None
    when nothing was merged across pipeline stages). Ranks pair up by folder name when their
    layout.json files give both the same layout (pipeline runs: only then; dumps without
    layout.json: by name alone); a single rank on each side pairs up whatever its name
    ("rank" outside torchrun, "rank0" under it). Runs of different layouts are compared
    whole: a run's tensor-parallel or context-parallel group is merged into one dump (tp=2
    against tp=1, cp=2 against cp=1), and a pipeline run's stages into one dump of the whole
    model (``stages.py``)."""
    targets, benches = rank_dirs(Path(target)), rank_dirs(Path(bench))
    target_layouts = [read_layout(path) for path in targets.values()]
    bench_layouts = [read_layout(path) for path in benches.values()]
    placed = None not in target_layouts + bench_layouts
    same_placement = placed and [t.placement for t in target_layouts] == [b.placement for b in bench_layouts]
    if is_pipelined(target_layouts + bench_layouts):
        same = list(targets) == list(benches) and same_placement
    else:
        same = len(targets) == 1 and len(benches) == 1 or list(targets) == list(benches) and (same_placement or not placed)
    if same:
        pairs = [(read_rank(t), read_rank(b)) for t, b in zip(targets.values(), benches.values(), strict=True)]
        return [(t.name, t, b) for t, b in pairs], None
    if is_pipelined(target_layouts + bench_layouts):
        whole_target, whole_bench, origins = pipeline_pair(targets, benches)
        return [(whole_target.name, whole_target, whole_bench)], origins
    target_group, bench_group = _rank_group(targets), _rank_group(benches)
    for group, other in ((target_group, bench_group), (bench_group, target_group)):
        if group.context_parallel is not None and other.context_parallel is None and len(other.dumps) > 1:
            raise ValueError(
                f"{group.dumps[0].name}'s context-parallel group against {other.dumps[0].name}'s tensor-parallel group: "
                "their shards split different dimensions, which the shapes of two shards do not tell apart; compare "
                "each run with a run without tensor or context parallelism"
            )
    whole_target = _whole(target_group, bench_group)
    return [(whole_target.name, whole_target, _whole(bench_group, target_group))], None


@dataclass
class _Group:
    """The ranks of a run merged into one dump: rank 0's tensor-parallel or context-parallel group."""

    dumps: list[RankDump]
    context_parallel: tuple[set[str], tuple[int, int]] | None = None
    """Of a context-parallel group: the entries its ranks made outside the model's forward, and
    the batch size and each rank's positions of the model's input."""


def _whole(group: _Group, other: _Group) -> RankDump:
    if len(group.dumps) == 1:
        return group.dumps[0]
    reference = replace(other.dumps[0], ranks=len(other.dumps))  # shapes of a shard of len(other) ranks
    if group.context_parallel is not None:
        return merge_context_parallel(group.dumps, reference, *group.context_parallel)
    return merge_ranks(group.dumps, reference)


def _rank_group(dirs: dict[str, Path]) -> _Group:
    """Rank 0's context-parallel group (its layout.json names it), else its tensor-parallel group."""
    first = next(iter(dirs.values()))
    layout = read_layout(first)
    if layout is None or layout.cp_group is None or len(layout.cp_group) == 1:
        return _Group(_tensor_parallel_group(dirs))
    dumps = _context_parallel_group(dirs, layout)
    tokens = layout.calls[0].get("tokens") if layout.calls else None
    if tokens is None:
        raise ValueError(f"{first}: layout.json does not say the size of the model's input (an older llmflow's): dump the "
                         "run again to compare it with another layout")
    # The ranks of the group make the same calls: rank 0's layout tells them.
    return _Group(dumps, (outside_calls(next(d for d in dumps if d.name == first.name), layout), tuple(tokens)))


def _context_parallel_group(dirs: dict[str, Path], layout: RankLayout) -> list[RankDump]:
    """The dumps of the context-parallel group of the rank of ``layout``, in cp-rank order."""
    name = f"rank{layout.rank}"
    if layout.tp_group is not None and len(layout.tp_group) > 1:
        raise ValueError(
            f"{name} holds a context-parallel group {layout.cp_group} and a tensor-parallel group {layout.tp_group}: "
            "the shapes of their shards do not tell which dimensions each split and in which order (under cp x tp the "
            "sequence and the heads are each split by both); compare such a run rank by rank with a run of the same layout"
        )
    if layout.cp_algo != "ulysses":
        raise ValueError(
            f"{name}'s context-parallel group {layout.cp_group} runs cp_algo {layout.cp_algo}: only Ulysses' contiguous "
            "sequence shards are put together; compare such a run rank by rank with a run of the same layout"
        )
    names = [f"rank{r}" for r in layout.cp_group]
    missing = [n for n in names if n not in dirs]
    if missing:
        raise ValueError(f"{name}'s context-parallel group {layout.cp_group} needs the dumps of {missing}")
    return [read_rank(dirs[n]) for n in names]


def _tensor_parallel_group(dirs: dict[str, Path]) -> list[RankDump]:
    """The dumps of rank 0's tensor-parallel group, in mesh order: the mesh of the first
    DTensor on a 1-D mesh that rank 0 dumped (its other ranks hold other data, and are not read)."""
    first = read_rank(next(iter(dirs.values())))
    if len(dirs) == 1:
        return [first]
    for leaf in first.leaves:
        mesh = leaf.record.get("device_mesh")
        if isinstance(mesh, list) and mesh and all(isinstance(r, int) for r in mesh):
            names = [f"rank{r}" for r in mesh]
            missing = [name for name in names if name not in dirs]
            if missing:
                raise ValueError(f"{first.name}'s tensor-parallel group {mesh} needs the dumps of {missing}")
            return [first if name == first.name else read_rank(dirs[name]) for name in names]
    raise ValueError(
        f"the runs have different ranks, and {list(dirs)} dumped no DTensor to tell their "
        "tensor-parallel group: compare runs of the same layout rank by rank, or dump the parameters too "
        "(level L0 or mix) so the group is known"
    )


# --- metrics --------------------------------------------------------------------------------------


def relative_error(npu: np.ndarray, bench: np.ndarray) -> np.ndarray:
    """|npu - bench| / |bench| as msprobe computes it: in the arrays' own precision (at least
    float32), with that precision's epsilon added to both where bench is 0."""
    kind = np.result_type(npu, bench, np.float32)
    n, b = npu.astype(kind), bench.astype(kind)
    zero = b == 0
    n[zero] += np.finfo(kind).eps
    b[zero] += np.finfo(kind).eps
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.abs((n - b) / b)


def _twelve_decimals(value: float) -> float:
    """msprobe's format_value."""
    return float(f"{value:.12f}")


def tensor_metrics(npu: np.ndarray, bench: np.ndarray) -> dict[str, float | str]:
    """msprobe's tensor-mode metrics of two arrays of one shape (the caller has checked that nan
    and inf sit at the same places), with its rounding: "unsupported" where msprobe computes
    none (Cosine of fewer than two elements; EucDist and the ratios of a 0-d tensor)."""
    finite = np.isfinite(npu) & np.isfinite(bench)
    npu, bench = np.where(finite, npu, 0), np.where(finite, bench, 0)  # msprobe zeroes matching nan/inf
    n, b = npu.reshape(-1).astype(np.float64), bench.reshape(-1).astype(np.float64)
    relative = relative_error(npu, bench)
    metrics: dict[str, float | str] = {"MaxAbsErr": _twelve_decimals(np.abs(n - b).max()),
                                       "MaxRelativeErr": _twelve_decimals(relative.max())}
    if npu.ndim == 0:
        return {**metrics, **dict.fromkeys(("Cosine", "EucDist", *_TENSOR[4:]), UNSUPPORTED)}
    metrics["EucDist"] = float(np.linalg.norm(n - b))
    metrics["One Thousandth Err Ratio"] = _twelve_decimals(np.mean(relative < 0.001))
    metrics["Five Thousandths Err Ratio"] = _twelve_decimals(np.mean(relative < 0.005))
    metrics["Cosine"] = _cosine(n, b) if n.size > 1 else UNSUPPORTED
    return metrics


def _cosine(n: np.ndarray, b: np.ndarray) -> float | str:
    n_norm, b_norm = np.linalg.norm(n), np.linalg.norm(b)
    eps = np.finfo(float).eps
    if n_norm <= eps and b_norm <= eps:
        return 1.0
    if n_norm <= eps or b_norm <= eps:
        return "Nan"  # msprobe's CompareConst.NAN: all zeros on one side
    cosine = _twelve_decimals(np.dot(n, b) / (n_norm * b_norm))
    return round(cosine, 6) if cosine > COSINE_ROUNDED_ABOVE else cosine


def same_nonfinite(npu: np.ndarray, bench: np.ndarray) -> bool:
    """Whether nan, inf and -inf sit at the same places in both arrays."""
    return np.array_equal(np.isnan(npu), np.isnan(bench)) and np.array_equal(
        np.where(np.isinf(npu), npu, 0.0), np.where(np.isinf(bench), bench, 0.0)
    )


# --- statistics as msprobe writes them --------------------------------------------------------------

NONE = "None"
"""msprobe's cell for a statistic a value does not have (an argument of None, a slice)."""
NA = "N/A"
_SIDE_ORDER = {"input": 0, "parameters": 1, "output": 2}
"""msprobe's row order within a call (reorder_index): inputs, parameters, outputs."""


def summary(leaf: Leaf) -> tuple[Any, Any, list[Any]]:
    """(dtype, shape, [max, min, mean, norm]) of a value as msprobe's gen_op_item gives them: a
    non-tensor argument's dtype is its Python type and its statistics its value."""
    record = leaf.record
    if record["type"] == "None" and record.get("value") is None and "dtype" not in record:
        return None, None, [NONE] * 4  # an argument of None: msprobe's default item
    stats = [_statistic(record.get(stat)) for stat in _STATS]
    if leaf.is_tensor or "dtype" in record:
        return record.get("dtype"), record.get("shape"), stats
    kind, value = record["type"], record.get("value")
    if kind == "torch.Size":
        return kind, str(value), stats
    if kind == "slice":
        return kind, str(np.shape(np.array(value))), stats
    value = _statistic(value)
    return (kind if kind == "ellipsis" else str(type(record.get("value")))), "[]", [value] * 4


def _statistic(value: Any) -> Any:
    if value is None:
        return NONE
    return "Nan" if str(value).lower() == "nan" else value  # msprobe's CompareConst.NAN


def _kind(value: Any) -> str:
    """msprobe's CalcStatsDiff.classify of a statistic's cell."""
    text = str(value).lower()
    if text == "nan" or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    if text in ("inf", "-inf"):
        return text
    if text not in ("true", "false"):
        try:
            float(text)
            return "number"
        except ValueError:
            pass
    if any(device in text for device in ("npu", "cpu", "cuda")):
        return "device"
    return "n/a" if str(value) == NA else "other"


_SPECIAL = {("inf", "number"): "inf", ("inf", "-inf"): "inf", ("-inf", "number"): "-inf", ("-inf", "inf"): "-inf",
            ("number", "inf"): "-inf", ("number", "-inf"): "inf", ("device", "device"): NA}


def statistic_difference(npu: Any, bench: Any) -> tuple[Any, str]:
    """(difference, relative error) of one statistic as msprobe's CalcStatsDiff writes them:
    "0" for equal cells, the relative error in percent (against 0: "inf"), else a marker."""
    if str(npu) == str(bench):
        return "0", "0"
    kinds = _kind(npu), _kind(bench)
    if kinds == ("number", "number"):
        n, b = float(str(npu)), float(str(bench))
        diff = n - b
        return diff, "inf" if b == 0 else f"{abs(diff / b * 100)!r}%"
    if "n/a" in kinds:
        marker = NA
    elif "nan" in kinds and set(kinds) <= {"nan", "number", "inf", "-inf"}:
        marker = "Nan"
    elif kinds in _SPECIAL:
        marker = _SPECIAL[kinds]
    else:
        marker = "Diff" if set(kinds) & {"device", "other"} else NA
    return marker, marker


def percent(cell: Any) -> float | None:
    """The fraction a relative-error cell stands for ("12.5%" -> 0.125); None for the others
    ("0", "inf", markers), which msprobe's rules skip."""
    return float(cell[:-1]) / 100 if isinstance(cell, str) and cell.endswith("%") else None


# --- rows and results -------------------------------------------------------------------------------

# msprobe's messages (msprobe/core/compare/indicator_analysis/algorithm.py)
INF_NAN = "error: There is nan/inf/-inf in the maximum or minimum value of NPU."
NORM_ERROR = "error: The NormRelativeErr of output is greater than 0.5."
THOUSANDTH_ERROR = "error: The input/parameters of One Thousandth Err Ratio > 0.9 while the output < 0.6."
REQUIRES_GRAD_ERROR = "error: The Required_Grad of NPU and Bench are inconsistent"
SCALAR_ERROR = "error: The scalar parameters of NPU and Bench are inconsistent."
CRC_ERROR = "error: The CRC-32 value of NPU differs from that of the bench."
DTYPE_ERROR = "error: The dtype of NPU and Bench are inconsistent."
SHAPE_ERROR = "error: The shape of NPU and Bench are inconsistent."
NORM_WARNING = "warning: The norm relative error of output is 10 times that of input."
COSINE_WARNING = "warning: The input/parameters of Cosine > 0.9, and input/parameters - output > 0.1"
NO_BENCH = "No bench data matched."


def _row(mode: str, leaf: Leaf, bench: Leaf | None, stack: list[str]) -> Row:
    npu, other = leaf.record, bench.record if bench else {}
    npu_dtype, npu_shape, npu_stats = summary(leaf)
    bench_dtype, bench_shape, bench_stats = summary(bench) if bench else (None, None, [None] * 4)
    cells: dict[str, Any] = {
        "NPU Name": leaf.name,
        "Bench Name": bench.name if bench else None,
        "NPU Dtype": npu_dtype,
        "Bench Dtype": bench_dtype,
        "NPU Tensor Shape": npu_shape,
        "Bench Tensor Shape": bench_shape,
        "NPU Requires_grad": npu.get("requires_grad"),
        "Bench Requires_grad": other.get("requires_grad"),
        "NPU MD5": npu.get("md5"),
        "BENCH MD5": other.get("md5"),
    }
    cells.update(zip(_SUMMARY, npu_stats + bench_stats, strict=True))
    row = Row(leaf, cells, stack=stack)
    if bench is None and leaf.problem is not None:  # a merged value with no counterpart by construction
        row.result = UNMATCHED
        row.messages.append(leaf.problem[1])
        return row
    if bench is None:
        row.result = WARNING if mode == "md5" else UNMATCHED  # msprobe's CRC-32 rule warns
        row.messages.append(NO_BENCH)
        return row
    cells["Requires_grad Consistent"] = npu.get("requires_grad") == other.get("requires_grad")
    problems = [value.problem for value in (leaf, bench) if value.problem is not None]
    if any(result == UNMATCHED for result, _ in problems):
        row.result = UNMATCHED
        row.messages += [message for _, message in problems]
        return row
    for result, message in problems:
        row.flag(result, message)
    if mode != "md5":
        for stat, diff_col, rel_col, n, b in zip(_STATS, _STATISTICS[:4], _STATISTICS[4:], npu_stats, bench_stats,
                                                 strict=True):
            diff, rel = statistic_difference(n, b)
            if mode == "statistics":
                cells[diff_col], cells[rel_col] = diff, rel
            if percent(rel) is not None:
                row.stat_errors[stat] = percent(rel)
        if mode == "statistics":
            row.metrics = {f"{stat[0]}{stat[1:].lower()}RelativeErr": e for stat, e in row.stat_errors.items()}
    if mode == "tensor":
        cells["Data_name"] = str([npu.get("data_name") or "-1", other.get("data_name") or "-1"])
        cells.update(dict.fromkeys(_TENSOR, UNSUPPORTED))
        if leaf.files and bench.files and npu.get("shape") == other.get("shape") and math.prod(npu["shape"]) > 0:
            arrays = load_array(leaf), load_array(bench)
            if same_nonfinite(*arrays):
                cells.update(tensor_metrics(*arrays))
                row.metrics = {name: cells[name] for name in _TENSOR if isinstance(cells[name], float)}
            else:
                row.flag(ERROR, "the positions of inf or nan differ")
    return row


def _nonfinite(value: Any) -> bool:
    return (isinstance(value, float) and not math.isfinite(value)) or str(value).strip().lower() in ("inf", "-inf", "nan")


def _str2float(cell: Any) -> float:
    """msprobe's str2float: "12.5%" -> 0.125, "inf" -> inf, 0 for what is not a number."""
    try:
        return float(str(cell).strip("%")) / 100
    except ValueError:
        return 0.0


def _extreme(rows: list[Row], metric: str, lowest: bool) -> float:
    """msprobe's get_min_or_max_value: the lowest (highest) value of ``metric``, from 1.0 (0.0) up."""
    values = [row.metrics[metric] for row in rows if not math.isnan(row.metrics.get(metric, math.nan))]
    return min([1.0, *values]) if lowest else max([0.0, *values])


def _judge(mode: str, rows: list[Row], noise_floor: float) -> None:
    """msprobe's checkers, in its order, on the rows of one call: outputs are the rows named
    ``.output.``, every other row (parameters, parameter gradients) counts among the inputs."""
    matched = [row for row in rows if row.result != UNMATCHED and row.cells["Bench Name"] is not None]
    if mode == "md5":
        for row in matched:
            if row.cells["NPU MD5"] != row.cells["BENCH MD5"]:
                row.flag(ERROR, CRC_ERROR)
        return
    inputs = [row for row in matched if ".output." not in row.leaf.name]
    outputs = [row for row in matched if ".output." in row.leaf.name]
    for row in matched:
        if not _nonfinite(row.cells["Bench max"]) and not _nonfinite(row.cells["Bench min"]) and (
                _nonfinite(row.cells["NPU max"]) or _nonfinite(row.cells["NPU min"])):
            row.flag(ERROR, INF_NAN)
    if mode == "tensor":
        ratio_in = _extreme(inputs, "One Thousandth Err Ratio", lowest=True)
        if outputs and ratio_in > THOUSANDTH_INPUT_MIN and _extreme(outputs, "One Thousandth Err Ratio", lowest=True) < THOUSANDTH_OUTPUT_MAX:
            outputs[0].flag(ERROR, THOUSANDTH_ERROR)
    else:
        norm_in = _extreme(inputs, "NormRelativeErr", lowest=False)
        norm_in = 0.0 if norm_in < noise_floor else norm_in
        if norm_in < NORM_INPUT_MAX:
            for row in outputs:
                if abs(_str2float(row.cells.get("NormRelativeErr"))) > NORM_OUTPUT_MIN:
                    row.flag(ERROR, NORM_ERROR)
    for row in matched:
        n, b = row.cells["NPU Requires_grad"], row.cells["Bench Requires_grad"]
        if n is not None and b is not None and n != b:
            row.flag(ERROR, REQUIRES_GRAD_ERROR)
    for row in inputs:
        n_dtype, b_dtype = str(row.cells["NPU Dtype"]), str(row.cells["Bench Dtype"])
        if "class" in n_dtype and "class" in b_dtype and row.cells["NPU Tensor Shape"] == "[]" and (
                row.cells["NPU max"] != row.cells["Bench max"]):
            row.flag(ERROR, SCALAR_ERROR)
    for row in matched:
        bench_name = row.cells["Bench Name"]
        dtypes = row.cells["NPU Dtype"], row.cells["Bench Dtype"]
        if "qkv" not in bench_name and "gate_up" not in bench_name and all(dtypes) and dtypes[0] != dtypes[1]:
            row.flag(ERROR, DTYPE_ERROR)
    for row in matched:
        shapes = row.cells["NPU Tensor Shape"], row.cells["Bench Tensor Shape"]
        if None not in shapes and str(shapes[0]) != str(shapes[1]):
            row.flag(ERROR, SHAPE_ERROR)
    if not outputs:
        return
    if mode == "tensor":
        cosine_in = _extreme(inputs, "Cosine", lowest=True)
        if cosine_in > COSINE_INPUT_MIN and cosine_in - _extreme(outputs, "Cosine", lowest=True) > COSINE_DROP:
            outputs[0].flag(WARNING, COSINE_WARNING)
        return
    norm_out = _extreme(outputs, "NormRelativeErr", lowest=False)
    norm_out = 0.0 if norm_out < noise_floor else norm_out
    if (norm_in == 0 and norm_out > NORM_OUTPUT_FROM_EXACT) or (norm_in > 0 and norm_out / norm_in > NORM_GROWTH):
        outputs[0].flag(WARNING, NORM_WARNING)


def compare_rank(target: RankDump, bench: RankDump, noise_floor: float = 0.0) -> list[Row]:
    """The rows of one rank's dump against its benchmark, in msprobe's order: calls in the
    target's order, each call's inputs, then its parameters, then its outputs."""
    mode = target.mode
    bench_leaves = {leaf.name: leaf for leaf in bench.leaves}
    rows: list[Row] = []
    for entry, group in itertools.groupby(target.leaves, key=lambda leaf: leaf.entry):
        stack = target.stacks.get(entry)
        ordered = sorted(group, key=lambda leaf: _SIDE_ORDER[leaf.side])
        entry_rows = [_row(mode, leaf, bench_leaves.get(leaf.name), stack or []) for leaf in ordered]
        entry_rows[0].cells["NPU_Stack_Info"] = None if stack is None else str(stack)
        if entry.startswith("Module.") or entry.split(".")[1] not in REDUNDANT_APIS:
            _judge(mode, entry_rows, noise_floor)
        rows.extend(entry_rows)
    for row in rows:
        row.cells["Result"] = row.result
        row.cells["Err_message"] = json.dumps(row.messages) if row.result != UNMATCHED else "; ".join(row.messages)
    return rows


# --- output -----------------------------------------------------------------------------------------


def _cell(value: Any) -> Any:
    if value is None:
        return NA
    if isinstance(value, float) and math.isinf(value):
        return f" {value}"  # msprobe's, so that spreadsheets read it
    return json.dumps(value) if isinstance(value, list) else value


def _write_tables(work: Path, name: str, mode: str, rows: list[Row]) -> list[Path]:
    header = HEADERS[mode]
    table = [[_cell(row.cells.get(column)) for column in header] for row in rows]
    path = work / f"{name}.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(table)
    written = [path]
    try:
        import openpyxl
    except ImportError:
        return written
    book = openpyxl.Workbook()
    sheet = book.active
    sheet.append(header)
    for line in table:
        sheet.append(line)
    book.save(work / f"{name}.xlsx")
    return written + [work / f"{name}.xlsx"]


def compare_dumps(config: CompareConfig) -> CompareReport:
    """Compare ``config.target`` against ``config.bench`` rank by rank and write the tables,
    the advisor's text and the manifest into ``config.out`` (replaced as a whole)."""
    pairs, origins = rank_pairs(config.target, config.bench)
    for _, target, bench in pairs:
        if target.mode != bench.mode:
            raise ValueError(f"{config.target} is a {target.mode} dump and {config.bench} a {bench.mode} dump: "
                             "compare dumps of the same mode")
    with atomic_directory(config.out) as work:
        ranks, files = [], []
        for rank, target, bench in pairs:
            rows = compare_rank(target, bench, config.norm_noise_floor)
            ranks.append(RankComparison(rank, target.mode, rows, f"compare_result_{rank}.csv",
                                        origins["target"] if origins is not None else None))
            files += _write_tables(work, f"compare_result_{rank}", target.mode, rows)
        advice = advise(ranks, config.norm_noise_floor)
        (work / "advisor.txt").write_text(advice, encoding="utf-8")
        files.append(work / "advisor.txt")
        if origins is not None:
            (work / MERGED_NAMES).write_text(json.dumps(origins, indent=1), encoding="utf-8")
            files.append(work / MERGED_NAMES)
        params = config.model_dump(mode="json")
        write_json_atomic(work / MANIFEST, manifest_payload(STAGE, params, [file_record(f, work) for f in files]))
    return CompareReport(Path(config.out), ranks, advice)
