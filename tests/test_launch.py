"""Launching workers: an interrupted launch leaves no worker behind, even one that ignores
SIGTERM in a session of its own (as torchrun starts each worker)."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from llmflow.launch import run_workers

WORKER = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"worker {os.getpid()}", flush=True)
time.sleep(600)
"""


class Interrupted(Exception):
    pass


@pytest.mark.slow
def test_an_interrupted_launch_kills_a_worker_that_ignores_sigterm(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(WORKER)
    workers: list[int] = []

    def on_line(line: str) -> None:
        if line.startswith("worker "):
            workers.append(int(line.split()[1]))
            raise Interrupted

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script)]
    with pytest.raises(Interrupted):
        run_workers(command, on_line=on_line, env={"OMP_NUM_THREADS": "1"}, grace_s=2)
    (pid,) = workers
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

