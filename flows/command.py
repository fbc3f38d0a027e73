"""``llmflow flow``: run one of llmflow's flows from the command line, in this process.

Each subcommand's options are the flow's parameter model, the one the Prefect UI builds the
deployment's run form from, so ``llmflow flow finetune-eval --help`` and the form say the
same (nested settings are dotted: ``--train.ep 2``, ``--evaluation.limit 8``). As with
``llmflow demo``, Prefect's state and results and the MLflow store live in the workspace
(``--workspace``, else $LLMFLOW_WORKSPACE, else ./workspace) unless the environment points
Prefect at a server (PREFECT_API_URL) or MLflow at a store (MLFLOW_TRACKING_URI): a run
started here is retried, cached and browsed (``llmflow server --workspace ...``) like one
started from the UI. The flow's result is printed as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict
from pydantic_settings import CliApp, CliSubCommand

from llmflow.flows.params import EvaluateParams, FinetuneEvalParams, Params, PrecisionParams, PretrainParams
from llmflow.workspace import WORKSPACE_ENV, use_workspace

DEFAULT_WORKSPACE = "workspace"


def run_flow(target: str, params: Params) -> dict[str, Any]:
    """Run the flow ``target`` ("module:function") with ``params`` in their workspace; print
    and return its result."""
    workspace = use_workspace(getattr(params, "workspace", None) or os.environ.get(WORKSPACE_ENV) or DEFAULT_WORKSPACE)
    module, name = target.split(":")
    flow = getattr(importlib.import_module(module), name)  # imports Prefect: after use_workspace
    result = flow(**(dict(params) | {"workspace": str(workspace)}))
    print(json.dumps(result, indent=2, default=str))
    return result


class FlowCommand:
    """A subcommand whose options are a flow's parameters: it runs the flow ``flow`` names."""

    flow: ClassVar[str]
    """The flow, as "module:function"."""

    def cli_cmd(self) -> None:
        run_flow(self.flow, self)


class FinetuneEvalCommand(FlowCommand, FinetuneEvalParams):
    """Finetune a model on instruction data and score it before and after (the finetune-eval flow)."""

    flow: ClassVar[str] = "llmflow.flows.finetune_eval:finetune_eval"


class PretrainCommand(FlowCommand, PretrainParams):
    """Pretrain a model on raw text, export it and score it on MMLU (the pretrain flow)."""

    flow: ClassVar[str] = "llmflow.flows.pretrain:pretrain"


class EvaluateCommand(FlowCommand, EvaluateParams):
    """Evaluate one model on multiple-choice benchmarks (the evaluate flow)."""

    flow: ClassVar[str] = "llmflow.flows.evaluate:evaluate"


class PrecisionCommand(FlowCommand, PrecisionParams):
    """Dump a few training steps in two configurations and find where they diverge (the precision flow)."""

    flow: ClassVar[str] = "llmflow.flows.precision:precision"


class FlowCommands(BaseModel):
    """Run a flow here, its parameters the options (the Prefect UI form's fields)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    finetune_eval: CliSubCommand[FinetuneEvalCommand]
    """Finetune a model on instruction data and score it before and after."""
    pretrain: CliSubCommand[PretrainCommand]
    """Pretrain a model on raw text, export it and score it on MMLU."""
    evaluate: CliSubCommand[EvaluateCommand]
    """Evaluate one model on multiple-choice benchmarks."""
    precision: CliSubCommand[PrecisionCommand]
    """Dump training steps in two configurations and find where they diverge."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
