"""Workers forked from a server process that has already imported torch, the training loop
and megatron-core, for the checks that only compare numbers between layouts.

Each rank runs the same worker function torchrun would run (``llmflow.train.__main__.main``,
``megatron_worker.main``) with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), but starts in a fraction of a second: a torchrun launch pays for
torchrun's own start and for importing torch (megatron-core: 7 s more) in every worker, 6-9 s
of a two-core machine per launch, more than the few steps the checks compute. The launch
path itself (torchrun, signals, exit codes, resume after a kill) is tested through
``launch_training`` by the tests that are about it.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

from llmflow.train.config import TrainConfig
from llmflow.train.preflight import record_run

_CONTEXT = multiprocessing.get_context("forkserver")
# The server imports these once, when the first worker starts; every worker forked from it
# starts with them imported.
_CONTEXT.set_forkserver_preload(["llmflow.train.__main__", "megatron_worker"])
TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(target: str, argv: list[str], env: dict[str, str], log: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own stdout)
    import torch

    # The server imported torch before this worker's thread count was known: set it as a
    # fresh process would have it.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(argv)


def run_forked(target: str, argv: list[str], nproc: int, logs: Path, env: dict[str, str] | None = None,
               process_group: bool | None = None) -> list[str]:
    """``module:function`` called with ``argv`` on ``nproc`` ranks, their environment this
    process's with ``env`` added (as torchrun's workers would have it); one process joins no
    process group unless ``process_group``. Each rank's output goes to ``{logs}.rank{r}.log``.
    Returns the output lines of every rank, rank 0 first; raises AssertionError quoting the
    logs when a rank fails or the run times out."""
    base = {**os.environ, **(env or {})}
    grouped = nproc > 1 if process_group is None else process_group
    if grouped:
        base |= {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}
    paths = [logs.parent / f"{logs.name}.rank{rank}.log" for rank in range(nproc)]
    ranks = []
    for rank, path in enumerate(paths):
        rank_env = base | ({"RANK": str(rank), "LOCAL_RANK": str(rank)} if grouped else {})
        process = _CONTEXT.Process(target=_worker, args=(target, argv, rank_env, str(path)))
        process.start()
        ranks.append(process)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.is_alive() for p in ranks):
            failed = [p for p in ranks if p.exitcode not in (None, 0)]
            assert not failed and time.monotonic() < deadline, "a rank failed or the run timed out"
            time.sleep(0.05)
        assert all(p.exitcode == 0 for p in ranks), "a rank failed"
    except AssertionError as error:
        output = "\n".join(f"--- rank {r} (exit {p.exitcode}):\n{paths[r].read_text()[-3000:]}"
                           for r, p in enumerate(ranks) if paths[r].exists())
        raise AssertionError(f"{error}: {target} {argv}\n{output}") from None
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join()
    return [line for path in paths for line in path.read_text().splitlines()]


def train_forked(cfg: TrainConfig, nproc: int, env: dict[str, str] | None = None,
                 process_group: bool | None = None) -> list[str]:
    """Train ``cfg`` on ``nproc`` CPU ranks over gloo (``run_forked``), its config recorded
    in the run directory as ``launch_training`` does; the rank logs go beside the run."""
    config_path = record_run(cfg)
    return run_forked("llmflow.train.__main__:main", [str(config_path)], nproc, Path(cfg.out),
                      {"LLMFLOW_DEVICE": "cpu", **(env or {})}, process_group)
