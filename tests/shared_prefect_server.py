"""One Prefect API server for a whole test session, shared by its pytest-xdist processes.

An idle Prefect 3.8 server keeps about a tenth of a core busy (its background worker polls
every 250 ms; 5.6-6.0 CPU-s a minute measured), and starting one takes 15-25 s of a core:
one server serves both processes of ``make test``. The first process that needs it starts
it, under a file lock in the session's base temporary directory, which the processes share;
the pytest process that started the others (or the only one, without xdist) stops it when
the session ends. The server is the one ``prefect_test_harness`` runs (the API without the
UI, on SQLite), with its home and database in that directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from filelock import FileLock
from server_process import free_port

STARTUP_TIMEOUT_S = 180.0
"""The server takes 15-25 s to start on a busy two-core machine."""
_RECORD = "prefect-server.json"


def shared_root(config: pytest.Config) -> Path:
    """The session's base temporary directory: the pytest-xdist processes' own are inside it."""
    basetemp = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return basetemp.parent if hasattr(config, "workerinput") else basetemp


def api_url(root: Path) -> str:
    """The API URL of the session's server, started here if no process has started it yet."""
    with FileLock(root / "prefect-server.lock"):
        record = root / _RECORD
        if not record.exists():
            url, pid = _start(root / "prefect-server")
            temporary = record.with_suffix(".tmp")
            temporary.write_text(json.dumps({"api_url": url, "pid": pid}))
            temporary.replace(record)
        return json.loads(record.read_text())["api_url"]


def stop(root: Path) -> None:
    """Stop the session's server, if one was started."""
    record = root / _RECORD
    if not record.exists():
        return
    pid = json.loads(record.read_text())["pid"]
    record.unlink()
    if "prefect.logging.handlers" in sys.modules:  # this process's flow logs still queued: send them first
        from prefect.logging.handlers import APILogWorker

        with contextlib.suppress(Exception):
            APILogWorker.drain_all(timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not _exited(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.1)


def _exited(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):  # another process's child: init reaps it
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _start(home: Path) -> tuple[str, int]:
    import prefect

    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # What prefect_test_harness's server runs with: the API only, the ephemeral services.
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    log = home / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level",
             "error", "--lifespan", "on"],
            env=environment, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return url, process.pid
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the Prefect server did not answer within {STARTUP_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")
