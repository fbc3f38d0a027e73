"""``llmflow train CONFIG.yaml [--nproc N] [key=value ...]``: validate the config here,
then run it on ``nproc`` torchrun workers, tracked in MLflow as the flows' training is."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import CliPositionalArg

from llmflow import tracking
from llmflow.launch import run_workers, torchrun_command
from llmflow.train.config import TrainConfig, load_train_config
from llmflow.train.preflight import check_training, record_run


def launch_training(config: TrainConfig, nproc: int, on_line=print, env: dict[str, str] | None = None) -> Path:
    """Write the resolved config into the run directory and run it on ``nproc`` workers
    (whose environment adds ``env``); returns the run (checkpoint) directory. Callers run
    ``check_training`` first, before they open anything (an MLflow run, the run directory)."""
    config_path = record_run(config)
    run_workers(torchrun_command("llmflow.train", [str(config_path)], nproc), on_line=on_line, env=env)
    return Path(config.out)


class TrainCommand(BaseModel):
    """Pretrain or finetune (full or LoRA) on torchrun workers; resumes when the run's
    output directory holds a checkpoint."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    config: CliPositionalArg[Path]
    """Training config (YAML or JSON); see TrainConfig for every option."""
    overrides: CliPositionalArg[list[str]] = Field(default_factory=list)
    """key=value overrides of the config (dotted for sections: optim.lr=1e-4 data.paths='[a,b]')."""
    nproc: int = Field(default=1, ge=1)
    """Worker processes on this machine (one per accelerator; CPU runs use gloo)."""
    workspace: Path = Path("workspace")
    """Workspace whose MLflow store (workspace/mlflow.db, the one the flows and llmflow server
    use) records the run: its config and step metrics, in the experiment llmflow-train.
    MLFLOW_TRACKING_URI, when set, names the store instead."""

    def cli_cmd(self) -> None:
        config = load_train_config(self.config, self.overrides)
        check_training(config, self.nproc)
        tracking.configure(self.workspace, tracking.experiment_name("train"))
        with tracking.stage_run("train", config.model_dump(mode="json") | {"nproc": self.nproc}) as run_id:
            launch_training(config, self.nproc, env=tracking.worker_env(run_id))
