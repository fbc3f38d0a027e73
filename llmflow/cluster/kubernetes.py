"""PLACEHOLDER: filled in by the Kubernetes launcher work."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict


class KubernetesSettings(BaseModel):
    """Kubernetes job settings."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    namespace: str = "default"
    """Namespace of the job."""


def run_kubernetes(job, nnodes: int, settings: KubernetesSettings, on_line: Callable[[str], None],
                   env: dict[str, str]) -> None:
    raise NotImplementedError
