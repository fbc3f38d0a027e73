"""The markdown summary a flow run publishes as its Prefect artifact."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact

from llmflow import tracking

BENCHMARK_TITLES = {"mmlu": "MMLU", "ceval": "C-Eval", "cmmlu": "CMMLU", "boolq": "BoolQ", "agieval": "AGIEval",
                    "gsm8k": "GSM8K", "bbh": "BBH", "humaneval": "HumanEval", "minerva-math500": "MATH-500",
                    "minerva-math": "MATH", "mmlu-pro": "MMLU-Pro", "gpqa-diamond": "GPQA Diamond", "ifeval": "IFEval"}


def summary_markdown(flow: str, result: dict[str, Any], mlflow_run: str) -> str:
    """Scores (before/after when both exist), outputs and the MLflow run of a flow run."""
    lines = [f"# {flow}", ""]
    compared = [(name, key) for key, name in BENCHMARK_TITLES.items() if f"{key}_before" in result]
    if result.get("comparison"):
        lines += comparison_markdown(result["comparison"])
    elif compared:
        lines += ["| benchmark | before | after | change |", "|---|---|---|---|"]
        for name, key in compared:
            before, after = result[f"{key}_before"], result[f"{key}_after"]
            lines.append(f"| {name} | {before:.4f} | {after:.4f} | {after - before:+.4f} |")
        lines.append("")
    else:
        scores = [(name, result[key]) for key, name in BENCHMARK_TITLES.items() if key in result]
        lines += ["| benchmark | score |", "|---|---|", *(f"| {n} | {v:.4f} |" for n, v in scores), ""]
    lines += alignment_markdown(result)
    for key in ("version", "checkpoint", "model", "sft_model", "reference", "answers", "evaluation"):
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


HELDOUT_SCORES = {
    "heldout_pairs": ("held-out preference pairs", "held-out pairs",
                      (("reward_accuracy", "reward accuracy"), ("reward_margin", "reward margin"))),
    "heldout_prompts": ("held-out prompts", "held-out prompts",
                        (("reward_accuracy", "reward accuracy"), ("reward", "mean reward"))),
}
"""What each kind of alignment measures on its held-out set (by the count its result holds):
the preference pairs' implicit reward, or the prompts' greedy completions' rewards (grpo)."""


def alignment_markdown(result: dict[str, Any]) -> list[str]:
    """The held-out scores before and after an alignment run, when there was one."""
    kind = next((key for key in HELDOUT_SCORES if key in result), None)
    if kind is None or "reward_accuracy_after" not in result:
        return []
    what, column, scores = HELDOUT_SCORES[kind]
    rows = [f"| {label} | {result[f'{key}_before']:.4f} | {result[f'{key}_after']:.4f} |" for key, label in scores]
    return [f"Alignment ({result['method']}) on {int(result[kind])} {what}:", "",
            f"| {column} | before | after |", "|---|---|---|", *rows, ""]


def comparison_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The comparison table (flows/comparison.py's rows) and its verdict as markdown lines: the
    base, SFT and aligned models' scores side by side when an alignment stage followed the SFT
    model, else before and after."""
    def cell(value: float | None, sign: bool = False) -> str:
        return "-" if value is None else f"{value:+.4f}" if sign else f"{value:.4f}"

    aligned = any(r["sft"] is not None for r in rows)
    models = ["base", "SFT", "aligned"] if aligned else ["before", "after"]
    header = ["benchmark", *models, "registered", "previous run", "change", "±"]
    lines = [f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
    for r in rows:
        scores = [r["before"], *([r["sft"]] if aligned else []), r["after"], r["registered"], r["previous"]]
        flag = " **regression**" if r["regression"] else ""
        lines.append(f"| {BENCHMARK_TITLES[r['benchmark']]} | {' | '.join(cell(v) for v in scores)} | "
                     f"{cell(r['change'], sign=True)}{flag} | {cell(r['change_stderr'])} |")
    fell = [BENCHMARK_TITLES[r["benchmark"]] for r in rows if r["regression"]]
    verdict = (f"Regression since the previous run (more than two standard errors of the change): {', '.join(fell)}"
               if fell else "No regression since the previous run.")
    return [*lines, "", verdict, ""]


def publish_summary(flow: str, result: dict[str, Any], mlflow_run: str) -> None:
    """The summary as a markdown artifact of the flow run, and as summary.md in its MLflow run."""
    import mlflow

    markdown = summary_markdown(flow, result, mlflow_run)
    create_markdown_artifact(markdown=markdown, key=f"{flow}-summary", description=f"{flow} results")
    mlflow.MlflowClient().log_text(mlflow_run, markdown, "summary.md")
