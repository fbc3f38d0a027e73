"""``llmflow demo``: the finetune-and-eval flow end to end on the built-in sample assets.

Runs on Prefect's embedded server with its database, results and the MLflow store inside
the workspace, so everything the run leaves can be browsed afterwards with
``llmflow server``. Offline; a couple of minutes on two CPU cores. A second run finds every
stage in the cache.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from llmflow.infer.batch import GENERATIONS
from llmflow.workspace import use_workspace

CHANCE = 0.25


class DemoCommand(BaseModel):
    """Run the finetune-and-eval flow on the built-in sample assets (offline, CPU-friendly)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    workspace: Path = Path("workspace")
    """Directory of every output, of the Prefect database and results, and of the MLflow store."""
    version: str = "demo"
    """Version the finetune carries: the same version reuses the cached run, a new one trains again."""

    def cli_cmd(self) -> None:
        run_demo(self)


def run_demo(command: DemoCommand) -> dict:
    """Run ``finetune_eval`` with its defaults in ``command.workspace``; print and return its result."""
    workspace = use_workspace(command.workspace)
    from llmflow.flows.finetune_eval import finetune_eval

    start = time.monotonic()
    result = finetune_eval(workspace=str(workspace), version=command.version)
    before, after = result["mmlu_before"], result["mmlu_after"]
    print(f"\nfinetune-eval finished in {time.monotonic() - start:.0f} s")
    print(f"MMLU-style accuracy on the sample set (chance {CHANCE:.0%}): before {before:.1%}, after {after:.1%}")
    if result["answers"]:
        print("the finetuned model's answers (greedy):")
        for line in (Path(result["answers"]) / GENERATIONS).read_text().splitlines():
            answer = json.loads(line)
            print(f"  {answer['prompt']} -> {answer['output']}")
    print(f"finetuned checkpoint: {result['checkpoint']}")
    print(f"exported model (Hugging Face format): {result['model']}")
    if result["registered"]:
        print(f"MLflow registered model: {result['registered']['name']} version {result['registered']['version']}")
    elif result["gate"]:
        print(f"not registered in MLflow: {result['gate']['reason']}")
    print(f"Prefect and MLflow UIs for these runs: llmflow server --workspace {command.workspace}")
    return result
