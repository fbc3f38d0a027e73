"""bench/grpo.py at tiny sizes: TRL's GRPOTrainer and llmflow's ``method: grpo`` each run a
step after a warm-up step (llmflow's rewards in its worker processes, which import
``bench.grpo:reward``), the benchmark exits non-zero unless both sides sampled every
completion to its full length, and it prints the step-time ratio."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_grpo_bench_runs_both_sides_to_full_length_completions():
    cmd = [sys.executable, "-m", "bench.grpo", "--rounds", "1", "--steps", "1", "--warmup", "1", "--prompts", "1",
           "--generations", "2", "--completion", "4", "--max-wait", "0"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for side in ("trl", "llmflow"):
        assert re.search(rf"^round 1/1 {side}: .* completion length 4\.0,", proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^- TRL / llmflow step time, per round: median \d+\.\d+x", proc.stdout, re.MULTILINE), proc.stdout
