"""A real one-node Slurm cluster for the launcher's tests: Debian's munged, slurmctld and
slurmd, started in the foreground with every file (munge key, slurm.conf, state, spool,
logs) in a temporary directory (munge's socket in one of its own under /tmp) and their own
free ports, so that it sits beside any
other cluster on the machine. Clients find it through SLURM_CONF, as users point theirs at
a cluster.

``start_cluster(root)`` is a context manager yielding a ``SlurmCluster`` once ``sinfo``
reports the node idle; leaving it cancels what still runs and stops the daemons.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from server_process import free_ports

DAEMONS = {"munged": "/usr/sbin/munged", "mungekey": "/usr/sbin/mungekey", "slurmctld": "/usr/sbin/slurmctld",
           "slurmd": "/usr/sbin/slurmd", "slurmstepd": "/usr/sbin/slurmstepd"}
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
# The daemons get SIGTERM when the test process dies, even killed, so that none outlives an
# aborted session (util-linux's setpriv sets the parent-death signal, then runs the daemon).
_DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "TERM") if shutil.which("setpriv") else ()


def missing_binaries() -> list[str]:
    """The Slurm and munge programs this machine lacks (``make system-packages`` installs them)."""
    missing = [name for name, path in DAEMONS.items() if not (shutil.which(name) or Path(path).exists())]
    return missing + [name for name in CLIENTS if shutil.which(name) is None]


def _binary(name: str) -> str:
    return shutil.which(name) or DAEMONS[name]


class SlurmCluster:
    """A running test cluster: its directory, slurm.conf and node names (the first is this
    machine's short hostname, the one a job's rendezvous names)."""

    def __init__(self, root: Path, nodes: list[str]) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.nodes = nodes

    @property
    def env(self) -> dict[str, str]:
        """What a client's environment needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(args), env={**os.environ, **self.env}, capture_output=True, text=True,
                              check=check, timeout=60)

    def queue(self) -> list[str]:
        """Ids of the jobs squeue lists (pending, running or completing)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def job(self, job_id: str) -> dict[str, str]:
        """The fields of ``scontrol show job``; empty once the controller forgot the job."""
        done = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        line = done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else ""
        # Values may hold blanks (JobName, Command): a field runs up to the next " Key=".
        return dict(re.findall(r"([\w/:]+)=(.*?)(?= [\w/:]+=|\s*$)", line))

    def wait_gone(self, job_id: str, timeout_s: float = 60) -> dict[str, str]:
        """Wait until the job is out of squeue; returns its scontrol fields then."""
        deadline = time.monotonic() + timeout_s
        while job_id in self.queue():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still queued after {timeout_s:.0f} s: {self.job(job_id)}")
            time.sleep(0.5)
        return self.job(job_id)

    def log_tails(self, lines: int = 30) -> str:
        """The end of each daemon's log, for a failure message."""
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            if path.exists():
                name = path.name
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def step_daemons(self) -> list[psutil.Process]:
        """slurmstepd processes of this cluster (they outlive slurmd; told apart by SLURM_CONF,
        which they inherit from it)."""
        found = []
        for proc in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.Error):
                if proc.info["name"] and "slurmstepd" in proc.info["name"] and \
                        proc.environ().get("SLURM_CONF") == str(self.conf):
                    found.append(proc)
        return found


def write_config(root: Path, nodes: dict[str, int], ctld_port: int, munge_socket: Path) -> Path:
    """slurm.conf of a cluster in ``root`` whose nodes (name: slurmd port) are all this
    machine, one CPU each: everything as root, no cgroups (the processes of a job are tracked
    through /proc), no accounting database, jobs kept by the controller for 10 minutes after
    they end (their final state stays readable) and killed 5 s after their SIGTERM when
    cancelled."""
    conf = root / "slurm.conf"
    (root / "state").mkdir(exist_ok=True)
    for node in nodes:
        (root / f"spool-{node}").mkdir(exist_ok=True)
    node_lines = "".join(f"NodeName={node} NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory=1000 State=UNKNOWN\n"
                         for node, port in nodes.items())
    conf.write_text(f"""\
ClusterName=llmflowtest
SlurmctldHost={next(iter(nodes))}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool-%n'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd-%n.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd-%n.log'}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=600
KillWait=5
{node_lines}PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


@contextlib.contextmanager
def start_cluster(root: Path, nnodes: int = 2, timeout_s: float = 60) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and a slurmd for each of ``nnodes`` nodes, with their files in
    ``root``; yield the cluster once its nodes are idle; then cancel its jobs and stop the
    daemons. The nodes are this machine's short hostname, then that name with -2, -3, ...
    appended: Slurm lists a job's nodes sorted, so the first, where the job's rendezvous is, is
    the hostname, which resolves (the others need not)."""
    host = socket.gethostname().split(".")[0]
    names = [host] + [f"{host}-{i}" for i in range(2, nnodes + 1)]
    root.mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    # munged wants its socket where everyone may reach it, every directory above included:
    # not in pytest's private temporary directory.
    socket_dir = Path(tempfile.mkdtemp(prefix="llmflow-munge-"))
    socket_dir.chmod(0o755)
    munge_socket = socket_dir / "munge.sock"
    subprocess.run([_binary("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
    key.chmod(0o400)
    ctld_port, *node_ports = free_ports(1 + nnodes)
    conf = write_config(root, dict(zip(names, node_ports, strict=True)), ctld_port, munge_socket)
    cluster = SlurmCluster(root, names)
    env = {**os.environ, **cluster.env}
    daemons: list[subprocess.Popen] = []

    def daemon(name: str, *args: str, out_name: str | None = None) -> None:
        with (root / f"{out_name or name}.out").open("w") as out:
            daemons.append(subprocess.Popen([*_DIE_WITH_PARENT, _binary(name), *args], stdout=out,
                                            stderr=subprocess.STDOUT, env=env, cwd=root))

    try:
        daemon("munged", "--foreground", f"--key-file={key}", f"--socket={munge_socket}",
               f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
               f"--seed-file={root / 'munged.seed'}")
        _wait(lambda: munge_socket.exists(), timeout_s, "munged's socket", cluster, daemons)
        daemon("slurmctld", "-D", "-f", str(conf))
        for node in names:
            daemon("slurmd", "-D", "-N", node, "-f", str(conf), out_name=f"slurmd-{node}")
        _wait(lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split() == ["idle"] * nnodes,
              timeout_s, f"{nnodes} idle nodes in sinfo", cluster, daemons)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            for job_id in cluster.queue():
                cluster.run("scancel", job_id, check=False)
            deadline = time.monotonic() + 30
            while cluster.queue() and time.monotonic() < deadline:
                time.sleep(0.5)
        steps = cluster.step_daemons()
        for proc in reversed(daemons):
            _stop(proc)
        for step in steps:
            with contextlib.suppress(psutil.Error):
                for child in step.children(recursive=True):
                    child.kill()
                step.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)


def _wait(ready, timeout_s: float, what: str, cluster: SlurmCluster, daemons: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        dead = [proc.args[0] for proc in daemons if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{', '.join(dead)} exited" if dead else f"no {what} after {timeout_s:.0f} s"
            raise RuntimeError(f"the test Slurm cluster did not start: {why}\n{cluster.log_tails()}")
        time.sleep(0.3)
