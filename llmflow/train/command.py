"""``llmflow train CONFIG.yaml [--nproc N] [--nnodes M ...] [key=value ...]``: validate the
config here, then run it on ``nproc`` torchrun workers per node (here, or as a Slurm or
Kubernetes job), tracked in MLflow as the flows' training is."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field
from pydantic_settings import CliPositionalArg, CliUnknownArgs

from llmflow import tracking
from llmflow.cluster.kubernetes import KubernetesSettings
from llmflow.cluster.launcher import LaunchSettings, WorkerJob, node_problems, run_job
from llmflow.cluster.nodes import NodeLayout
from llmflow.cluster.slurm import SlurmSettings
from llmflow.train.config import TrainConfig, load_train_config
from llmflow.train.preflight import check_training, record_run


def launch_training(config: TrainConfig, nproc: int, on_line=print, env: dict[str, str] | None = None,
                    launch: LaunchSettings | None = None, nodes: NodeLayout | None = None,
                    module: str = "llmflow.train") -> Path:
    """Write the resolved config into the run directory and run it on ``nproc`` workers per
    node of ``nodes`` with ``launch``'s launcher (default: this machine alone); the workers'
    environment adds ``env``. ``module`` is the worker: the training loop, or
    ``llmflow.train.reference_worker`` for a DPO run's reference log-probs alone. Returns the run
    (checkpoint) directory. Callers run ``check_training`` first, before they open anything
    (an MLflow run, the run directory)."""
    config_path = record_run(config)
    out = Path(config.out)
    job = WorkerJob(name=f"llmflow-{module.rsplit('.', 1)[-1]}-{out.name}", module=module, args=(str(config_path),),
                    nproc_per_node=nproc, workdir=out)
    run_job(job, launch or LaunchSettings(launcher="local"), nodes or NodeLayout(), on_line=on_line, env=env)
    return out


class TrainCommand(NodeLayout):
    """Pretrain or finetune (full or LoRA) on torchrun workers; resumes when the run's
    output directory holds a checkpoint. On several nodes, run the same command on each node
    (with its own --node-rank, or the same --rdzv-endpoint), or once with --launcher slurm.

    key=value arguments after CONFIG override its options, values read as YAML, dotted keys
    for sections: optim.lr=1e-4 data.paths='[a,b]' num_layer_list='[3,1]'."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    config: CliPositionalArg[Path]
    """Training config (YAML or JSON); see TrainConfig for every option."""
    # Captured verbatim: a list positional would be split at its commas ([a,b] -> "[a", "b]").
    overrides: CliUnknownArgs
    """key=value overrides of the config (dotted for sections: optim.lr=1e-4 data.paths='[a,b]')."""
    nproc: int = Field(default=1, ge=1)
    """Worker processes per node (one per accelerator; CPU runs use gloo)."""
    launcher: Literal["local", "slurm", "kubernetes"] = "local"
    """local: torchrun here (one node, or this node of a multi-node run); slurm or kubernetes:
    submit the run as a job of --nnodes nodes."""
    slurm: SlurmSettings = SlurmSettings()
    """Slurm job settings (--launcher slurm)."""
    kubernetes: KubernetesSettings = KubernetesSettings()
    """Kubernetes job settings (--launcher kubernetes)."""
    workspace: Path = Path("workspace")
    """Workspace whose MLflow store (workspace/mlflow.db, the one the flows and llmflow server
    use) records the run: its config and step metrics, in the experiment llmflow-train.
    MLFLOW_TRACKING_URI, when set, names the store instead. With a static master, node 0
    records the run and the other nodes record nothing."""

    def cli_cmd(self) -> None:
        options = [item for item in self.overrides if item.startswith("-")]
        if options:
            raise ValueError(f"unknown option {options[0]} (llmflow train --help lists the options)")
        config = load_train_config(self.config, self.overrides)
        launch = LaunchSettings(launcher=self.launcher, slurm=self.slurm, kubernetes=self.kubernetes)
        nodes: NodeLayout = self  # the command is its own node layout
        problems = node_problems(launch, nodes)
        if problems:
            raise SystemExit("; ".join(problems))
        check_training(config, self.nproc, nnodes=self.nnodes, local=launch.on_this_machine)
        if not self.leads:
            launch_training(config, self.nproc, launch=launch, nodes=nodes)
            return
        tracking.configure(self.workspace, tracking.experiment_name("train"))
        params = config.model_dump(mode="json") | {"nproc": self.nproc, "nnodes": self.nnodes}
        with tracking.stage_run("train", params) as run_id:
            launch_training(config, self.nproc, env=tracking.worker_env(run_id), launch=launch, nodes=nodes)
