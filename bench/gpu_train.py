"""bf16 training steps on one device: llmflow's production step against transformers.

- ``llmflow``: ``llmflow.train.loop.setup`` and ``train_step``, what ``llmflow train`` runs
  on one worker: a one-rank process group, FSDP2 mixed precision (bf16 compute, fp32 master
  weights and gradient reduction), ``compile: true`` (each decoder layer compiled), fused
  AdamW, the data read from a Megatron indexed dataset, gradient clipping at 1.0 and the
  non-finite guard;
- ``transformers``: ``LlamaForCausalLM`` with fp32 master weights under ``torch.autocast``
  bf16 (as the HF Trainer's ``bf16=True``), ``torch.compile(model)``, Liger-Kernel's Llama
  kernels (fused linear cross-entropy, RMSNorm, RoPE, SwiGLU) when ``liger_kernel`` is
  importable, fused AdamW and clipping at 1.0, on the same samples (``shift_labels``: the
  same targets as llmflow's).

Each round builds each side afresh (the order alternating; compiled code is reset in
between, so each round compiles again, from Inductor's warm cache after the first), trains
``warmup`` steps (compilation happens there) and times ``steps`` more, synchronising the device before
every clock read; device memory is ``max_memory_allocated`` per side (peak RSS of the whole
process on CPU).
"""

from __future__ import annotations

import gc
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.flops import synchronize
from bench.machine import peak_memory_mib

LIGER_MISSING = "liger_kernel is not importable: the transformers side runs without Liger-Kernel"


@dataclass
class SideResult:
    """One side's rounds."""

    side: str
    tokens_per_s: list[float] = field(default_factory=list)
    first_loss: list[float] = field(default_factory=list)
    first_step_s: list[float] = field(default_factory=list)
    memory_gib: float = 0.0


def write_assets(work: Path, shape: dict, samples: int, seq: int, device: torch.device) -> tuple[Path, Path]:
    """A random Llama-shaped HF model (fp32, seeded) and ``samples`` samples of random tokens
    as a Megatron indexed dataset; returns (model dir, data prefix)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir, data = work / "model", work / "data_text_document"
    torch.manual_seed(1234)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    model.save_pretrained(model_dir)
    del model
    write_tokens(data, shape["vocab_size"], samples * seq + 1)
    return model_dir, data


def write_tokens(prefix: Path, vocab_size: int, count: int) -> None:
    """``count`` random token ids (seeded) as one document of a Megatron indexed dataset."""
    from llmflow.data.indexed import IndexedDatasetWriter, optimal_token_dtype

    writer = IndexedDatasetWriter(prefix, optimal_token_dtype(vocab_size))
    writer.add_document(np.random.default_rng(0).integers(0, vocab_size, count))
    writer.finalize()


def train_config(model_dir: Path, data: Path, out: Path, seq: int, micro_batch: int, steps: int, compile: bool,
                 dtype: str = "bf16"):
    from llmflow.train.config import DataConfig, OptimConfig, TrainConfig

    return TrainConfig(model=model_dir, out=out, data=DataConfig(paths=[str(data)]), steps=steps, seq_length=seq,
                       micro_batch_size=micro_batch, global_batch_size=micro_batch, dtype=dtype, compile=compile,
                       optim=OptimConfig(lr=1e-4, decay="constant"), save_interval=None, log_interval=steps)


def join_one_rank_group(device: torch.device) -> None:
    """The environment torchrun gives a single worker, so ``setup`` joins a one-rank group."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    os.environ["LLMFLOW_DEVICE"] = device.type


def _free(device: torch.device) -> None:
    """Drop the previous side's model: compiled code holds references to it until reset."""
    torch._dynamo.reset()
    gc.collect()
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        module.empty_cache()
        module.reset_peak_memory_stats(device)


def _timed(step_fn, total: int, device: torch.device) -> tuple[list[float], float]:
    """Run ``step_fn(step)`` for steps 1..total; returns (seconds of each step, first loss)."""
    times, first = [], float("nan")
    for step in range(1, total + 1):
        synchronize(device)
        start = time.perf_counter()
        loss = step_fn(step)
        synchronize(device)
        times.append(time.perf_counter() - start)
        first = loss if step == 1 else first
    return times, first


def llmflow_run(config):
    """``llmflow train``'s worker set up on this process (``setup``), in training mode."""
    from llmflow.train.loop import setup

    run = setup(config)
    for part in run.parts:
        part.train()
    return run


def llmflow_round(config, device: torch.device) -> tuple[list[float], float]:
    from llmflow.train.loop import train_step

    run = llmflow_run(config)
    return _timed(lambda step: train_step(run, step)[0], config.steps, device)


def peer_step(config, device: torch.device, params: list[torch.nn.Parameter],
              forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]) -> Callable[[int], list[float]]:
    """A transformers model's training step ``n`` on the samples llmflow's data source reads
    for step ``n``: ``forward(ids, targets)`` returns the loss to backpropagate, then any other
    values to report; backward, clipping at ``config.optim.clip_grad`` and AdamW with
    ``config.optim``'s settings (fused), as ``llmflow train`` runs them. Returns the values."""
    from llmflow.train.data import collate
    from llmflow.train.loop import data_source

    o = config.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True)
    samples, mb = data_source(config), config.micro_batch_size

    def step(n: int) -> list[float]:
        batch = collate([samples[(n - 1) * mb + j] for j in range(mb)])
        values = forward(batch["input_ids"].to(device), batch["targets"].to(device))
        values[0].backward()
        torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return [v.item() for v in values]

    return step


def transformers_round(config, device: torch.device, compile: bool, liger: bool) -> tuple[list[float], float]:
    from transformers import LlamaForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # patches transformers' Llama classes for the models built after it
    model = LlamaForCausalLM.from_pretrained(config.model, dtype=torch.float32).to(device)
    model.train()
    compiled = torch.compile(model) if compile else model

    def forward(ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return (compiled(input_ids=ids, labels=targets, shift_labels=targets).loss,)

    step = peer_step(config, device, list(model.parameters()), forward)
    return _timed(lambda n: step(n)[0], config.steps, device)


def liger_available() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def train_rounds(config, device: torch.device, rounds: int, warmup: int, compile: bool,
                 liger: bool) -> dict[str, SideResult]:
    """``rounds`` rounds of both sides, alternating; tokens/s over the steps after ``warmup``."""
    join_one_rank_group(device)
    tokens = config.micro_batch_size * config.seq_length
    results = {"llmflow": SideResult("llmflow"), "transformers": SideResult("transformers")}
    for r in range(rounds):
        for side in ("llmflow", "transformers") if r % 2 == 0 else ("transformers", "llmflow"):
            _free(device)
            if side == "llmflow":
                times, loss = llmflow_round(config, device)
            else:
                times, loss = transformers_round(config, device, compile, liger)
            result = results[side]
            result.tokens_per_s.append(tokens / statistics.median(times[warmup:]))
            result.first_loss.append(loss)
            result.first_step_s.append(times[0])
            result.memory_gib = max(result.memory_gib, peak_memory_mib(device) / 1024)
            print(f"train round {r + 1}/{rounds} {side}: {result.tokens_per_s[-1]:,.0f} tok/s, first step "
                  f"{times[0]:.1f} s, first loss {loss:.4f}", flush=True)
    _free(device)
    return results
