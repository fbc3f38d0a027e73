"""bench/gpu.py's code paths on the CPU (``--device cpu --tiny``), its refusal of a missing
device, and bench/flops.py's count against transformers' own parameter count."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def run_gpu_bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-m", "bench.gpu", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_kernels_agree_with_their_reference_on_cpu():
    proc = run_gpu_bench("--device", "cpu", "--tiny", "--only", "kernels")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\| (.+?) \| (fp32|bf16) \| \S+ \| .+? \| (yes|NO) \|$", proc.stdout, re.MULTILINE)
    assert len(rows) == 28, proc.stdout
    assert all(ok == "yes" for *_, ok in rows), proc.stdout
    assert "28 of 28 within tolerance" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device")
def test_a_missing_cuda_device_is_a_one_line_error():
    proc = run_gpu_bench("--device", "cuda", timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0
    assert "sees no CUDA device" in proc.stderr and "--device cpu --tiny" in proc.stderr


def test_flop_count_is_transformers_parameters_without_embedding_and_norms():
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.flops import count_flops
    from llmflow.models import ModelConfig

    shape = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
             "num_attention_heads": 8, "num_key_value_heads": 2}
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    total = sum(p.numel() for p in hf.parameters())
    embedding, norms = 1000 * 64, (2 * 3 + 1) * 64
    config = ModelConfig.from_hf({"model_type": "llama", **shape})
    count = count_flops(config, seq_length=128)
    assert count.matmul_params == total - embedding - norms
    assert count.dense == 6 * count.matmul_params
    assert count.attention == 12 * 3 * 64 * 128  # PaLM: 12 x layers x (heads x head_dim) x seq
    assert count.per_token == count.dense + count.attention


@pytest.mark.slow
def test_the_decode_and_training_sections_run_on_a_tiny_model(tmp_path):
    """The kernels section runs above; the precision section is the precision flow, bf16
    against fp32, which tests/test_flows.py runs on the CPU."""
    proc = run_gpu_bench("--device", "cpu", "--tiny", "--only", "decode", "train", "--work", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for heading in ("Decode, greedy, bf16", "Training step, bf16"):
        assert f"#### {heading}" in out
    decode = re.findall(r"^\| (1|8) \| ([\d,.]+) \| ([\d,.]+) \| ", out, re.MULTILINE)
    assert [b for b, *_ in decode] == ["1", "8"] and all(float(x.replace(",", "")) > 0 for _, *r in decode for x in r)
    # Both training sides took the same samples and targets: their bf16 losses agree far more
    # closely than the ~1e-2 by which the loss of other targets of the same random tokens differs.
    diff = float(re.search(r"first-step losses differ by (\S+) \(bf16", out).group(1))
    assert diff < 1e-3


def test_decode_step_bytes_are_transformers_parameters_without_the_embedding():
    """bench/roofline.py's batch-1 read: every parameter of the model but the embedding, one
    embedding row, and the cached keys and values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.roofline import decode_step_bytes

    shape = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    total = sum(p.numel() for p in hf.parameters())
    cache = 2 * 3 * 2 * 8 * 10  # keys and values, layers, KV heads, head_dim, positions
    assert decode_step_bytes(shape, 1, 10, value_bytes=2) == 2 * (total - 1000 * 64 + 64 + cache)


def test_the_profile_of_a_training_step_accounts_for_its_time():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_profile", "--device", "cpu", "--tiny", "--warmup", "1",
                           "--steps", "1", "--top", "5"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    categories = re.findall(r"^\| ([a-z /-]+) \| ([\d,.]+) \| ([\d.]+)% \|$", proc.stdout, re.MULTILINE)
    assert {"matmul", "cross-entropy"} <= {name for name, *_ in categories}
    assert abs(sum(float(share) for *_, share in categories) - 100) < 0.5
    kernels = re.findall(r"^\| `(.+?)` \| ", proc.stdout, re.MULTILINE)
    assert len(kernels) == 5 and "aten::mm" in kernels
