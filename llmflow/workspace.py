"""The workspace: one directory holding a deployment's outputs, Prefect state and MLflow store."""

from __future__ import annotations

import os
from pathlib import Path

WORKSPACE_ENV = "LLMFLOW_WORKSPACE"
"""The workspace of flow runs that are not given one: ``llmflow server`` sets it for its
deployments (as a job variable of each, see deployments/prefect.yaml)."""


def use_workspace(workspace: str | Path) -> Path:
    """Point Prefect (home, result storage, embedded-server start-up time) and MLflow (a SQLite
    store) at ``workspace`` for this process and the ones it starts; returns its absolute path.
    Settings already in the environment win. Call it before Prefect is imported."""
    root = Path(workspace).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    defaults = {
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(root / "prefect" / "results"),
        # The embedded server takes 15-25 s to start on a small machine; Prefect's default is 20 s.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    return root


def flow_workspace(workspace: str | None) -> Path:
    """The workspace of a flow run: ``workspace`` when given, else ``$LLMFLOW_WORKSPACE``.
    There is no default: deployed runs work in the source checkout (LLMFLOW_ROOT), and a
    relative default would write into it."""
    chosen = workspace or os.environ.get(WORKSPACE_ENV)
    if not chosen:
        raise ValueError(f"no workspace: give the flow's workspace parameter or set {WORKSPACE_ENV}")
    return Path(chosen).expanduser().resolve()
