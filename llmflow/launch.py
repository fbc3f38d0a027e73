"""Starting worker processes (``torchrun``, ``kubectl logs``) and watching them.

The workers run in their own process group: when the caller is cancelled or fails, the
whole group is terminated (SIGTERM, then SIGKILL after a grace period), so no rank
outlives the stage. Every output line is handed to a callback as it arrives (the Prefect
log, or the terminal), and the last lines are kept to quote when a worker fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

_TORCHRUN_REPORT = re.compile(r"torch/distributed/elastic/.*\] failed \(exitcode")


class WorkerError(RuntimeError):
    """torchrun workers exited with an error; the message quotes their last output lines."""

    def __init__(self, returncode: int, tail: list[str]) -> None:
        self.returncode = returncode
        self.tail = tail
        # What follows torchrun's "failed (exitcode ...)" line is its own report of the exit codes.
        workers = list(itertools.takewhile(lambda line: not _TORCHRUN_REPORT.search(line), tail))
        error_lines = [line for line in workers if "Error" in line or "error" in line] or workers or tail
        quoted = error_lines[-20:]
        super().__init__(f"workers exited with code {returncode}; last output:" + ("\n" if len(quoted) > 1 else " ") + "\n".join(quoted))


def run_workers(
    cmd: Sequence[str],
    on_line: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    grace_s: float = 10.0,
    tail_lines: int = 50,
) -> None:
    """Run ``cmd`` in a new process group, streaming its merged output line by line to
    ``on_line``; raise ``WorkerError`` on a non-zero exit. If this function is interrupted
    (cancellation, KeyboardInterrupt, a failing callback), the whole group is killed."""
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONUNBUFFERED"] = "1"
    tail: deque[str] = deque(maxlen=tail_lines)
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env,
        cwd=cwd,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
        returncode = proc.wait()
    except BaseException:
        kill_group(proc, grace_s)
        raise
    if returncode != 0:
        raise WorkerError(returncode, list(tail))


def kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it if still alive after ``grace_s``; then
    SIGKILL whatever descendant of ``proc`` still runs: torchrun starts each worker in a session
    of its own, out of reach of a signal to ``proc``'s group, and a worker orphaned by a killed
    torchrun would otherwise go on training and writing checkpoints."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
