"""Checks a flow makes before its expensive stages."""

from __future__ import annotations

from pathlib import Path

from llmflow.flows.params import TrainParams
from llmflow.mesh import ParallelLayout, validate_layout
from llmflow.model_loading import hf_config_of
from llmflow.models import ModelConfig


def check_layout(model_dir: Path, train: TrainParams) -> None:
    """Raise LayoutError when the model's heads or FFN width do not split ``train.tp`` ways
    (the device count was checked with the parameters)."""
    config = ModelConfig.from_hf(hf_config_of(model_dir))
    layout = ParallelLayout(dp=train.nproc // train.tp, tp=train.tp)
    validate_layout(layout, train.nproc, config)
