"""Compare a dump against a benchmark dump, as msprobe's compare does.

Inputs are step folders (``{dump_path}/step{N}``, ranks matched by folder name) or rank
folders. Runs with different ranks (tp=2 against tp=1) are compared whole: each side's
tensor-parallel group is merged into one dump first (``merge.py``). Every tensor (and non-tensor argument) of the target dump is matched by name with
the benchmark's, e.g. ``Functional.linear.0.forward.input.0`` or
``Module.model.norm.RMSNorm.forward.0.parameters.weight``, and gets msprobe's metrics and
result (Ascend/mstt, ``debug/accuracy_tools/msprobe/docs/zh/accuracy_compare/pytorch_accuracy_compare_instruct.md``,
"指标说明", "比对指标计算公式" and "比对结果（Result）"; column names from msprobe's
``CompareConst``):

- tensor mode (task tensor): Cosine, EucDist, MaxAbsErr, MaxRelativeErr, One Thousandth
  Err Ratio, Five Thousandths Err Ratio, computed on the saved tensors;
- statistics mode: differences of max/min/mean/L2 norm and their relative errors
  (fractions, not msprobe's percent strings);
- md5 mode: the CRC-32 values, equal or not.

The output folder gets ``compare_result_{rank}.csv`` per rank (and ``.xlsx`` when openpyxl
is installed), ``advisor.txt`` and ``manifest.json`` (written last).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict
from pydantic_settings import CliPositionalArg

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.probe.advisor import advise
from llmflow.probe.merge import merge_ranks
from llmflow.probe.reading import ERROR, PASS, UNMATCHED, WARNING, Leaf, RankDump, load_array, rank_dirs, read_rank

STAGE = "probe-compare"


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
NORM_NOISE = 1e-5
"""statistics mode: norm relative errors below this count as agreement in the rules above.
Two reductions of the same float32 values in different orders (tp=2 against tp=1, ranks'
statistics merged) differ by about 1e-7, and msprobe's ten-times rule would flag one
such error against another."""
STAT_EPSILON = 1e-10
"""Added to |bench| in statistics' relative errors (msprobe's CompareConst.EPSILON)."""
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
    other ranks than the benchmark's (another tensor-parallel degree), the ranks of rank 0's
    tensor-parallel group are merged into one dump."""
    bench: CliPositionalArg[Path]
    """The benchmark dump, at the same level."""
    out: Path
    """Output folder: compare_result_{rank}.csv (.xlsx with openpyxl), advisor.txt, manifest.json."""


@dataclass
class Row:
    """One line of the comparison."""

    leaf: Leaf
    cells: dict[str, Any]
    result: str = PASS
    messages: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """Metric values used by the result rules."""

    def flag(self, result: str, message: str) -> None:
        if result == ERROR or self.result == PASS:
            self.result = result
        self.messages.append(message)


@dataclass
class RankComparison:
    rank: str
    mode: str
    """tensor, statistics or md5."""
    rows: list[Row]
    csv: str
    """File name of this rank's table in the output folder."""


@dataclass
class CompareReport:
    out: Path
    ranks: list[RankComparison]
    advice: str


# --- pairing ranks -------------------------------------------------------------------------------


def rank_pairs(target: Path, bench: Path) -> list[tuple[str, RankDump, RankDump]]:
    """(name, target dump, bench dump) of each rank. Ranks pair up by folder name; a single
    rank on each side pairs up whatever its name ("rank" outside torchrun, "rank0" under
    it). Runs with different ranks (tp=2 against tp=1) are compared whole: each side's ranks,
    one tensor-parallel group, are merged into one dump."""
    targets, benches = rank_dirs(Path(target)), rank_dirs(Path(bench))
    if len(targets) == 1 and len(benches) == 1 or list(targets) == list(benches):
        pairs = [(read_rank(t), read_rank(b)) for t, b in zip(targets.values(), benches.values(), strict=True)]
        return [(t.name, t, b) for t, b in pairs]
    target_group, bench_group = _tensor_parallel_group(targets), _tensor_parallel_group(benches)
    whole_target = _whole(target_group, bench_group)
    return [(whole_target.name, whole_target, _whole(bench_group, target_group))]


def _whole(group: list[RankDump], other: list[RankDump]) -> RankDump:
    if len(group) == 1:
        return group[0]
    return merge_ranks(group, replace(other[0], ranks=len(other)))  # other[0]: shapes of a shard of len(other) ranks


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


def tensor_metrics(npu: np.ndarray, bench: np.ndarray) -> dict[str, float]:
    """msprobe's tensor-mode metrics of two arrays of one shape (the caller has checked that nan
    and inf sit at the same places). Cosine needs two elements, EucDist and the ratios one
    dimension, as in msprobe; what cannot be computed is left out."""
    finite = np.isfinite(npu) & np.isfinite(bench)
    npu, bench = np.where(finite, npu, 0), np.where(finite, bench, 0)  # msprobe zeroes matching nan/inf
    n, b = npu.reshape(-1).astype(np.float64), bench.reshape(-1).astype(np.float64)
    relative = relative_error(npu, bench)
    metrics = {"MaxAbsErr": float(np.abs(n - b).max()), "MaxRelativeErr": float(relative.max())}
    if npu.ndim == 0:
        return metrics
    metrics["EucDist"] = float(np.linalg.norm(n - b))
    metrics["One Thousandth Err Ratio"] = float(np.mean(relative < 0.001))
    metrics["Five Thousandths Err Ratio"] = float(np.mean(relative < 0.005))
    if n.size > 1:
        n_norm, b_norm = np.linalg.norm(n), np.linalg.norm(b)
        eps = np.finfo(float).eps
        if np.array_equal(n, b) or (n_norm <= eps and b_norm <= eps):
            metrics["Cosine"] = 1.0
        elif n_norm > eps and b_norm > eps:
            metrics["Cosine"] = float(np.dot(n, b) / (n_norm * b_norm))
    return metrics


def same_nonfinite(npu: np.ndarray, bench: np.ndarray) -> bool:
    """Whether nan, inf and -inf sit at the same places in both arrays."""
    return np.array_equal(np.isnan(npu), np.isnan(bench)) and np.array_equal(
        np.where(np.isinf(npu), npu, 0.0), np.where(np.isinf(bench), bench, 0.0)
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _statistics_metrics(npu: dict[str, Any], bench: dict[str, Any]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for stat, diff_col, rel_col in zip(_STATS, _STATISTICS[:4], _STATISTICS[4:], strict=True):
        n, b = _number(npu.get(stat)), _number(bench.get(stat))
        if n is None or b is None:
            continue
        diff = 0.0 if n == b or (math.isnan(n) and math.isnan(b)) else n - b
        metrics[diff_col] = diff
        metrics[rel_col] = abs(diff) / (abs(b) + STAT_EPSILON)
    return metrics


# --- rows and results -------------------------------------------------------------------------------


def _row(mode: str, leaf: Leaf, bench: Leaf | None, stack: list[str]) -> Row:
    npu, other = leaf.record, bench.record if bench else {}
    tensor = leaf.is_tensor
    cells: dict[str, Any] = {
        "NPU Name": leaf.name,
        "Bench Name": bench.name if bench else None,
        "NPU Dtype": npu.get("dtype", npu["type"]),
        "Bench Dtype": other.get("dtype", other.get("type")),
        "NPU Tensor Shape": npu.get("shape"),
        "Bench Tensor Shape": other.get("shape"),
        "NPU Requires_grad": npu.get("requires_grad"),
        "Bench Requires_grad": other.get("requires_grad"),
        "NPU_Stack_Info": "\n".join(stack),
    }
    for prefix, record in (("NPU", npu), ("Bench", other)):
        values = [record.get(stat) for stat in _STATS] if tensor else [record.get("value"), None, None, None]
        cells.update(zip((f"{prefix} max", f"{prefix} min", f"{prefix} mean", f"{prefix} l2norm"), values, strict=True))
    cells["NPU MD5"], cells["BENCH MD5"] = npu.get("md5"), other.get("md5")
    row = Row(leaf, cells)
    if bench is None:
        row.result = WARNING if mode == "md5" else UNMATCHED  # msprobe's CRC-32 rule warns
        row.messages.append("No bench data matched.")
        return row
    cells["Requires_grad Consistent"] = npu.get("requires_grad") == other.get("requires_grad")
    problems = [value.problem for value in (leaf, bench) if value.problem is not None]
    if any(result == UNMATCHED for result, _ in problems):
        row.result = UNMATCHED
        row.messages += [message for _, message in problems]
        return row
    for result, message in problems:
        row.flag(result, message)
    if not tensor:
        if npu.get("value") != other.get("value") or npu["type"] != other["type"]:
            row.flag(ERROR, "non-tensor value differs")
        return row
    if npu.get("dtype") != other.get("dtype"):
        row.flag(ERROR, f"dtype differs ({npu.get('dtype')} vs {other.get('dtype')})")
    if npu.get("shape") != other.get("shape"):
        row.flag(ERROR, "shape differs")
        return row
    if not cells["Requires_grad Consistent"]:
        row.flag(ERROR, "requires_grad is inconsistent")
    if mode == "md5":
        if npu.get("md5") != other.get("md5"):
            row.flag(ERROR, "CRC-32 differs")
        return row
    if any(_nonfinite(npu.get(s)) and not _nonfinite(other.get(s)) for s in ("Max", "Min")):
        row.flag(ERROR, "maximum or minimum is nan, -inf, or inf")
    if mode == "tensor":
        cells["Data_name"] = json.dumps([npu.get("data_name"), other.get("data_name")])
        if leaf.files and bench.files and math.prod(npu["shape"]) > 0:
            arrays = load_array(leaf), load_array(bench)
            if same_nonfinite(*arrays):
                row.metrics = tensor_metrics(*arrays)
            else:
                row.flag(ERROR, "the positions of inf or nan differ")
    else:
        row.metrics = _statistics_metrics(npu, other)
    cells.update(row.metrics)
    return row


def _nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _extreme(rows: list[Row], metric: str, lowest: bool) -> float:
    """msprobe's get_min_or_max_value: the lowest (highest) value of ``metric``, from 1.0 (0.0) up."""
    values = [row.metrics[metric] for row in rows if not math.isnan(row.metrics.get(metric, math.nan))]
    return min([1.0, *values]) if lowest else max([0.0, *values])


def _denoised(norm_relative_error: float) -> float:
    return 0.0 if norm_relative_error < NORM_NOISE else norm_relative_error


def _judge_outputs(mode: str, rows: list[Row]) -> None:
    """msprobe's rules that judge a call's outputs against its inputs and parameters."""
    inputs = [row for row in rows if row.leaf.side != "output"]
    outputs = [row for row in rows if row.leaf.side == "output"]
    if not outputs:
        return
    if mode == "tensor":
        ratio_in = _extreme(inputs, "One Thousandth Err Ratio", lowest=True)
        if ratio_in > THOUSANDTH_INPUT_MIN and _extreme(outputs, "One Thousandth Err Ratio", lowest=True) < THOUSANDTH_OUTPUT_MAX:
            outputs[0].flag(ERROR, "the inputs' one thousandth err ratio exceeds 0.9 while the output's is below 0.1")
        cosine_in = _extreme(inputs, "Cosine", lowest=True)
        if cosine_in > COSINE_INPUT_MIN and cosine_in - _extreme(outputs, "Cosine", lowest=True) > COSINE_DROP:
            outputs[0].flag(WARNING, "the output's cosine is lower than the inputs' by more than 0.1")
        return
    norm_in = _denoised(_extreme(inputs, "NormRelativeErr", lowest=False))
    if norm_in < NORM_INPUT_MAX:
        for row in outputs:
            if row.metrics.get("NormRelativeErr", 0.0) > NORM_OUTPUT_MIN:
                row.flag(ERROR, "the inputs' norm relative error is below 0.1 while the output's exceeds 0.5")
    norm_out = _denoised(_extreme(outputs, "NormRelativeErr", lowest=False))
    if (norm_in == 0 and norm_out > NORM_OUTPUT_FROM_EXACT) or (norm_in > 0 and norm_out / norm_in > NORM_GROWTH):
        outputs[0].flag(WARNING, "the output's norm relative error exceeds 10 times the inputs' (0.1 when they agree)")


def compare_rank(target: RankDump, bench: RankDump) -> list[Row]:
    """The rows of one rank's dump against its benchmark, in the target's order."""
    mode = target.mode
    bench_leaves = {leaf.name: leaf for leaf in bench.leaves}
    rows: list[Row] = []
    for entry, group in itertools.groupby(target.leaves, key=lambda leaf: leaf.entry):
        stack = target.stacks.get(entry) or target.stacks.get(entry.replace(".backward", ".forward"), [])
        entry_rows = [_row(mode, leaf, bench_leaves.get(leaf.name), stack) for leaf in group]
        if not entry.startswith("Module.") and entry.split(".")[1] in REDUNDANT_APIS:
            for row in entry_rows:
                if row.result != UNMATCHED:
                    row.result, row.messages = PASS, []
        elif mode != "md5" and ".parameters_grad" not in entry:  # msprobe counts these among the inputs
            _judge_outputs(mode, entry_rows)
        rows.extend(entry_rows)
    for row in rows:
        row.cells["Result"] = row.result
        row.cells["Err_message"] = "; ".join(row.messages)
    return rows


# --- output -----------------------------------------------------------------------------------------


def _cell(value: Any) -> Any:
    if value is None:
        return "N/A"
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
    pairs = rank_pairs(config.target, config.bench)
    for _, target, bench in pairs:
        if target.mode != bench.mode:
            raise ValueError(f"{config.target} is a {target.mode} dump and {config.bench} a {bench.mode} dump: "
                             "compare dumps of the same mode")
    with atomic_directory(config.out) as work:
        ranks, files = [], []
        for rank, target, bench in pairs:
            rows = compare_rank(target, bench)
            ranks.append(RankComparison(rank, target.mode, rows, f"compare_result_{rank}.csv"))
            files += _write_tables(work, f"compare_result_{rank}", target.mode, rows)
        advice = advise(ranks)
        (work / "advisor.txt").write_text(advice, encoding="utf-8")
        files.append(work / "advisor.txt")
        params = config.model_dump(mode="json")
        write_json_atomic(work / MANIFEST, manifest_payload(STAGE, params, [file_record(f, work) for f in files]))
    return CompareReport(Path(config.out), ranks, advice)
