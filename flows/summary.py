"""The markdown summary a flow run publishes as its Prefect artifact."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact

from llmflow import tracking

BENCHMARKS = {"mmlu": "MMLU", "ceval": "C-Eval", "cmmlu": "CMMLU"}


def summary_markdown(flow: str, result: dict[str, Any], mlflow_run: str) -> str:
    """Scores (before/after when both exist), outputs and the MLflow run of a flow run."""
    lines = [f"# {flow}", ""]
    if "mmlu_before" in result:
        before, after = result["mmlu_before"], result["mmlu_after"]
        lines += ["| MMLU | accuracy |", "|---|---|", f"| before | {before:.4f} |", f"| after | {after:.4f} |",
                  f"| change | {after - before:+.4f} |", ""]
    else:
        scores = [(name, result[key]) for key, name in BENCHMARKS.items() if key in result]
        lines += ["| benchmark | accuracy |", "|---|---|", *(f"| {n} | {v:.4f} |" for n, v in scores), ""]
    for key in ("version", "checkpoint", "model", "answers", "evaluation"):
        if result.get(key):
            lines.append(f"- {key}: `{result[key]}`")
    if result.get("registered"):
        registered = result["registered"]
        lines.append(f"- registered: `{registered['name']}` version {registered['version']}")
    if result.get("gate"):
        gate = result["gate"]
        lines.append(f"- registry gate ({gate['rule']}): {'passed' if gate['passed'] else 'failed'}: {gate['reason']}")
    lines.append(f"- MLflow: {tracking.run_link(mlflow_run)}")
    return "\n".join(lines) + "\n"


def publish_summary(flow: str, result: dict[str, Any], mlflow_run: str) -> None:
    """The summary as a markdown artifact of the flow run, and as summary.md in its MLflow run."""
    import mlflow

    markdown = summary_markdown(flow, result, mlflow_run)
    create_markdown_artifact(markdown=markdown, key=f"{flow}-summary", description=f"{flow} results")
    mlflow.MlflowClient().log_text(mlflow_run, markdown, "summary.md")
