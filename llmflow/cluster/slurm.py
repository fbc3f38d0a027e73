"""A stage's workers as a Slurm batch job: one ``srun`` task per node, each a torchrun agent
meeting the others at a c10d rendezvous on the job's first node.

``run_slurm`` writes the job script into the run's directory (storage every node shares),
submits it with ``sbatch``, streams the job's output file to a callback as it grows and
follows the job's state with ``scontrol`` (``sacct`` once the controller has forgotten the
job). A job that ends in any state but COMPLETED raises ``SlurmJobError`` (a
``WorkerError``) naming the job, its state and its last output lines. When the caller is
interrupted (a cancelled flow run, Ctrl-C, a failing callback) the job is cancelled with
``scancel`` before the interruption goes on.

The cluster is the one the Slurm commands find by themselves: ``SLURM_CONF`` in the
environment, else the system's slurm.conf.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmflow.cluster.job import WorkerJob
from llmflow.launch import WorkerError

COMMANDS = ("sbatch", "scontrol", "scancel")
"""The Slurm client commands the launcher runs (sacct too, when it is there)."""
SCRIPT_NAME = "llmflow-job.sbatch"
"""The job script's name in the job's work directory."""
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                           "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
                           "RESV_DEL_HOLD", "SPECIAL_EXIT"})
"""Job states that are not final (the job may still run, or run again)."""
CANCEL_WAIT_S = 25.0
"""How long a cancelled job is waited for, to end, before the interruption goes on (a retry
started at once would otherwise meet workers of the old job still writing checkpoints)."""
FORGOTTEN_GRACE_S = 300.0
"""How long the job state may be unreadable (a restarting controller) before the launcher gives up."""
OUTPUT_SETTLE_S = 2.0
"""After the job ends, its output file is read until it has not grown for this long (at most;
one poll interval when that is shorter): shared storage can show the last writes late."""
STALE_OUTPUT_S = 60.0
"""An output file last written this long before its job was submitted is another job's."""
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SlurmSettings(BaseModel):
    """Slurm job settings: what the job asks the scheduler for, beyond ``--nodes`` (the run's
    node count) and one task per node (torchrun, which starts the node's worker processes)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    partition: str | None = None
    """Partition (queue) of the job (sbatch --partition); the cluster's default when not given."""
    account: str | None = None
    """Account the job is charged to (sbatch --account); the user's default when not given."""
    qos: str | None = None
    """Quality of service of the job (sbatch --qos); the default of the account or partition when not given."""
    time: str | None = None
    """Time limit of the job (sbatch --time: minutes, HH:MM:SS or D-HH:MM:SS); the partition's
    default when not given. A run stopped by its limit resumes from its last checkpoint when retried."""
    gpus_per_node: int | None = Field(default=None, ge=1)
    """GPUs on each node (sbatch --gpus-per-node), usually nproc; for accelerators that are not
    Slurm GPUs (Ascend NPUs), use gres."""
    gres: str | None = None
    """Generic resources on each node (sbatch --gres), such as gpu:8 or npu:8."""
    cpus_per_task: int | None = Field(default=None, ge=1)
    """CPUs on each node for its torchrun task, which runs all nproc workers of the node
    (sbatch --cpus-per-task); the cluster's default (often 1) when not given."""
    mem: str | None = None
    """Memory on each node (sbatch --mem: 500G; 0 for all of the node's memory); the
    cluster's default when not given."""
    sbatch_options: list[str] = Field(default_factory=list)
    """Further sbatch options, one per item, written as #SBATCH lines (--exclusive,
    --constraint=a100, --reservation=r1)."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines the job script runs on the first node before starting the workers
    (module load ..., export NCCL_SOCKET_IFNAME=ib0); srun passes the environment they set to
    every node."""
    rdzv_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of the workers' c10d rendezvous on the job's first node; when not given, a port
    free on that node when the job starts (give one where only some ports are open between nodes)."""
    poll_s: float = Field(default=5.0, gt=0)
    """Seconds between two queries of the job's state (the output file is read more often)."""

    @field_validator("sbatch_options")
    @classmethod
    def _options(cls, options: list[str]) -> list[str]:
        for option in options:
            if not option.startswith("-") or "\n" in option:
                raise ValueError(f"sbatch option {option!r}: expected one option such as --exclusive or --constraint=a100")
        return options

    @field_validator("setup")
    @classmethod
    def _setup(cls, lines: list[str]) -> list[str]:
        if any("\n" in line for line in lines):
            raise ValueError("setup: give one shell line per item")
        return lines


class SlurmJobError(WorkerError):
    """A Slurm job of workers ended in a state other than COMPLETED; the message names the job
    and its state and quotes the job's last output lines."""

    def __init__(self, job_id: str, state: str, reason: str, returncode: int, tail: list[str]) -> None:
        super().__init__(returncode, tail)
        self.job_id = job_id
        self.state = state
        self.reason = reason
        because = f" ({reason})" if reason and reason != "None" else ""
        self.args = (f"Slurm job {job_id} ended {state}{because}: {self.args[0]}",)


def job_script(job: WorkerJob, nnodes: int, settings: SlurmSettings, env: dict[str, str]) -> str:
    """The sbatch script of ``job`` on ``nnodes`` nodes: its #SBATCH lines, then ``env``
    exported and ``srun`` of one torchrun agent per node."""
    for name in env:
        if not _ENV_NAME.match(name):
            raise ValueError(f"environment variable name {name!r} is not a shell identifier")
    workdir = Path(job.workdir).absolute()
    q = shlex.quote
    sbatch = [
        f"--job-name={job.name}",
        f"--nodes={nnodes}",
        "--ntasks-per-node=1",
        f"--output={workdir / 'slurm-%j.out'}",
    ]
    chosen = {
        "--partition": settings.partition,
        "--account": settings.account,
        "--qos": settings.qos,
        "--time": settings.time,
        "--gpus-per-node": settings.gpus_per_node,
        "--gres": settings.gres,
        "--cpus-per-task": settings.cpus_per_task,
        "--mem": settings.mem,
    }
    sbatch += [f"{option}={value}" for option, value in chosen.items() if value is not None]
    sbatch = [_sbatch_quoted(option) for option in sbatch] + settings.sbatch_options
    if settings.rdzv_port is None:
        free_port = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
        port = f"$({q(sys.executable)} -c {q(free_port)})"
    else:
        port = str(settings.rdzv_port)
    torchrun = [q(sys.executable), "-m", "torch.distributed.run", '--nnodes="$SLURM_NNODES"',
                f"--nproc-per-node={job.nproc_per_node}", "--rdzv-backend=c10d",
                '--rdzv-endpoint="$first_node:$rdzv_port"', '--rdzv-id="$SLURM_JOB_ID"',
                "-m", q(job.module), *(q(arg) for arg in job.args)]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {option}" for option in sbatch),
        f"# {job.name}: torchrun on each of the job's nodes, {job.nproc_per_node} worker(s) per node,",
        "# meeting at a c10d rendezvous on the first node. Written by llmflow's Slurm launcher.",
        "set -e",
        "export PYTHONUNBUFFERED=1",
        *(f"export {name}={q(value)}" for name, value in env.items()),
        *settings.setup,
        'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        '[ -n "$first_node" ] || { echo "no first node in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST" >&2; exit 1; }',
        f"rdzv_port={port}",
        'echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) $SLURM_JOB_NODELIST, rendezvous at $first_node:$rdzv_port"',
        'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL \\',
        "    " + " ".join(torchrun),
        "",
    ]
    return "\n".join(lines)


def _sbatch_quoted(option: str) -> str:
    """``--name=value`` as an #SBATCH line takes it: sbatch splits the line at blanks outside
    double quotes."""
    name, _, value = option.partition("=")
    if not re.search(r"\s", value):
        return option
    if '"' in value or "\n" in value:
        raise ValueError(f"sbatch option {option!r}: a value with blanks cannot also hold a double quote or a newline")
    return f'{name}="{value}"'


def write_job_script(job: WorkerJob, nnodes: int, settings: SlurmSettings, env: dict[str, str]) -> Path:
    """``job_script`` written into ``job.workdir`` (a temporary file renamed into place: a node
    reading it never sees half of it); returns its path."""
    workdir = Path(job.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / SCRIPT_NAME
    tmp = path.with_name(f".{SCRIPT_NAME}.{os.getpid()}.tmp")
    tmp.write_text(job_script(job, nnodes, settings, env))
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path


def missing_commands() -> list[str]:
    """The Slurm client commands the launcher needs that are not on PATH."""
    return [command for command in COMMANDS if shutil.which(command) is None]


def run_slurm(job: WorkerJob, nnodes: int, settings: SlurmSettings, on_line: Callable[[str], None] = print,
              env: dict[str, str] | None = None) -> None:
    """Run ``job`` as a Slurm job of ``nnodes`` nodes; stream its output lines to ``on_line``
    (with a line of the launcher's own when the job is submitted, starts and ends); return
    when it completes. Raises ``SlurmJobError`` when it ends otherwise, and cancels it when
    interrupted."""
    missing = missing_commands()
    if missing:
        raise RuntimeError(f"the Slurm launcher needs Slurm's client commands on PATH; missing: {', '.join(missing)}")
    script = write_job_script(job, nnodes, settings, env or {})
    submitted = time.time()
    job_id = submit(script)
    output = Path(job.workdir).absolute() / f"slurm-{job_id}.out"
    try:
        drop_stale_output(output, submitted)
        on_line(f"Slurm job {job_id} submitted ({job.name}, {nnodes} node(s)): {script}, output {output}")
        state, reason, returncode, tail = follow(job_id, output, settings.poll_s, on_line)
    except BaseException:
        cancel(job_id)
        raise
    if state != "COMPLETED":
        raise SlurmJobError(job_id, state, reason, returncode, tail)


def submit(script: Path) -> str:
    """Submit ``script`` with ``sbatch --parsable``; returns the job id."""
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False,
                              timeout=120)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"sbatch {script} did not answer in 120 s: is slurmctld reachable (scontrol ping)?") from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise RuntimeError(f"sbatch refused {script}: {message}")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch printed no job id for {script}: {done.stdout.strip()!r}")
    return job_id


def drop_stale_output(output: Path, submitted: float) -> None:
    """Remove an output file of the job's name that is older than the job: a job of the same
    id before the cluster's job ids started over, whose lines are no part of this job's."""
    with contextlib.suppress(FileNotFoundError):
        if output.stat().st_mtime < submitted - STALE_OUTPUT_S:
            output.unlink()


def job_state(job_id: str) -> tuple[str, str, str] | None:
    """The job's (state, reason, exit code ``code:signal``) from ``scontrol show job``, or
    from ``sacct`` once the controller no longer knows the job; None when neither answers."""
    try:
        return _job_state(job_id)
    except subprocess.TimeoutExpired:
        return None


def _job_state(job_id: str) -> tuple[str, str, str] | None:
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False,
                          timeout=60)
    if done.returncode == 0:
        for line in done.stdout.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("JobId") == job_id and "JobState" in fields:
                return fields["JobState"], fields.get("Reason", ""), fields.get("ExitCode", "0:0")
    if shutil.which("sacct") is None:
        return None
    done = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"], capture_output=True,
                          text=True, check=False, timeout=60)
    rows = [line.split("|") for line in done.stdout.splitlines() if "|" in line] if done.returncode == 0 else []
    if not rows:
        return None
    state, exit_code = rows[-1][0], rows[-1][1]
    return state.split()[0] if state else "UNKNOWN", "", exit_code


def exit_status(exit_code: str) -> int:
    """A process-style exit status from Slurm's ``code:signal``: the code, else 128 + the
    signal, else 1 (a job that failed without an exit code of its own)."""
    code, _, signal = exit_code.partition(":")
    if code.isdigit() and int(code):
        return int(code)
    if signal.isdigit() and int(signal):
        return 128 + int(signal)
    return 1


class _OutputReader:
    """The lines of a file another process appends to, as they are completed."""

    def __init__(self, path: Path, on_line: Callable[[str], None], tail: deque[str]) -> None:
        self.path = path
        self.on_line = on_line
        self.tail = tail
        self.offset = 0
        self.partial = b""
        self.seen = False
        """Whether the file was ever there."""

    def read(self) -> bool:
        """Hand on the lines written since the last read; whether the file grew."""
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # truncated: written anew
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return False
        self.seen = True
        if not data:
            return False
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            self._emit(line)
        return True

    def finish(self) -> None:
        """Hand on the last line when the file does not end with a newline."""
        if self.partial:
            self._emit(self.partial)
            self.partial = b""

    def _emit(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\r")
        self.tail.append(line)
        self.on_line(line)


def follow(job_id: str, output: Path, poll_s: float, on_line: Callable[[str], None],
           tail_lines: int = 50) -> tuple[str, str, int, list[str]]:
    """Stream ``output`` to ``on_line`` until job ``job_id`` reaches a final state; returns
    that state, its reason, the exit status and the last output lines."""
    tail: deque[str] = deque(maxlen=tail_lines)
    reader = _OutputReader(output, on_line, tail)
    read_every = min(0.5, poll_s)
    seen: tuple[str, str] | None = None
    unknown_since: float | None = None
    next_poll = 0.0
    while True:
        reader.read()
        now = time.monotonic()
        if now >= next_poll:
            next_poll = now + poll_s
            found = job_state(job_id)
            if found is None:
                unknown_since = unknown_since or now
                if now - unknown_since > FORGOTTEN_GRACE_S:
                    reader.finish()
                    raise SlurmJobError(job_id, "UNKNOWN", "neither scontrol nor sacct knows the job", 1, list(tail))
            else:
                unknown_since = None
                state, reason, exit_code = found
                if (state, reason) != seen:
                    seen = (state, reason)
                    if state in ACTIVE_STATES:
                        because = f" ({reason})" if reason and reason != "None" else ""
                        on_line(f"Slurm job {job_id} {state}{because}")
                if state not in ACTIVE_STATES:
                    break
        time.sleep(read_every)
    settled = time.monotonic()
    while time.monotonic() - settled < min(OUTPUT_SETTLE_S, poll_s):
        if reader.read():
            settled = time.monotonic()
        time.sleep(0.2)
    reader.finish()
    on_line(f"Slurm job {job_id} {state}, exit code {exit_code}")
    if not reader.seen:
        tail.append(f"the job's output file {output} never appeared: is {output.parent} on storage every node "
                    "shares, at the same path?")
    return state, reason, exit_status(exit_code), list(tail)


def cancel(job_id: str, wait_s: float = CANCEL_WAIT_S) -> None:
    """``scancel`` the job, then wait up to ``wait_s`` for it to end (Slurm sends its
    processes SIGTERM, and SIGKILL after the cluster's KillWait)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["scancel", job_id], capture_output=True, check=False, timeout=30)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            found = job_state(job_id)
        except (OSError, subprocess.SubprocessError):
            return
        if found is None or found[0] not in ACTIVE_STATES:
            return
        time.sleep(0.5)
