"""Precision debugging in msprobe's formats: deterministic mode, dumps of training steps,
and the comparison of two dumps with an advisor that names the first divergence."""

from llmflow.probe.dump.config import ProbeConfig, load_probe_config
from llmflow.probe.dump.determinism import seed_all
from llmflow.probe.dump.dumper import Dumper, PipelinePlace

__all__ = ["Dumper", "PipelinePlace", "ProbeConfig", "load_probe_config", "seed_all"]
