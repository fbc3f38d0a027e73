"""Checks a flow makes before its expensive stages."""

from __future__ import annotations

from pathlib import Path

from llmflow.cluster.launcher import LaunchSettings, node_problems
from llmflow.cluster.nodes import NodeLayout
from llmflow.flows.params import TrainParams
from llmflow.mesh import LayoutError, ParallelLayout, validate_layout
from llmflow.models import ModelConfig
from llmflow.models.context_parallel import context_parallel_problems
from llmflow.train.preflight import device_problems, pipeline_problems
from llmflow.weights import hf_config_of


def check_layout(model_dir: Path, train: TrainParams, launch: LaunchSettings | None = None) -> None:
    """Raise LayoutError when the model's heads or FFN width do not split ``train.tp`` ways (its
    heads per tensor-parallel rank ``train.cp`` ways), its
    layers do not split into ``train``'s pipeline stages, or ``launch``'s launcher cannot place
    the job (more nodes than torchrun here can run, or more workers than this machine's
    devices when they run here)."""
    launch = launch or LaunchSettings()
    config = ModelConfig.from_hf(hf_config_of(model_dir))
    layout = ParallelLayout.of_world(train.world_size, train.pp, train.tp, cp=train.cp)
    validate_layout(layout, train.world_size, config)
    problems = context_parallel_problems(config, train.cp, tp=train.tp, algo=train.cp_algo)
    problems += pipeline_problems(train, layout.dp, config.num_hidden_layers)
    problems += node_problems(launch, NodeLayout(nnodes=train.nnodes))
    if launch.on_this_machine:
        problems += device_problems(train.nproc)
    if problems:
        raise LayoutError("impossible parallel layout: " + "; ".join(problems))
