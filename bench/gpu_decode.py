"""Greedy decoding on one device, bf16: llmflow's KV-cache ``generate`` against transformers'
``generate`` with its static cache (``cache_implementation="static"``, which transformers
compiles by itself on CUDA: ``torch.compile`` in "reduce-overhead" mode), on the same weights
and prompts (``bench.generate``'s prompts: random ids of different lengths, left-padded in a
batch), every row generating exactly ``new_tokens`` tokens. llmflow runs ``decode: compiled``
(its static cache and compiled step) when ``compile`` is on, else its eager step; the
transformers side then runs its static cache uncompiled (transformers compiles on CUDA only).
Rounds alternate the sides; the device is synchronised before every clock read and
``max_memory_allocated`` is taken per side (both models stay loaded: it includes the
other side's weights, said in the report). Batch 1 is also measured against the memory
roofline (bench/roofline.py): the bytes a step reads times its steps per second."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from bench.flops import synchronize
from bench.generate import prompts
from bench.roofline import decode_step_bytes


def _llmflow(model_dir: Path, device: torch.device, vocab_size: int, compile: bool):
    from tokenizers import Tokenizer, models

    from llmflow.infer import GenerateConfig, generate
    from llmflow.weights import load_hf_model

    model = load_hf_model(model_dir, dtype=torch.bfloat16, device=device).eval()
    # One word per id: generate decodes its tokens to text as it goes.
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))

    def run(rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        config = GenerateConfig(max_new_tokens=new_tokens, decode="compiled" if compile else "eager")
        return [r.tokens for r in generate(model, tokenizer, rows, config)]

    return run


def _transformers(model_dir: Path, device: torch.device):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()

    def run(rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, cache_implementation="static")
        return out[:, width:].tolist()

    return run


def decode_rounds(model_dir: Path, device: torch.device, vocab_size: int, batches: list[int], new_tokens: int,
                  rounds: int, compile: bool) -> list[dict]:
    """Per batch size: tokens/s of each side (median and spread over the rounds), the share of
    rows whose tokens agree, each side's peak device memory, and the bytes a batch-1 step
    reads (at the prompts' mean length plus half the new tokens)."""
    shape = json.loads((model_dir / "config.json").read_text())
    runners = {"llmflow": _llmflow(model_dir, device, vocab_size, compile),
               "transformers": _transformers(model_dir, device)}
    rows = []
    for batch in batches:
        rates: dict[str, list[float]] = {side: [] for side in runners}
        tokens: dict[str, list[list[int]]] = {}
        memory: dict[str, float] = {}
        for side, run in runners.items():
            run(prompts(batch), 4)  # warm-up: a compiled step compiles (and captures) for this batch shape
        for r in range(rounds):
            for side in runners if r % 2 == 0 else reversed(list(runners)):
                if device.type != "cpu":
                    torch.get_device_module(device.type).reset_peak_memory_stats(device)
                synchronize(device)
                start = time.perf_counter()
                tokens[side] = runners[side](prompts(batch), new_tokens)
                synchronize(device)
                rates[side].append(batch * new_tokens / (time.perf_counter() - start))
                if device.type != "cpu":
                    memory[side] = torch.get_device_module(device.type).max_memory_allocated(device) / 2**30
        ratios = [o / t for o, t in zip(rates["llmflow"], rates["transformers"], strict=True)]
        same = sum(a == b for a, b in zip(tokens["llmflow"], tokens["transformers"], strict=True)) / batch
        context = statistics.mean(map(len, prompts(batch))) + new_tokens / 2
        step_bytes = decode_step_bytes(shape, batch, context, value_bytes=2)
        rows.append({"batch": batch, "rates": {s: statistics.median(v) for s, v in rates.items()},
                     "ratio": (statistics.median(ratios), min(ratios), max(ratios)), "same_rows": same,
                     "memory_gib": memory, "step_bytes": step_bytes})
        print(f"decode batch {batch}: llmflow {rows[-1]['rates']['llmflow']:,.1f} tok/s, transformers "
              f"{rows[-1]['rates']['transformers']:,.1f} tok/s, same tokens in {same:.0%} of rows", flush=True)
    return rows
