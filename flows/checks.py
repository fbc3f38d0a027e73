"""Checks a flow makes before its expensive stages."""

from __future__ import annotations

from pathlib import Path

from llmflow.flows.params import TrainParams
from llmflow.mesh import LayoutError, ParallelLayout, validate_layout
from llmflow.model_loading import hf_config_of
from llmflow.models import ModelConfig
from llmflow.train.preflight import pipeline_problems


def check_layout(model_dir: Path, train: TrainParams) -> None:
    """Raise LayoutError when the model's heads or FFN width do not split ``train.tp`` ways or
    its layers do not split into ``train``'s pipeline stages (the device count was checked
    with the parameters)."""
    config = ModelConfig.from_hf(hf_config_of(model_dir))
    layout = ParallelLayout.of_world(train.nproc, train.pp, train.tp)
    validate_layout(layout, train.nproc, config)
    problems = pipeline_problems(train, layout.dp, config.num_hidden_layers)
    if problems:
        raise LayoutError("impossible parallel layout: " + "; ".join(problems))
