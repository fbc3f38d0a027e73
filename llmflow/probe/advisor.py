"""The advisor: the first diverging node of each rank, its call stack and the likely cause.

Execution order is dump.json's order, where a call's entry is written when the call
returns: whatever a call consumed was produced by entries before it, so the first row
whose result is not pass is where the divergence starts. Like msprobe's advisor (Ascend/mstt,
``debug/accuracy_tools/msprobe/pytorch/advisor/advisor.py``), the advice depends on
whether that row is a forward or backward input or output; llmflow adds dtype
mismatches, in-place calls and parameters.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from llmflow.probe.apis import is_inplace

if TYPE_CHECKING:
    from llmflow.probe.compare import RankComparison, Row

ALL_PASS = "Every compared value meets the accuracy rules."


def first_divergence(rows: list[Row]) -> tuple[int, Row] | None:
    """(index, row) of the first row whose result is warning or error."""
    return next(((i, row) for i, row in enumerate(rows) if row.result in ("warning", "error")), None)


def _api(entry: str) -> str | None:
    """``Tensor.add_`` for ``Tensor.add_.3.forward``; None for modules."""
    return None if entry.startswith("Module.") else entry.rsplit(".", 2)[0]


def likely_cause(row: Row) -> tuple[str, str]:
    """(cause, advice) for a diverging row."""
    leaf = row.leaf
    backward = ".backward" in leaf.entry or ".parameters_grad" in leaf.entry
    api = _api(leaf.entry)
    if any(message.startswith("dtype differs") for message in row.messages):
        return "dtype", (
            f"The runs hold this value in different dtypes ({row.cells['NPU Dtype']} vs {row.cells['Bench Dtype']}): "
            "compare their dtype settings, autocast and the casts before this call."
        )
    if "shape differs" in row.messages:
        return "shape", (
            f"The runs give this value different shapes ({row.cells['NPU Tensor Shape']} vs "
            f"{row.cells['Bench Tensor Shape']}): compare runs with the same model, batch and parallel layout."
        )
    if api is not None and is_inplace(api):
        return "in-place op", (
            "This call overwrites its input in place: check that the overwritten tensor is not still needed, and the "
            "op's implementation."
        )
    if leaf.side == "parameters":
        return "parameters", (
            "The weights differ before this call: the runs started from different weights, or an earlier optimizer "
            "step diverged."
        )
    if not backward and leaf.side == "input":
        return "in-place op", (
            "The inputs differ although every earlier call agrees: an in-place op may have overwritten them, or they "
            "come from outside the dump (data, memory corruption); check where they are produced."
        )
    if not backward:
        return "forward computation", (
            "The output diverges from inputs that agree: check this call's forward computation (kernel, precision)."
        )
    if leaf.side == "input":
        return "backward", (
            "The gradients reaching this call differ: check whether the forward results after it, or the loss, differ."
        )
    return "backward", (
        "The gradients this call computes diverge from incoming gradients that agree: check its backward computation."
    )


def advise(ranks: list[RankComparison]) -> str:
    """The advisor's text: for each rank, the first divergence or that there is none."""
    blocks = []
    for rank in ranks:
        lines = [f"[{rank.rank}] {rank.csv}"]
        found = first_divergence(rank.rows)
        uncompared = Counter("; ".join(row.messages) for row in rank.rows if row.result == "N/A")
        if found is None:
            lines.append(ALL_PASS)
        else:
            index, row = found
            cause, advice = likely_cause(row)
            lines += [
                f"Suspect Nodes: {row.leaf.entry}",
                f"Line: {index + 2}",
                f"Row: {row.leaf.name}",
                f"Result: {row.result} ({'; '.join(row.messages)})",
                f"Likely cause: {cause}",
                f"Expert Advice: {advice}",
                "Call stack:",
                *(f"  {frame}" for frame in row.cells["NPU_Stack_Info"].splitlines()),
            ]
        lines += [f"{n} values of the target not compared: {reason}" for reason, n in uncompared.most_common()]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
