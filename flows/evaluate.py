"""The evaluate flow: a model (hub, local directory, training checkpoint) on MMLU and,
when asked, any other benchmark ``llmflow eval`` runs, under the evaluation's chat settings."""

from __future__ import annotations

from typing import Any

from prefect import flow

from llmflow.flows import stages
from llmflow.flows.params import EvaluateParams, flow_parameters
from llmflow.flows.summary import publish_summary

FLOW = "evaluate"


@flow(name=FLOW, log_prints=True)
@flow_parameters(EvaluateParams)
def evaluate(params: EvaluateParams) -> dict[str, Any]:
    """Accuracy of ``params.model`` on each benchmark; returns them with the outputs."""
    with stages.open_flow_run(FLOW, params) as run:
        model = run.sources.model(params.model, params.revision)
        scored = stages.run_benchmarks(run, params.evaluation, params.benchmark_data, params.benchmarks, model,
                                       stages.slug(params.model))
        result = {**{b: s.manifest["accuracy"] for b, s in scored.items()},
                  "evaluation": ", ".join(s.path for s in scored.values()), "mlflow_run": run.mlflow_run}
        publish_summary(FLOW, result, run.mlflow_run)
    return result
