"""``llmflow server`` as the tests run it: a real process on free loopback ports, up once it
prints its "Ctrl-C" line, stopped with SIGINT (Ctrl-C) at the end, leaving nothing behind."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from prefect_helpers import output_lines

STARTUP_TIMEOUT_S = 300
# SIGINT (Ctrl-C) must reach the command even when pytest runs with SIGINT ignored (as a
# background job does, and its children with it): un-ignore it, then exec the command.
UNIGNORE_SIGINT_AND_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    """A loopback port free now."""
    return free_ports(1)[0]


def log_tails(workspace: Path) -> str:
    """The end of every service log of a server's workspace."""
    return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}"
                     for log in sorted((workspace / "logs").glob("*.log")))


@dataclass
class Server:
    proc: subprocess.Popen
    workspace: Path
    prefect_port: int
    mlflow_port: int
    lines: list[str]
    """What it printed up to its "Ctrl-C" line."""

    @property
    def url(self) -> str:
        """The Prefect UI (its API is url + /api)."""
        return f"http://127.0.0.1:{self.prefect_port}"

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"


@contextlib.contextmanager
def running_server(workspace: Path, *options: str, unset: tuple[str, ...] = ("PREFECT_", "MLFLOW_")) -> Iterator[Server]:
    """``llmflow server --workspace workspace *options`` until the block ends; the variables
    starting with ``unset`` are removed from its environment (the command points Prefect and
    MLflow at its stores itself: nothing of the test's may win over it)."""
    prefect_port, mlflow_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(unset)}
    env |= {"OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    command = [str(Path(sys.executable).parent / "llmflow"), "server", "--workspace", str(workspace),
               "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port), *options]
    proc = subprocess.Popen([sys.executable, "-c", UNIGNORE_SIGINT_AND_EXEC, *command], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines = output_lines(proc)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not any(line.startswith("Ctrl-C") for line in seen):
            if proc.poll() is not None or time.monotonic() > deadline:
                time.sleep(0.5)
                while not lines.empty():
                    seen.append(lines.get())
                why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not up in {STARTUP_TIMEOUT_S}s"
                pytest.fail(f"llmflow server {why}:\n" + "\n".join(seen) + "\n" + log_tails(workspace), pytrace=False)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        yield Server(proc, workspace, prefect_port, mlflow_port, seen)
    finally:
        # Everything it started: the servers, the worker and any flow run still going.
        family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        survivors = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in survivors:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        assert proc.returncode == 0, f"llmflow server exited with {proc.returncode} on SIGINT"
        assert survivors == [], f"left running after SIGINT: {[' '.join(p.cmdline()) for p in survivors]}"
