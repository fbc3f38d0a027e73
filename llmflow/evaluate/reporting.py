"""What every evaluation of lm-evaluation-harness tasks reports, whatever it scores: a group's
micro and macro averages of its tasks' metrics, the table printed, what results.json says of
the run, and results.json, predictions.jsonl and manifest.json written as one directory.

A task's results name each metric beside its standard error (``acc`` and ``acc_stderr``); a
metric is any key that has its ``_stderr``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.evaluate.provenance import llmflow_version, model_identity
from llmflow.evaluate.settings import EvalSettings
from llmflow.evaluate.statistics import pooled_stderr

HARNESS = "lm-evaluation-harness 0.4.13 task definitions"


def metrics_of(task: dict[str, Any]) -> list[str]:
    """The metrics a task's results report, in their order."""
    return [key for key in task if not key.endswith("_stderr") and f"{key}_stderr" in task]


def group_results(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Micro (over documents: the harness's size-weighted group score) and macro (over tasks)
    means of each metric every task reports."""
    sizes = [t["samples"] for t in tasks.values()]
    metrics = [m for m in metrics_of(next(iter(tasks.values()))) if all(m in t for t in tasks.values())]
    results: dict[str, Any] = {"samples": sum(sizes), "tasks": len(tasks)}
    for metric in metrics:
        values = [t[metric] for t in tasks.values()]
        results[metric] = {
            "micro": sum(v * n for v, n in zip(values, sizes)) / sum(sizes),
            "micro_stderr": pooled_stderr([t[f"{metric}_stderr"] for t in tasks.values()], sizes),
            "macro": sum(values) / len(values),
        }
    return results


def headline(metric: str, tasks: dict[str, dict[str, Any]], group: dict[str, Any] | None) -> dict[str, Any]:
    """The score a run is known by, with its standard error: ``metric``'s micro average over
    a group, or its first task's value."""
    if group is not None:
        return {"metric": metric, "average": "micro", "value": group[metric]["micro"],
                "stderr": group[metric]["micro_stderr"]}
    first = next(iter(tasks.values()))
    return {"metric": metric, "average": None, "value": first[metric], "stderr": first[f"{metric}_stderr"]}


def with_stderr(value: float, stderr: float | None) -> str:
    """A metric and its standard error ("N/A" where the harness reports none)."""
    return f"{value:.4f} ± {'N/A' if stderr is None else f'{stderr:.4f}'}"


def format_table(results: dict[str, Any]) -> str:
    """Each task's metrics and the group's micro and macro averages as a text table."""
    metrics = list(dict.fromkeys(m for t in results["tasks"].values() for m in metrics_of(t)))
    rows = [("task", "samples", *metrics)]
    for name, t in results["tasks"].items():
        rows.append((name, str(t["samples"]), *(with_stderr(t[m], t[m + "_stderr"]) if m in t else "-" for m in metrics)))
    if group := results.get("group"):
        for average in ("micro", "macro"):
            rows.append((f"[{average}]", str(group["samples"]),
                         *(f"{group[m][average]:.4f}" if m in group else "-" for m in metrics)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def run_record(config: EvalSettings, seconds: float, samples: int, **settings: Any) -> dict[str, Any]:
    """What results.json says of the run: the model's identity, llmflow's version, the harness
    followed, every setting (with ``settings`` resolved on the way) and the speed."""
    return {
        "model": model_identity(config.model), "llmflow_version": llmflow_version(), "harness": HARNESS,
        "settings": {**config.model_dump(mode="json"), "fewshot_as_multiturn": config.multiturn, **settings},
        "seconds": seconds, "samples_per_s": samples / seconds if seconds else None,
    }


def write_outputs(out: Path, stage: str, params: dict[str, Any], results: dict[str, Any], lines: list[str]) -> Path:
    """results.json and predictions.jsonl (``lines``) into ``out``, replaced whole, then its
    manifest with the headline value and standard error as the accuracy; returns ``out`` resolved."""
    out = Path(out).expanduser().resolve()
    with atomic_directory(out) as work:
        write_json_atomic(work / "results.json", results)
        with open(work / "predictions.jsonl", "w", encoding="utf-8") as f:
            f.writelines(lines)
        files = [file_record(work / name, work) for name in ("results.json", "predictions.jsonl")]
        write_json_atomic(work / MANIFEST, manifest_payload(
            stage, params, files, accuracy=results["headline"]["value"],
            accuracy_stderr=results["headline"]["stderr"], samples=len(lines)))
    return out
