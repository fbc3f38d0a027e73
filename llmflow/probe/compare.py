"""Compare a dump against a benchmark dump, as msprobe's compare does.

Inputs are step folders (``{dump_path}/step{N}``, ranks matched by folder name) or rank
folders. Every tensor (and non-tensor argument) of the target dump is matched by name with
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from pydantic_settings import CliPositionalArg

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.probe.advisor import advise
from llmflow.probe.dump import TENSOR_DIR

STAGE = "probe-compare"

PASS, WARNING, ERROR, UNMATCHED = "pass", "warning", "error", "N/A"

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
    """The dump under test: a step folder ({dump_path}/step{N}) or one rank folder."""
    bench: CliPositionalArg[Path]
    """The benchmark dump, at the same level."""
    out: Path
    """Output folder: compare_result_{rank}.csv (.xlsx with openpyxl), advisor.txt, manifest.json."""


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


# --- reading dumps ------------------------------------------------------------------------------------


def leaves(dump: dict[str, Any]) -> list[Leaf]:
    """The values of a dump.json, in its order (the order the calls finished)."""
    found: list[Leaf] = []
    for entry, value in dump["data"].items():
        if ".parameters_grad" in entry:  # older msprobe versions write no call count after it
            for pname, grads in value.items():  # msprobe names the rows {entry}.{param}
                _walk(grads[0] if len(grads) == 1 else grads, f"{entry}.{pname}", entry, "output", found)
            continue
        for key, part in value.items():
            side = key if key in ("output", "parameters") else "input"
            _walk(part, f"{entry}.{side}", entry, side, found)
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


def dump_mode(dump: dict[str, Any]) -> str:
    if dump.get("task") == "tensor":
        return "tensor"
    return "md5" if any("md5" in leaf.record for leaf in leaves(dump)) else "statistics"


def _rank_dirs(path: Path) -> dict[str, Path]:
    if (path / "dump.json").is_file():
        return {path.name: path}
    found = {p.name: p for p in sorted(path.iterdir()) if p.name.startswith("rank") and (p / "dump.json").is_file()}
    if not found:
        raise FileNotFoundError(f"{path}: no dump.json in it or in rank folders under it")
    return found


def rank_pairs(target: Path, bench: Path) -> list[tuple[str, Path, Path]]:
    """(rank, target folder, bench folder) matched by rank folder name; a single rank on
    each side pairs up whatever its name ("rank" outside torchrun, "rank0" under it)."""
    targets, benches = _rank_dirs(Path(target)), _rank_dirs(Path(bench))
    if len(targets) == 1 and len(benches) == 1:
        (name, t), (_, b) = next(iter(targets.items())), next(iter(benches.items()))
        return [(name, t, b)]
    missing = sorted(set(targets) ^ set(benches))
    if missing:
        raise ValueError(f"ranks {missing} are in only one of {target} and {bench}")
    return [(name, targets[name], benches[name]) for name in targets]


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


def _load_array(rank_dir: Path, record: dict[str, Any]) -> np.ndarray:
    tensor = torch.load(rank_dir / TENSOR_DIR / record["data_name"], map_location="cpu", weights_only=True)
    if tensor.is_complex():
        tensor = tensor.abs()
    if tensor.dtype in (torch.bfloat16, torch.float16, torch.bool):
        tensor = tensor.float()  # numpy has no bfloat16
    return tensor.numpy()


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


def _row(mode: str, leaf: Leaf, bench: Leaf | None, dirs: tuple[Path, Path], stack: list[str]) -> Row:
    npu, other = leaf.record, bench.record if bench else {}
    tensor = npu["type"] == "torch.Tensor"
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
        if npu.get("data_name") and other.get("data_name") and math.prod(npu["shape"]) > 0:
            arrays = _load_array(dirs[0], npu), _load_array(dirs[1], other)
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
    norm_in = _extreme(inputs, "NormRelativeErr", lowest=False)
    if norm_in < NORM_INPUT_MAX:
        for row in outputs:
            if row.metrics.get("NormRelativeErr", 0.0) > NORM_OUTPUT_MIN:
                row.flag(ERROR, "the inputs' norm relative error is below 0.1 while the output's exceeds 0.5")
    norm_out = _extreme(outputs, "NormRelativeErr", lowest=False)
    if (norm_in == 0 and norm_out > NORM_OUTPUT_FROM_EXACT) or (norm_in > 0 and norm_out / norm_in > NORM_GROWTH):
        outputs[0].flag(WARNING, "the output's norm relative error exceeds 10 times the inputs' (0.1 when they agree)")


def compare_rank(target: Path, bench: Path) -> tuple[str, list[Row]]:
    """(mode, rows) of one rank's dump against its benchmark, in the target's order."""
    target_dump = json.loads((target / "dump.json").read_text())
    bench_dump = json.loads((bench / "dump.json").read_text())
    mode, bench_mode = dump_mode(target_dump), dump_mode(bench_dump)
    if mode != bench_mode:
        raise ValueError(f"{target} is a {mode} dump and {bench} a {bench_mode} dump: compare dumps of the same mode")
    stacks = read_stacks(target)
    bench_leaves = {leaf.name: leaf for leaf in leaves(bench_dump)}
    rows: list[Row] = []
    for entry, group in itertools.groupby(leaves(target_dump), key=lambda leaf: leaf.entry):
        stack = stacks.get(entry) or stacks.get(entry.replace(".backward", ".forward"), [])
        entry_rows = [_row(mode, leaf, bench_leaves.get(leaf.name), (target, bench), stack) for leaf in group]
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
    return mode, rows


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
    with atomic_directory(config.out) as work:
        ranks, files = [], []
        for rank, target, bench in pairs:
            mode, rows = compare_rank(target, bench)
            ranks.append(RankComparison(rank, mode, rows, f"compare_result_{rank}.csv"))
            files += _write_tables(work, f"compare_result_{rank}", mode, rows)
        advice = advise(ranks)
        (work / "advisor.txt").write_text(advice, encoding="utf-8")
        files.append(work / "advisor.txt")
        params = config.model_dump(mode="json")
        write_json_atomic(work / MANIFEST, manifest_payload(STAGE, params, [file_record(f, work) for f in files]))
    return CompareReport(Path(config.out), ranks, advice)
