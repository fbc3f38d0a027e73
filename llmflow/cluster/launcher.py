"""Where a stage's torchrun workers run: torchrun on this machine (the default, one node or one
node of a multi-node run started on every node), a Slurm job, or a Kubernetes job. Every
launcher streams the workers' output lines to a callback, raises ``WorkerError`` when they
fail, and stops them when the caller is interrupted (a cancelled flow run)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from llmflow.cluster.job import WorkerJob
from llmflow.cluster.kubernetes import KubernetesSettings, run_kubernetes
from llmflow.cluster.nodes import NodeLayout, run_on_this_node
from llmflow.cluster.slurm import SlurmSettings, run_slurm

LAUNCHER_ENV = "LLMFLOW_LAUNCHER"
LAUNCHERS = ("local", "slurm", "kubernetes")


class LaunchSettings(BaseModel):
    """Where the workers of a training stage run."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    launcher: Literal["auto", "local", "slurm", "kubernetes"] = "auto"
    """local: torchrun on this machine; slurm: a Slurm job (sbatch, srun torchrun on every node);
    kubernetes: a gang-scheduled Kubernetes job. auto: the work pool's LLMFLOW_LAUNCHER job
    variable, else local."""
    slurm: SlurmSettings = SlurmSettings()
    """Slurm job settings (launcher slurm)."""
    kubernetes: KubernetesSettings = KubernetesSettings()
    """Kubernetes job settings (launcher kubernetes)."""

    @property
    def engine(self) -> str:
        """The launcher that runs: ``launcher``, with auto resolved from the environment."""
        if self.launcher != "auto":
            return self.launcher
        chosen = os.environ.get(LAUNCHER_ENV, "local") or "local"
        if chosen not in LAUNCHERS:
            raise ValueError(f"{LAUNCHER_ENV}={chosen!r}: expected one of {', '.join(LAUNCHERS)}")
        return chosen

    @property
    def on_this_machine(self) -> bool:
        """Whether the workers run here (their devices are this machine's)."""
        return self.engine == "local"


def node_problems(launch: LaunchSettings, nodes: NodeLayout) -> list[str]:
    """Why ``launch``'s launcher cannot run ``nodes``, if it cannot."""
    engine = launch.engine
    if engine == "local":
        return nodes.torchrun_problems()
    if (nodes.master_addr is not None or nodes.rdzv_endpoint is not None):
        return [(f"launcher {engine} places the nodes itself (the rendezvous is on the first): give nnodes, "
                "not master_addr or rdzv_endpoint")]
    return []


def run_job(job: WorkerJob, launch: LaunchSettings, nodes: NodeLayout, on_line: Callable[[str], None] = print,
            env: dict[str, str] | None = None) -> None:
    """Run ``job`` on ``nodes`` with ``launch``'s launcher, its output lines to ``on_line``; the
    workers' environment adds ``env``. Raises ``WorkerError`` when they fail."""
    problems = node_problems(launch, nodes)
    if problems:
        raise ValueError("; ".join(problems))
    engine = launch.engine
    if engine == "local":
        run_on_this_node(job.module, job.args, job.nproc_per_node, nodes, on_line=on_line, env=env)
    elif engine == "slurm":
        run_slurm(job, nodes.nnodes, launch.slurm, on_line=on_line, env=env or {})
    else:
        run_kubernetes(job, nodes.nnodes, launch.kubernetes, on_line=on_line, env=env or {})
