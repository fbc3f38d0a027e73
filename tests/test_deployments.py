"""The deployments as ``llmflow server`` applies them, on the session's Prefect server: every
flow parameter is top-level, so a run that overrides one nested setting keeps the rest of the
deployment's parameters (its workspace above all); the run form documents every parameter;
a run given no workspace takes the deployment's from the environment and never writes into
the directory it runs in; each flow tracks into an MLflow experiment of its own."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from llmflow.flows.evaluate import evaluate
from llmflow.flows.finetune_eval import finetune_eval
from llmflow.flows.params import (
    EvaluateParams,
    FinetuneEvalParams,
    PrecisionParams,
    PretrainParams,
    TrainParams,
)
from llmflow.flows.precision import precision
from llmflow.flows.pretrain import pretrain
from llmflow.workspace import WORKSPACE_ENV

FLOWS = {"finetune-eval": (finetune_eval, FinetuneEvalParams), "pretrain": (pretrain, PretrainParams),
         "evaluate": (evaluate, EvaluateParams), "precision": (precision, PrecisionParams)}


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", FLOWS)
def test_every_flow_parameter_is_top_level_and_documented_in_the_run_form(name):
    flow, model = FLOWS[name]
    schema = flow.parameters.model_dump_for_openapi()
    assert list(schema["properties"]) == list(model.model_fields)
    for field, prop in schema["properties"].items():
        assert prop["description"] == one_line(model.model_fields[field].description), field
    if "train" in schema["properties"]:
        steps = schema["definitions"]["TrainParams"]["properties"]["steps"]
        assert steps["description"] == TrainParams.model_fields["steps"].description
        assert steps["minimum"] == 1 and schema["properties"]["train"]["$ref"] == "#/definitions/TrainParams"


@pytest.mark.slow
def test_a_deployment_run_with_one_nested_override_keeps_every_other_deployment_value(prefect_env, prefect_server,
                                                                                       tmp_path):
    import os

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    from llmflow.server import ROOT, apply_deployments

    workspace = tmp_path / "ws"
    env = {**os.environ, **{setting.name: str(value) for setting, value in prefect_server.settings.items()},
           "LLMFLOW_ROOT": str(ROOT), WORKSPACE_ENV: str(workspace), "LLMFLOW_TIMEZONE": "UTC"}
    apply_deployments(env)

    with get_client(sync_client=True) as client:
        for name in ("finetune-eval/nightly", "finetune-eval/on-demand", "pretrain/on-demand", "evaluate/on-demand",
                     "precision/on-demand"):
            deployment = client.read_deployment_by_name(name)
            assert deployment.parameters == {"workspace": str(workspace)}, name
            assert deployment.job_variables["env"] == {WORKSPACE_ENV: str(workspace)}, name
        deployment = client.read_deployment_by_name("finetune-eval/on-demand")
        # The deployment's parameters as a user sets them in the UI's "Edit" form.
        settings = {"workspace": str(workspace), "version": "v7", "evaluation": {"limit": 8, "shots": 2},
                    "train": {"steps": 8, "save_interval": 4}, "register_min_gain": 0.01}
        client.update_deployment(deployment.id, DeploymentUpdate(parameters=settings))

        # What `prefect deployment run finetune-eval/on-demand --params '{"train": {"steps": 3}}'` sends.
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"train": {"steps": 3}})
        assert run.parameters == settings | {"train": {"steps": 3}}
        # The merged parameters are what the flow accepts: only the train settings changed.
        validated = finetune_eval.validate_parameters(run.parameters)
        assert validated["workspace"] == str(workspace) and validated["version"] == "v7"
        assert validated["train"] == TrainParams(steps=3) and validated["evaluation"].shots == 2

        evaluated = client.create_flow_run_from_deployment(
            client.read_deployment_by_name("evaluate/on-demand").id, parameters={"evaluation": {"limit": 2}})
        assert evaluated.parameters == {"workspace": str(workspace), "evaluation": {"limit": 2}}


@pytest.mark.slow
def test_a_flow_run_given_no_workspace_takes_the_environments_and_never_defaults(prefect_env, tmp_path,
                                                                                 monkeypatch):
    from llmflow.flows import stages

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    state = evaluate(model=str(tmp_path / "nowhere"), return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=f"no workspace: give the flow's workspace parameter or set {WORKSPACE_ENV}"):
        state.result()
    assert list(tmp_path.iterdir()) == []

    # Each flow tracks into its own experiment (the tests' own one is set by the environment).
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    monkeypatch.setenv(WORKSPACE_ENV, str(tmp_path / "ws"))
    client = MlflowClient(prefect_env["mlflow_uri"])
    for flow, params in (("evaluate", EvaluateParams()), ("precision", PrecisionParams())):
        with stages.open_flow_run(flow, params) as run:
            assert run.workspace == tmp_path / "ws"
        experiment = client.get_experiment(client.get_run(run.mlflow_run).info.experiment_id)
        assert experiment.name == f"llmflow-{flow}"
        assert client.get_run(run.mlflow_run).data.params["workspace"] == str(tmp_path / "ws")


def test_training_settings_are_train_configs_own():
    """The flows' training settings are TrainConfig's fields: the same types, constraints and
    help text, only the defaults are the flows' own."""
    from llmflow.train.config import TrainConfig

    for name, field in TrainParams.model_fields.items():
        if name in ("nproc", "nnodes"):  # where the workers run: not a setting of the training itself
            continue
        theirs = TrainConfig.model_fields[name]
        assert (field.description, field.annotation, field.metadata) == (theirs.description, theirs.annotation,
                                                                         theirs.metadata), name


def test_refresh_names_the_stages_the_ui_shows():
    """Every name ``refresh`` accepts is a stage task's name, and every stage can be named."""
    import typing

    from prefect import Task

    from llmflow.flows.params import Stage
    from llmflow.tasks import convert, download, evaluate, export, infer, probe, register, sample, tokenize, train

    modules = (convert, download, evaluate, export, infer, probe, register, sample, tokenize, train)
    tasks = {t.name for m in modules for t in vars(m).values() if isinstance(t, Task)}
    tasks |= {t.name for t in evaluate.EVAL_TASKS.values()}
    assert set(typing.get_args(Stage)) == tasks
    with pytest.raises(ValueError, match="'tokenize-instruction'"):
        FinetuneEvalParams(refresh=["tokenize"])
