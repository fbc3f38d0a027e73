"""The advisor: the first diverging operation of each rank, its weight when that is what
differs, its call stack and the likely cause (and, for a run put together from pipeline
stages, the rank, entry and stage it was dumped as).

Execution order is dump.json's order, where a call's entry is written when the call
returns: whatever a call consumed was produced by entries before it. Like msprobe's
first-diff analysis (``msprobe compare -da``: msprobe/core/compare/diff_analyze), the
diverging operation is the first call whose output diverges: a relative error of its
max, min, mean or norm above 0.5, or an output the accuracy rules flag. A call's
inputs then tell the cause: a weight that differs (found by its statistics among the
modules' parameters) is named as the weight; inputs that agree leave the call's own
computation. The table's first row that the rules flag is named too, with its line, as
msprobe's table shows it.
"""

from __future__ import annotations

import itertools
from collections import Counter

from llmflow.probe.compare.rows import RankComparison, Row
from llmflow.probe.dump.apis import is_inplace

ALL_PASS = "Every compared value meets the accuracy rules."
FLAGGED = ("warning", "error")
DIFF_THRESHOLD = 0.5
"""A call's output diverges when a relative error of its max, min, mean or norm exceeds this
(msprobe's first-diff analysis, diff_analyze_threshold.yaml)."""


def first_divergence(rows: list[Row]) -> tuple[int, Row] | None:
    """(index, row) of the first row whose result is warning or error."""
    return next(((i, row) for i, row in enumerate(rows) if row.result in FLAGGED), None)


def _worst_error(row: Row) -> tuple[str, float]:
    """(statistic, relative error) of the row's largest relative error."""
    return max(row.stat_errors.items(), key=lambda item: item[1], default=("Norm", 0.0))


def _differs(row: Row, floor: float) -> bool:
    """Whether the row's values differ between the runs (beyond ``floor``, the noise floor)."""
    if row.result in FLAGGED:
        return True
    if row.cells.get("NPU MD5") is not None and row.cells.get("NPU MD5") != row.cells.get("BENCH MD5"):
        return True
    return _worst_error(row)[1] > floor or row.metrics.get("MaxAbsErr", 0.0) > 0


def _calls(rows: list[Row]) -> list[tuple[int, list[Row]]]:
    """(index of its first row, its rows) of each call, in the table's order."""
    calls, index = [], 0
    for _, group in itertools.groupby(rows, key=lambda row: row.leaf.entry):
        call = list(group)
        calls.append((index, call))
        index += len(call)
    return calls


def diverging_call(rows: list[Row], floor: float = 0.0, threshold: float = DIFF_THRESHOLD) -> tuple[int, list[Row]] | None:
    """(index of its first row, its rows) of the first call whose output diverges: a result of
    warning or error, or a relative error of a statistic above ``threshold`` where the norm's
    is not below ``floor`` (the noise floor: a mean near 0 moved by rounding is no divergence)."""
    return next(((index, call) for index, call in _calls(rows) if any(
        ".output." in row.leaf.name and (row.result in FLAGGED or (
            _worst_error(row)[1] > threshold and row.stat_errors.get("Norm", 0.0) >= floor)) for row in call)),
        None)


def weight_of(row: Row, rows: list[Row]) -> str | None:
    """The parameter an input row holds: itself when it is a module's parameter, else the
    first module parameter after it with the same shape and statistics."""
    if row.leaf.side == "parameters":
        return row.leaf.name
    key = _identity(row)
    start = rows.index(row)
    return next((other.leaf.name for other in rows[start:] if other.leaf.side == "parameters" and _identity(other) == key),
                None)


def _identity(row: Row) -> tuple:
    return tuple(row.cells.get(column) for column in ("NPU Dtype", "NPU Tensor Shape", "NPU max", "NPU min", "NPU mean",
                                                      "NPU l2norm"))


def likely_cause(call: list[Row], rows: list[Row], floor: float = 0.0) -> tuple[str, str, Row]:
    """(cause, advice, the row it is about) for a diverging call."""
    outputs = [row for row in call if ".output." in row.leaf.name]
    row = next((r for r in outputs if r.result in FLAGGED), outputs[0] if outputs else call[0])
    for candidate in call:
        if any("dtype of NPU and Bench" in message for message in candidate.messages):
            return "dtype", (
                f"The runs hold this value in different dtypes ({candidate.cells['NPU Dtype']} vs "
                f"{candidate.cells['Bench Dtype']}): compare their dtype settings, autocast and the casts before this call."
            ), candidate
        if any("shape of NPU and Bench" in message for message in candidate.messages):
            return "shape", (
                f"The runs give this value different shapes ({candidate.cells['NPU Tensor Shape']} vs "
                f"{candidate.cells['Bench Tensor Shape']}): compare runs with the same model, batch and parallel layout."
            ), candidate
    entry = row.leaf.entry
    backward = ".backward" in entry or ".parameters_grad" in entry
    inputs = [r for r in call if ".output." not in r.leaf.name and r.result != "N/A" and _differs(r, floor)]
    for candidate in inputs:
        weight = weight_of(candidate, rows)
        if weight is not None and not backward:
            stat, error = _worst_error(candidate)
            return "weight", (
                f"The weight {weight} differs between the runs ({stat} relative error {error:.4g}) while this call's "
                "other inputs agree: the runs started from different weights (a corrupted or differently converted "
                "checkpoint: compare the weight files), or an earlier optimizer step changed it."
            ), candidate
    api = None if entry.startswith("Module.") else entry.rsplit(".", 2)[0]
    if api is not None and is_inplace(api):
        return "in-place op", (
            "This call overwrites its input in place: check that the overwritten tensor is not still needed, and the "
            "op's implementation."
        ), row
    if inputs and not backward:
        return "input", (
            "The inputs differ although every earlier call agrees: an in-place op may have overwritten them, or they "
            "come from outside the dump (data, memory corruption); check where they are produced."
        ), inputs[0]
    if inputs:
        return "backward", (
            "The gradients reaching this call differ: check whether the forward results after it, or the loss, differ."
        ), inputs[0]
    if not backward:
        return "forward computation", (
            "The output diverges from inputs and weights that agree: check this call's forward computation (its "
            "kernel, its precision)."
        ), row
    return "backward", (
        "The gradients this call computes diverge from incoming gradients that agree: check its backward computation."
    ), row


def dumped_as(parts: list[list]) -> str:
    """Where a merged entry's parts were dumped: "Functional.linear.6.forward in rank1 (pipeline stage 1)"."""
    return "; ".join(f"{entry} in {rank} (pipeline stage {stage})" for rank, entry, stage in parts)


def advise(ranks: list[RankComparison], noise_floor: float = 0.0) -> str:
    """The advisor's text: for each rank, the first diverging call or that there is none;
    and whether a noise floor changed msprobe's verdicts."""
    blocks = []
    for rank in ranks:
        lines = [f"[{rank.rank}] {rank.csv}"]
        call = diverging_call(rank.rows, noise_floor)
        flagged = first_divergence(rank.rows)
        if call is None and flagged is not None:  # only inputs flagged (a dtype, a nan)
            call = next((i, rows) for i, rows in _calls(rank.rows) if flagged[1] in rows)
        uncompared = Counter("; ".join(row.messages) for row in rank.rows if row.result == "N/A")
        if call is None:
            lines.append(ALL_PASS)
        else:
            index, rows = call
            cause, advice, row = likely_cause(rows, rank.rows, noise_floor)
            stat, error = _worst_error(row)
            measured = f"; {stat} relative error {error:.4g}" if row.stat_errors else ""
            lines += [
                f"Suspect Nodes: {row.leaf.entry}",
                f"Line: {index + 2}",
                f"Row: {row.leaf.name} ({row.result}{measured})",
                *([f"Dumped as: {dumped_as(rank.origins[row.leaf.entry])}"]
                  if rank.origins and row.leaf.entry in rank.origins else []),
                *([f"Weight: {weight_of(row, rank.rows)}"] if cause == "weight" else []),
                f"Likely cause: {cause}",
                f"Expert Advice: {advice}",
                "Call stack:",
                *(f"  {frame}" for frame in row.stack),
            ]
            if flagged is not None:
                lines.append(f"First row the accuracy rules flag: Line {flagged[0] + 2}, {flagged[1].leaf.name} "
                             f"({'; '.join(flagged[1].messages)})")
        lines += [f"{n} values of the target not compared: {reason}" for reason, n in uncompared.most_common()]
        blocks.append("\n".join(lines))
    if noise_floor > 0:
        blocks.append(f"Noise floor on: norm relative errors below {noise_floor:g} count as agreement in the accuracy "
                      "rules (norm_noise_floor, for runs of different parallel layouts); msprobe's own verdicts may differ.")
    return "\n\n".join(blocks) + "\n"
