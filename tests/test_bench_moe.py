"""bench/moe_step.py on a short sequence: llmflow's MoE training step, as ``llmflow train``
runs it on one worker (``setup`` and ``train_step``), and transformers' Qwen3-MoE step on the
same samples; the benchmark exits non-zero unless their first-step losses and auxiliary
losses agree (fp32: within 1e-5). bf16 is the code path ``--device cuda`` runs (FSDP2 mixed
precision against transformers' bf16 weights), here on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_step_bench_runs_both_sides_to_the_same_first_loss(dtype):
    cmd = [sys.executable, "-m", "bench.moe_step", "--rounds", "1", "--steps", "1", "--warmup", "1", "--seq", "64",
           "--sides", "transformers", "llmflow", "--dtype", dtype]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tolerance = {"fp32": 1e-5, "bf16": 5e-2}[dtype]
    loss, aux = re.search(r"every side within (\S+) \(tolerance \S+\), auxiliary within (\S+) ", proc.stdout).groups()
    assert float(loss) <= tolerance and float(aux) <= tolerance
    assert re.search(r"^\| llmflow / transformers \| \d+\.\d+x", proc.stdout, re.MULTILINE), proc.stdout
