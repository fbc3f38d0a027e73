"""Two "nodes" on this machine: two network namespaces joined by a veth pair, each with an
address of its own, so that torchrun agents in them meet over a real network interface as
agents on two hosts do. Where namespaces cannot be made (no root, no ``ip``), two agents on
loopback addresses stand in, and the reason is reported."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SUBNET = "10.77.0"


@dataclass(frozen=True)
class Node:
    """One node: where its commands run and the address the other node reaches it at."""

    addr: str
    namespace: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    """What the node's processes need: gloo binds the interface named here, as
    GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME, HCCL_IF_IP) pin it on hosts with several."""

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` run on this node."""
        return ["ip", "netns", "exec", self.namespace, *args] if self.namespace else list(args)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_nodes() -> Iterator[tuple[Node, Node]]:
    """Two nodes joined by a veth pair (10.77.0.1 and 10.77.0.2), removed afterwards; or, where
    namespaces cannot be made, two agents on loopback (with a warning saying why)."""
    tag = f"llf{os.getpid() % 100000}"
    names = [f"{tag}n0", f"{tag}n1"]
    links = [f"{tag}v0", f"{tag}v1"]
    try:
        if shutil.which("ip") is None:
            raise OSError("the ip command (iproute2) is not installed")
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i, (name, link) in enumerate(zip(names, links)):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except (OSError, subprocess.CalledProcessError) as error:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        reason = getattr(error, "stderr", None) or str(error)
        warnings.warn(f"network namespaces cannot be made here ({reason.strip()}); two agents on loopback instead",
                      stacklevel=2)
        loopback = {"GLOO_SOCKET_IFNAME": "lo"}
        yield Node("127.0.0.1", env=loopback), Node("127.0.0.1", env=loopback)
        return
    try:
        yield tuple(Node(f"{SUBNET}.{i + 1}", name, {"GLOO_SOCKET_IFNAME": link})
                    for i, (name, link) in enumerate(zip(names, links)))  # type: ignore[misc]
    finally:
        for name in names:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
