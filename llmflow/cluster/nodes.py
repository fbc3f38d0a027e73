"""How the nodes of a multi-node run find each other, as torchrun takes it: a static master
(MindSpeed's ``NNODES``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``) or a c10d rendezvous;
and the command that starts one node's workers, run here by ``run_on_this_node``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmflow.launch import run_workers


class NodeLayout(BaseModel):
    """The nodes of a run and how their torchrun agents meet. One node (the default) runs
    standalone; more, started by hand on each node, need either ``master_addr`` with
    ``node_rank`` (a static master, every node started with its own rank) or ``rdzv_endpoint``
    (c10d rendezvous: ranks assigned on arrival); a Slurm or Kubernetes job needs only
    ``nnodes``. Every node must see the run's checkpoints, config and data at the same paths."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    nnodes: int = Field(default=1, ge=1)
    """Nodes taking part; the world size is nnodes x nproc (processes per node)."""
    node_rank: int | None = Field(default=None, ge=0)
    """This node's rank (0 .. nnodes-1) with a static master; node 0 hosts the master."""
    master_addr: str | None = None
    """Address of node 0, which every node can reach (static master)."""
    master_port: int = Field(default=29500, ge=1, le=65535)
    """Port of the master (static) on node 0."""
    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous (instead of a static master), on one of the nodes."""
    rdzv_id: str = "llmflow"
    """Rendezvous id: the same on every node of one run, different between concurrent runs."""
    rdzv_host: bool | None = None
    """Whether this node hosts the rendezvous store. Default: torchrun decides, by the node
    whose hostname or addresses match the endpoint's host, which misses an address on a
    secondary network interface; then say true on that node (and false on the others)."""
    local_addr: str | None = None
    """This node's address on the network the nodes share (rendezvous): the workers' master
    is reached at the first node's. Default: the node's fully qualified hostname, which must
    then resolve to that network's address on every node."""

    @model_validator(mode="after")
    def _one_way_to_meet(self) -> NodeLayout:
        static = self.master_addr is not None or self.node_rank is not None
        if static and self.rdzv_endpoint is not None:
            raise ValueError("give either master_addr with node_rank (static master) or rdzv_endpoint, not both")
        if (self.rdzv_host is not None or self.local_addr is not None) and self.rdzv_endpoint is None:
            raise ValueError("rdzv_host and local_addr go with rdzv_endpoint (a static master is master_addr)")
        if self.master_addr is not None and self.node_rank is None:
            raise ValueError("master_addr needs node_rank (this node's rank, 0 on the master)")
        if self.node_rank is not None and self.master_addr is None:
            raise ValueError("node_rank needs master_addr (the address of node 0)")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        return self

    @property
    def standalone(self) -> bool:
        """One node with no master or rendezvous given: torchrun --standalone."""
        return self.nnodes == 1 and self.master_addr is None and self.rdzv_endpoint is None

    @property
    def leads(self) -> bool:
        """Whether this node is the one that records the run (node 0 of a static master; every
        node of a rendezvous, where ranks are only known once the agents meet)."""
        return self.node_rank in (None, 0)

    def torchrun_problems(self) -> list[str]:
        """Why torchrun started by hand (the local launcher) cannot run this layout, if it cannot:
        several nodes need a place to meet."""
        if self.nnodes > 1 and self.master_addr is None and self.rdzv_endpoint is None:
            return [(f"nnodes={self.nnodes} with the local launcher needs master_addr and node_rank (a static "
                    "master) or rdzv_endpoint, with the same command started on every node")]
        return []

    def torchrun_args(self, nproc_per_node: int) -> list[str]:
        """torchrun's options for ``nproc_per_node`` processes on each node of this layout."""
        problems = self.torchrun_problems()
        if problems:
            raise ValueError("; ".join(problems))
        args = [f"--nproc-per-node={nproc_per_node}"]
        if self.standalone:
            return [*args, "--standalone"]
        args.append(f"--nnodes={self.nnodes}")
        if self.rdzv_endpoint is not None:
            args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}"]
            if self.rdzv_host is not None:
                args.append(f"--rdzv-conf=is_host={str(self.rdzv_host).lower()}")
            return args if self.local_addr is None else [*args, f"--local-addr={self.local_addr}"]
        return [*args, f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]


def torchrun_command(module: str, args: Sequence[str], nproc: int, nodes: NodeLayout | None = None) -> list[str]:
    """``torchrun`` running ``python -m module args`` on ``nproc`` processes on this node of
    ``nodes`` (default: one node, standalone)."""
    options = (nodes or NodeLayout()).torchrun_args(nproc)
    return [sys.executable, "-m", "torch.distributed.run", *options, "-m", module, *args]


SINGLE_WORKER_ENV = {
    "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
    "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
    # Port 0: the rank-0 store takes a free port; with one rank nobody else needs to find it.
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
}
"""What torchrun --standalone --nproc-per-node=1 tells its worker about its place in the job."""


def worker_command(module: str, args: Sequence[str], nproc: int,
                   nodes: NodeLayout | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and the environment that start ``python -m module args`` on ``nproc``
    processes on this node of ``nodes``: torchrun's; for one process on one node, the worker
    itself with the environment torchrun would give it, which spares torchrun's agent (2 s
    and a process of its own at every start) and leaves the worker the same process group."""
    nodes = nodes or NodeLayout()
    if nproc == 1 and nodes.standalone:
        return [sys.executable, "-m", module, *args], dict(SINGLE_WORKER_ENV)
    return torchrun_command(module, args, nproc, nodes), {}


def run_on_this_node(module: str, args: Sequence[str], nproc: int, nodes: NodeLayout | None = None,
                     on_line: Callable[[str], None] = print, env: dict[str, str] | None = None) -> None:
    """Run ``worker_command``'s workers here, their output lines to ``on_line`` and their
    environment this process's with ``env`` added; raises ``WorkerError`` when they fail."""
    command, worker_env = worker_command(module, args, nproc, nodes)
    run_workers(command, on_line=on_line, env={**(env or {}), **worker_env})
