"""The evaluate flow: a model (hub, local directory, training checkpoint) on MMLU and,
when asked, C-Eval and CMMLU."""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow
from pydantic import Field

from llmflow.flows import stages
from llmflow.flows.params import SAMPLE, EvalParams, Params, Stage
from llmflow.flows.summary import publish_summary

FLOW = "evaluate"


class EvaluateParams(Params):
    """Evaluate one model on multiple-choice benchmarks."""

    workspace: str = "workspace"
    """Directory of every stage's output (and the default MLflow store)."""
    model: str = SAMPLE
    """Model: hf://org/name, ms://org/name, a local Hugging Face directory, a training
    checkpoint (run directory or step directory, LoRA included), or "sample"."""
    revision: str | None = None
    """Hub revision of the model."""
    benchmarks: list[Literal["mmlu", "ceval", "cmmlu"]] = Field(default_factory=lambda: ["mmlu"], min_length=1)
    """Benchmarks to run: mmlu (data from evaluation.data), ceval, cmmlu."""
    evaluation: EvalParams = EvalParams()
    """Settings shared by the benchmarks (evaluation.data is MMLU's)."""
    ceval_data: str = "hf://ceval/ceval-exam"
    """C-Eval data: the hub dataset or a local copy in one of its layouts (the val split is scored)."""
    cmmlu_data: str = "hf://haonan-li/cmmlu"
    """CMMLU data: the hub dataset or a local copy in one of its layouts."""
    refresh: list[Stage] = Field(default_factory=list)
    """Stages to run again even when their inputs are unchanged."""


@flow(name=FLOW, log_prints=True)
def evaluate(params: EvaluateParams = EvaluateParams()) -> dict[str, Any]:
    """Accuracy of ``params.model`` on each benchmark; returns them with the outputs."""
    with stages.open_flow_run(FLOW, params) as run:
        workspace, refresh, sources = run.workspace, run.refresh, run.sources
        model = sources.model(params.model, params.revision)
        data = {"mmlu": sources.mmlu(params.evaluation.data), "ceval": params.ceval_data, "cmmlu": params.cmmlu_data}
        name = stages.slug(params.model)
        scored = {benchmark: stages.run_eval(workspace, params.evaluation, model, data[benchmark], name,
                                             "evaluate" in refresh, benchmark)
                  for benchmark in params.benchmarks}
        result = {**{b: s.manifest["accuracy"] for b, s in scored.items()},
                  "evaluation": ", ".join(s.path for s in scored.values()), "mlflow_run": run.mlflow_run}
        publish_summary(FLOW, result, run.mlflow_run)
    return result
