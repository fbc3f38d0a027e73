"""Training on two nodes: two network namespaces joined by a veth pair, a torchrun agent in
each (``llmflow train --nnodes 2``, static master or c10d rendezvous), one worker per node.
The two-node losses equal the single process's within 1e-5, and when one node's worker is
killed both nodes stop, and the rerun resumes from the last checkpoint to the same losses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from network_namespaces import Node, two_nodes
from server_process import free_port
from train_helpers import assert_close, config, losses, train_in_subprocess, training_assets

from llmflow.train.config import TrainConfig

pytestmark = pytest.mark.slow
LLMFLOW = str(Path(sys.executable).parent / "llmflow")
WORKER_ENV = {"OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def assets(sample_assets, tmp_path_factory) -> dict[str, Path]:
    return training_assets(sample_assets(), tmp_path_factory.mktemp("multinode"))


@pytest.fixture(scope="module")
def nodes():
    with two_nodes() as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory) -> dict[int, float]:
    return train_in_subprocess(config(assets, tmp_path_factory.mktemp("reference") / "run"))


def start_node(node: Node, cfg_path: Path, workspace: Path, meeting: list[str]) -> subprocess.Popen:
    """``llmflow train`` with one worker on ``node``, its output merged into a pipe."""
    args = [LLMFLOW, "train", str(cfg_path), "--nproc", "1", "--nnodes", "2", "--workspace", str(workspace), *meeting]
    env = {**os.environ, **WORKER_ENV, **node.env}
    env.pop("MLFLOW_TRACKING_URI", None)  # each node's workspace store: only the recording node's gets the run
    return subprocess.Popen(node.command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def start_with_static_master(nodes: tuple[Node, Node], cfg_path: Path, root: Path) -> list[subprocess.Popen]:
    """Both nodes, node 0 the master (on a port free now), each recording into ``root/ws{rank}``."""
    port = free_port()
    return [start_node(node, cfg_path, root / f"ws{rank}",
                       ["--node-rank", str(rank), "--master-addr", nodes[0].addr, "--master-port", str(port)])
            for rank, node in enumerate(nodes)]


def write_config(cfg: TrainConfig, path: Path) -> Path:
    path.write_text(cfg.model_dump_json())
    return path


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[list[str]]:
    """Every process's output lines, once all have exited (killed if still running at ``timeout``)."""
    outputs = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for process in [*psutil.Process(proc.pid).children(recursive=True), proc]:
                process.kill()  # torchrun and its workers too: a killed llmflow cannot stop them
            out, _ = proc.communicate()
        outputs.append(out.splitlines())
    return outputs


def finish_both(procs: list[subprocess.Popen], timeout: float = 300) -> list[list[str]]:
    """``finish``, asserting that both nodes succeeded (their last lines shown when not)."""
    outputs = finish(procs, timeout)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs[0][-20:] + outputs[1][-20:])
    return outputs


def test_two_nodes_with_a_static_master_train_as_one_process_and_only_node_0_records(assets, nodes, reference,
                                                                                       tmp_path):
    cfg = write_config(config(assets, tmp_path / "run"), tmp_path / "run.json")
    outputs = finish_both(start_with_static_master(nodes, cfg, tmp_path))
    got = losses(outputs[0])
    assert sorted(got) == list(range(1, 11))
    assert_close(got, reference)
    print(f"2 nodes x 1 worker (static master) vs one process: max |loss difference| "
          f"{max(abs(got[s] - reference[s]) for s in got):.1e} over steps 1-10")
    assert (tmp_path / "ws0" / "mlflow.db").is_file() and not (tmp_path / "ws1" / "mlflow.db").exists()

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'ws0' / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params["nnodes"] == "2"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 10


def test_two_nodes_meet_at_a_c10d_rendezvous(assets, nodes, reference, tmp_path):
    cfg = write_config(config(assets, tmp_path / "run"), tmp_path / "run.json")
    meeting = ["--rdzv-endpoint", f"{nodes[0].addr}:{free_port()}", "--rdzv-id", "two-nodes"]
    # The nodes' addresses are on the veth pair, which torchrun's guesses (the hostname and the
    # addresses it resolves to) miss, as on a host's secondary network interface.
    procs = [start_node(node, cfg, tmp_path / f"ws{rank}",
                        [*meeting, "--rdzv-host", str(rank == 0).lower(), "--local-addr", node.addr])
             for rank, node in enumerate(nodes)]
    outputs = finish_both(procs, timeout=150)
    got = losses(outputs[0] + outputs[1])  # global rank 0 is on whichever node the rendezvous made it
    assert sorted(got) == list(range(1, 11))
    assert_close(got, reference)


def test_a_killed_node_stops_the_run_and_the_rerun_resumes_from_the_last_checkpoint(assets, nodes, reference,
                                                                                      tmp_path):
    cfg = write_config(config(assets, tmp_path / "run", save_interval=3), tmp_path / "run.json")
    procs = start_with_static_master(nodes, cfg, tmp_path)
    for line in procs[0].stdout:
        if line.startswith("step 7/"):
            workers = [p for p in psutil.Process(procs[1].pid).children(recursive=True) if "llmflow.train" in p.cmdline()]
            assert workers, "node 1 runs no training worker"
            for worker in workers:
                worker.kill()
            break
    finish(procs, timeout=180)
    assert procs[0].returncode != 0 and procs[1].returncode != 0, "a node whose peer died must fail, not hang"
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_00000006"

    outputs = finish_both(start_with_static_master(nodes, cfg, tmp_path))
    resumed = losses(outputs[0])
    assert sorted(resumed) == list(range(7, 11))
    assert_close(resumed, reference)
