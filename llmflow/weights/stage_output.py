"""The output directory of convert and export, which replaces an earlier run's."""

from __future__ import annotations

from pathlib import Path

from llmflow.artifacts import MANIFEST, read_manifest
from llmflow.weights.errors import CheckpointError


def check_replaceable(out: Path, stage: str) -> None:
    """Refuse to replace ``out`` unless it is absent, empty or an earlier output of ``stage``,
    so that a mistyped path never wipes a training checkpoint or a model."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    manifest = read_manifest(out) if out.is_dir() else None
    if manifest is None or manifest.get("stage") != stage:
        raise CheckpointError(
            f"{out} exists and is not the output of an earlier 'llmflow {stage}' (no {MANIFEST} with "
            f"stage '{stage}'); remove it or choose another output directory"
        )
