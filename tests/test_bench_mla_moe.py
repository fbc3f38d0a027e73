"""bench/mla_moe_step.py on a short sequence: llmflow's DeepSeek-V3 (MLA + MoE) training step,
as ``llmflow train`` runs it on one worker (``setup`` and ``train_step``), and transformers'
DeepseekV3ForCausalLM step on the same samples; the benchmark exits non-zero unless their
first-step losses agree within 1e-5 (fp32)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mla_moe_step_bench_runs_both_sides_to_the_same_first_loss():
    cmd = [sys.executable, "-m", "bench.mla_moe_step", "--rounds", "1", "--steps", "1", "--warmup", "1", "--seq", "32",
           "--sides", "transformers", "llmflow"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = re.search(r"every side within (\S+) \(tolerance \S+\)\.", proc.stdout).group(1)
    assert float(loss) <= 1e-5
    assert re.search(r"^\| llmflow / transformers \| \d+\.\d+x", proc.stdout, re.MULTILINE), proc.stdout
