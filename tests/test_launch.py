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



# --- the node layout torchrun is given, and which launcher may run it --------------------------


def test_node_layouts_become_torchrun_options():
    from llmflow.cluster.nodes import NodeLayout

    assert NodeLayout().torchrun_args(2) == ["--nproc-per-node=2", "--standalone"]
    static = NodeLayout(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=6000)
    assert static.torchrun_args(8) == ["--nproc-per-node=8", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
                                       "--master-port=6000"]
    rdzv = NodeLayout(nnodes=4, rdzv_endpoint="head:29400", rdzv_id="job7", rdzv_host=True, local_addr="10.0.0.1")
    assert rdzv.torchrun_args(8) == ["--nproc-per-node=8", "--nnodes=4", "--rdzv-backend=c10d",
                                     "--rdzv-endpoint=head:29400", "--rdzv-id=job7", "--rdzv-conf=is_host=true",
                                     "--local-addr=10.0.0.1"]
    assert not static.leads and NodeLayout(nnodes=2, node_rank=0, master_addr="h").leads and rdzv.leads


def test_one_process_on_one_node_starts_the_worker_with_torchruns_environment(tmp_path):
    from llmflow.cluster.nodes import NodeLayout, worker_command

    command, env = worker_command("llmflow.train", ["cfg.json"], 1)
    assert command == [sys.executable, "-m", "llmflow.train", "cfg.json"]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "0", "1", "1")
    for nproc, nodes in ((2, None), (1, NodeLayout(nnodes=2, node_rank=0, master_addr="h"))):
        command, env = worker_command("llmflow.train", ["cfg.json"], nproc, nodes)
        assert command[1:3] == ["-m", "torch.distributed.run"] and env == {}

    # The worker joins a process group of one, as under torchrun.
    script = tmp_path / "worker.py"
    script.write_text("import torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "print(dist.get_rank(), dist.get_world_size(), flush=True)\n"
                      "dist.destroy_process_group()\n")
    lines: list[str] = []
    command, env = worker_command("worker", [], 1)
    run_workers(command, on_line=lines.append, env=env, cwd=tmp_path)
    assert lines[-1] == "0 1"


@pytest.mark.parametrize(("settings", "message"), [
    ({"nnodes": 2, "master_addr": "h"}, "master_addr needs node_rank"),
    ({"nnodes": 2, "node_rank": 0}, "node_rank needs master_addr"),
    ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, "node_rank=2 must be below nnodes=2"),
    ({"nnodes": 2, "node_rank": 0, "master_addr": "h", "rdzv_endpoint": "h:1"}, "either master_addr"),
    ({"rdzv_host": True}, "rdzv_host and local_addr go with rdzv_endpoint"),
])
def test_inconsistent_node_layouts_are_refused(settings, message):
    from pydantic import ValidationError

    from llmflow.cluster.nodes import NodeLayout

    with pytest.raises(ValidationError, match=message):
        NodeLayout(**settings)


def test_a_launcher_refuses_nodes_it_cannot_place(monkeypatch):
    from llmflow.cluster.launcher import LAUNCHER_ENV, LaunchSettings, node_problems
    from llmflow.cluster.nodes import NodeLayout

    (problem,) = node_problems(LaunchSettings(launcher="local"), NodeLayout(nnodes=2))
    assert problem.startswith("nnodes=2 with the local launcher needs master_addr and node_rank (a static master)")
    assert node_problems(LaunchSettings(launcher="slurm"), NodeLayout(nnodes=2)) == []
    assert "places the nodes itself" in node_problems(LaunchSettings(launcher="slurm"),
                                                      NodeLayout(nnodes=2, rdzv_endpoint="h:1"))[0]
    monkeypatch.setenv(LAUNCHER_ENV, "slurm")
    assert LaunchSettings().engine == "slurm" and not LaunchSettings().on_this_machine
    monkeypatch.setenv(LAUNCHER_ENV, "lsf")
    with pytest.raises(ValueError, match="LLMFLOW_LAUNCHER='lsf': expected one of local, slurm, kubernetes"):
        _ = LaunchSettings().engine
