"""``llmflow server``: the Prefect server, a worker for llmflow's process pool, the
deployments of ``deployments/prefect.yaml`` and the MLflow UI, all on loopback, until Ctrl-C.

Flow runs started from the UI or by the nightly schedule run in the worker, with the
workspace's result storage and the MLflow server as their tracking store. The servers keep
their state in SQLite files in the workspace, or in PostgreSQL (``--database``), with MLflow's
artifacts in the workspace, a shared directory or an object store (``--artifact-root``): see
llmflow/stores.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from llmflow.launch import kill_group
from llmflow.stores import prepare, resolve
from llmflow.workspace import WORKSPACE_ENV, use_workspace

ROOT = Path(__file__).resolve().parent.parent
POOL = "llmflow"


class ServerCommand(BaseModel):
    """Start the Prefect server and UI, a worker, llmflow's deployments and the MLflow UI."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    workspace: Path = Path("workspace")
    """Directory of the flows' outputs and Prefect's results, and (without --database) of the Prefect
    and MLflow databases and (without --artifact-root) MLflow's artifacts."""
    host: str = "127.0.0.1"
    """Address the servers listen on (loopback by default: nothing is exposed)."""
    prefect_port: int = Field(default=4200, ge=1, le=65535)
    """Port of the Prefect API and UI."""
    mlflow_port: int = Field(default=5000, ge=1, le=65535)
    """Port of the MLflow tracking server and UI."""
    timezone: str = "UTC"
    """Timezone of the nightly schedule (an IANA name such as Asia/Shanghai)."""
    database: str | None = None
    """PostgreSQL for both servers instead of SQLite files in the workspace:
    postgresql://USER:PASSWORD@HOST:PORT/DATABASE (percent-encode special characters; TLS through
    PGSSLMODE). Prefect uses DATABASE, MLflow DATABASE_mlflow on the same server, created when
    missing if USER may create databases. Both must be usable by USER (its owner)."""
    mlflow_database: str | None = None
    """MLflow's PostgreSQL database, when not DATABASE_mlflow beside --database's:
    postgresql://USER:PASSWORD@HOST:PORT/NAME (never Prefect's own database)."""
    artifact_root: str | None = None
    """Where MLflow keeps run artifacts (models, plots): a directory (on a cluster, one only the
    MLflow server's machine needs), or s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (credentials and
    the client library where the MLflow server runs). Clients upload through the MLflow server.
    Default: WORKSPACE/mlartifacts."""

    def cli_cmd(self) -> None:
        serve(self)


def wait_until_up(url: str, what: str, procs: list[subprocess.Popen], timeout_s: float = 180) -> None:
    """Poll ``url`` until it answers 200; fail early when a process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: {' '.join(dead[0].args)} exited with {dead[0].returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer at {url} within {timeout_s:.0f} s")


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A service in its own process group (so it is stopped with its children), logging to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def run_quietly(args: list[str], env: dict[str, str]) -> None:
    """Run a set-up command; its output is shown only when it fails."""
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")


def apply_deployments(env: dict[str, str]) -> None:
    """Create llmflow's process work pool and apply ``deployments/prefect.yaml`` on the Prefect
    server of ``env`` (PREFECT_API_URL), which also holds the variables the file reads:
    LLMFLOW_ROOT, LLMFLOW_WORKSPACE and LLMFLOW_TIMEZONE."""
    prefect = [str(Path(sys.executable).parent / "prefect"), "--no-prompt"]
    run_quietly([*prefect, "work-pool", "create", POOL, "--type", "process", "--overwrite"], env)
    run_quietly([*prefect, "deploy", "--all", "--prefect-file", str(ROOT / "deployments" / "prefect.yaml")], env)


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def serve(command: ServerCommand) -> None:
    """Start everything, print the URLs, and stop everything on Ctrl-C (or SIGTERM)."""
    # The stores first: a malformed or unreachable one is reported before anything starts.
    stores = resolve(Path(command.workspace).expanduser().resolve(), command.database, command.mlflow_database,
                     command.artifact_root)
    prepared = prepare(stores)
    workspace = use_workspace(command.workspace)
    logs = workspace / "logs"
    logs.mkdir(exist_ok=True)
    bin_dir = Path(sys.executable).parent
    prefect_api = f"http://{command.host}:{command.prefect_port}/api"
    mlflow_url = f"http://{command.host}:{command.mlflow_port}"
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_SERVER_API_HOST": command.host,
        "PREFECT_SERVER_API_PORT": str(command.prefect_port),
        "MLFLOW_TRACKING_URI": mlflow_url,
        # The MLflow server's background job runner alone costs ~2 GB.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "LLMFLOW_ROOT": str(ROOT),
        WORKSPACE_ENV: str(workspace),
        "LLMFLOW_TIMEZONE": command.timezone,
    }
    # Each server alone gets its database's URL (password included), in its environment: not
    # on a command line that a process listing shows, not in the worker's and flow runs'.
    prefect_env = {k: v for k, v in env.items() if not (stores.prefect and k.endswith("_DATABASE_CONNECTION_URL"))}
    prefect_env |= stores.prefect_env()
    mlflow_env = {**env, "MLFLOW_BACKEND_STORE_URI": stores.mlflow_backend()}
    procs: list[subprocess.Popen] = []
    # Both, explicitly: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        procs.append(start([str(bin_dir / "prefect"), "server", "start", "--host", command.host,
                            "--port", str(command.prefect_port)], prefect_env, logs / "prefect-server.log"))
        procs.append(start([str(bin_dir / "mlflow"), "server", "--host", command.host, "--port", str(command.mlflow_port),
                            "--workers", "1", "--artifacts-destination", stores.artifacts], mlflow_env,
                           logs / "mlflow.log"))
        wait_until_up(f"{prefect_api}/health", "the Prefect server", procs)
        apply_deployments(env)
        procs.append(start([str(bin_dir / "prefect"), "--no-prompt", "worker", "start", "--pool", POOL, "--type", "process"],
                           env, logs / "worker.log"))
        wait_until_up(f"{mlflow_url}/health", "the MLflow server", procs)
        print(f"Prefect UI:  http://{command.host}:{command.prefect_port} (deployments: nightly and on-demand "
              f"finetune-eval, on-demand pretrain and evaluate)")
        print(f"MLflow UI:   {mlflow_url}")
        for what, where in stores.describe():
            print(f"{what + ':':<12} {where}")
        for line in prepared:
            print(f"             ({line})")
        print(f"workspace:   {workspace} (logs in {logs})")
        print("Ctrl-C stops the servers and the worker.", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(1)
        dead = next(p for p in procs if p.poll() is not None)
        raise RuntimeError(f"{' '.join(dead.args)} exited with {dead.returncode}; see {logs}")
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        for proc in reversed(procs):
            kill_group(proc, grace_s=10)
