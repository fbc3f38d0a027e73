"""Multi-head Latent Attention + mixture-of-experts training-step benchmark: llmflow's
DeepSeek-V3 against transformers' DeepseekV3ForCausalLM.

One training step (forward, backward, gradient clipping at 1.0, AdamW) on the same weights
and samples, CPU, fp32, one process, for a DeepSeek-V3-shaped model shrunk to fit two cores
(``CONFIG``: low-rank queries and a compressed key/value latent with a decoupled rotary part,
a dense first layer, then the sigmoid router with its correction bias choosing the top-4 of
16 experts within the 2 best of 4 groups, renormalised and scaled by 2.5, beside one shared
expert; no auxiliary loss, as transformers trains it). Four sides, each in its own subprocess
(all import the same libraries, so peak resident memory is measured per side), as
bench/moe_step.py runs them:

- ``transformers``: ``DeepseekV3ForCausalLM`` as ``from_pretrained`` sets it up: SDPA
  attention and its default experts implementation, ``grouped_mm``; the samples llmflow's
  data source reads (``shift_labels``: the same targets), clipping and AdamW as
  ``llmflow train`` sets them up (fused);
- ``transformers+compile``: the same model through ``torch.compile(model)``;
- ``llmflow``: what ``llmflow train`` runs on one worker, ``setup`` then ``train_step``, the
  decoder eager (the training default, ``compile: false``);
- ``llmflow+compile``: with the training config's ``compile: true`` (``apply_compile``).

A round runs every side once (the order reversed every other round), each side timing
``--steps`` steps after ``--warmup`` warm-up steps (``--eager-warmup`` for the eager sides);
compilation happens in the first warm-up step and its time (that step less a timed step) is
reported, not counted. Inductor's cache starts empty in each run, so the first round
compiles cold and later rounds reuse the cache. Per round, each llmflow side's tokens/s is
divided by each transformers side's; the median and spread (min-max) of each ratio over the
rounds are printed, with llmflow eager against the faster transformers side of the round.
The first-step losses of every side must agree with transformers eager within
``LOSS_TOLERANCE``.

Achieved FLOP/s = 6 x the active matmul weights a token goes through (``mla_moe_flops_per_token``)
plus 6 x layers x heads x (query/key head width + value head width) x seq for attention,
times tokens/s, shown as a fraction of the best fp32 2048^3 matmul on the same threads,
measured between the rounds.

    python -m bench.mla_moe_step [--rounds 5] [--steps 3] [--warmup 2] [--eager-warmup 1] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.flops import measured_peak_flops
from bench.gpu_train import peer_step, train_config, write_tokens
from bench.moe_step import (
    DATA,
    PEAK_N,
    SIDES,
    current_row,
    llmflow_step,
    machine,
    parse_counts,
    run_rounds,
    step_parser,
    summarise,
    tables,
    timed_steps,
)
from bench.results import update_results
from bench.train_step import run_child

CONFIG = {
    "vocab_size": 32000, "hidden_size": 512, "num_hidden_layers": 4, "first_k_dense_replace": 1,
    "intermediate_size": 1280, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 192,
    "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 256, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "tie_word_embeddings": False, "max_position_embeddings": 2048,
}
"""DeepSeek-V3 (hidden 7168, 61 layers of which the first 3 dense, 128 heads, q_lora_rank
1536, kv_lora_rank 512, qk_nope/qk_rope/v head widths 128/64/128, 256 routed experts top-8
in 8 groups keeping 4, 1 shared expert of width 2048) shrunk to two cores: hidden 512, 4
layers of which the first dense, 8 heads of 64 + 32 rotary (values 64), q_lora_rank 192,
kv_lora_rank 128, 16 experts top-4 in 4 groups keeping 2, 1 shared expert of width 256; the
dense layer's width is the MoE layers' active width (5 x 256, as 18432 is 9 x 2048 there)."""
LOSS_TOLERANCE = 1e-5
"""Largest first-step loss difference (absolute, fp32, losses ~10.4) allowed between any side
and transformers eager: the same sums in another order differ by a few roundings."""


def mla_moe_flops_per_token(config: dict, seq: int) -> tuple[int, float]:
    """(active matmul weights per token, training FLOPs per token) of the DeepSeek-V3 config."""
    h, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    attention = (h * q_rank + q_rank * heads * (nope + rope) + h * (kv_rank + rope)
                 + kv_rank * heads * (nope + v) + heads * v * h)
    dense = config["first_k_dense_replace"]
    experts = (config["num_experts_per_tok"] + config["n_shared_experts"]) * 3 * h * config["moe_intermediate_size"]
    moe = h * config["n_routed_experts"] + experts
    active = layers * attention + dense * 3 * h * config["intermediate_size"] + (layers - dense) * moe
    active += config["vocab_size"] * h
    return active, 6 * active + 6 * layers * heads * (nope + rope + v) * seq


def transformers_step(side: str, config, device: torch.device):
    """transformers' model and its training step (``peer_step``: the samples llmflow's data
    source reads, forward with ``shift_labels``, llmflow's targets, then clipping and AdamW as
    ``llmflow train`` sets them); the step returns [loss]."""
    import transformers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(config.model, dtype=torch.float32).to(device)
    model.train()
    implementation = model.config._experts_implementation
    assert implementation == "grouped_mm", f"transformers' experts implementation is {implementation}"
    compiled = torch.compile(model) if side.endswith("+compile") else model

    def forward(ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        return (compiled(input_ids=ids, labels=targets, shift_labels=targets).loss,)

    return peer_step(config, device, list(model.parameters()), forward)


def run_side(side: str, model_dir: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """Runs in a child process: train warm-up and timed steps, report timings and memory."""
    torch.manual_seed(0)
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as out:
        config = train_config(Path(model_dir), Path(model_dir) / DATA, Path(out), seq, batch, warmup + steps,
                              side.endswith("+compile"), dtype="fp32")
        step = transformers_step(side, config, device) if side.startswith("transformers") else llmflow_step(config, device)
        result, losses = timed_steps(side, step, batch * seq, steps, warmup, device)
    return {**result, "first_loss": losses[0][0]}


def make_model(directory: str, config: dict) -> None:
    """Random weights of ``config`` saved in ``directory`` (transformers' own initialisation:
    normal(0, 0.02) for every matrix, the router and the experts included; zero correction bias)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(1234)
    DeepseekV3ForCausalLM(DeepseekV3Config(**config)).save_pretrained(directory)


def bench(args: argparse.Namespace, sides: tuple[str, ...], peaks: list[float], loads: list[float]) -> dict:
    """Every round; appends the peaks measured and the load average at each round's start."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as cache:
        make_model(model_dir, args.config)
        longest = max(args.warmup, args.eager_warmup or args.warmup) + args.steps
        write_tokens(Path(model_dir) / DATA, args.config["vocab_size"], longest * args.batch * args.seq + 1)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            peaks.append(measured_peak_flops(torch.device("cpu"), torch.float32, n=PEAK_N["cpu"]))
            for side in sides if r % 2 == 0 else reversed(sides):
                result = run_child(side, model_dir, args, env, module="bench.mla_moe_step")
                runs[side].append(result)
                print(f"round {r + 1}/{args.rounds} {side}: {result['tokens_per_s']:.0f} tok/s "
                      f"({result['step_s']:.2f} s/step, CPU {result['cpu_s']:.2f} s), first step {result['first_step_s']:.1f} s, "
                      f"loss {result['first_loss']:.6f}, peak {result['peak_mib']:.0f} MiB", flush=True)
    reference = runs["transformers"][0]
    loss_diff = max(abs(run["first_loss"] - reference["first_loss"]) for side in sides for run in runs[side])
    if loss_diff > LOSS_TOLERANCE:
        sys.exit(f"bench.mla_moe_step: first-step losses differ by {loss_diff:.2e} (tolerance {LOSS_TOLERANCE:.0e}): "
                 "the sides did not compute the same step")
    _, flops = mla_moe_flops_per_token(args.config, args.seq)
    summary, ratios = summarise(runs, flops, args.rounds)
    return {"sides": summary, "ratios": ratios, "loss_diff": loss_diff, "loss": reference["first_loss"],
            "threads": reference["threads"]}


def describe_config(c: dict, seq: int) -> str:
    active, flops = mla_moe_flops_per_token(c, seq)
    return (f"DeepSeek-V3, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers ("
            f"{c['first_k_dense_replace']} dense of width {c['intermediate_size']}, then mixture of experts), {c['num_attention_heads']} heads, "
            f"MLA q_lora_rank {c['q_lora_rank']}, kv_lora_rank {c['kv_lora_rank']}, qk_nope {c['qk_nope_head_dim']}, "
            f"qk_rope {c['qk_rope_head_dim']}, v {c['v_head_dim']}; {c['n_routed_experts']} experts, "
            f"top-{c['num_experts_per_tok']} within the {c['topk_group']} best of {c['n_group']} groups (sigmoid, "
            f"renormalised, x {c['routed_scaling_factor']}), {c['n_shared_experts']} shared expert, width "
            f"{c['moe_intermediate_size']}; vocabulary {c['vocab_size']}, untied; model FLOPs per token = 6 x "
            f"{active / 1e6:.2f}M active matmul weights (q_a, q_b, kv_a, kv_b, o, router or dense MLP, k + shared "
            f"experts' gate/up/down, output layer) + 6 x layers x heads x (qk_nope + qk_rope + v) x seq = "
            f"{flops / 1e9:.3f} GFLOP")


def report(row: dict, args: argparse.Namespace, peak: float, loads: list[float], load_after: float) -> list[str]:
    """The History entry (markdown lines)."""
    import transformers

    load = ", ".join(f"{x:.1f}" for x in loads)
    return [
        (f"### mla_moe_step ({time.strftime('%Y-%m-%d')}, {machine(torch.device('cpu'))}, torch "
         f"{torch.__version__}, transformers {transformers.__version__}, {row['threads']} threads, load average "
         f"{load} at the rounds' starts, {load_after:.1f} after)"),
        "",
        (f"`python -m bench.mla_moe_step --rounds {args.rounds} --steps {args.steps} --warmup {args.warmup} "
         f"--eager-warmup {args.eager_warmup or args.warmup}"
         f"{' --sides ' + ' '.join(args.sides) if args.sides != list(SIDES) else ''}`: "
         f"batch {args.batch} x seq {args.seq}, fp32, forward+backward+clipping+AdamW (fused), each side in its own "
         f"process; {args.rounds} rounds, sides alternating; tokens/s = median of {args.steps} steps after "
         f"{args.warmup} warm-up steps ({args.eager_warmup or args.warmup} on the eager sides). transformers: "
         f"`DeepseekV3ForCausalLM`, SDPA attention, experts_implementation `grouped_mm` (its default). Peak = best "
         f"fp32 {PEAK_N['cpu']}^3 matmul over all rounds: {peak / 1e9:.1f} GFLOP/s. Peak memory: each process "
         f"high-water RSS."),
        "",
        (f"{describe_config(args.config, args.seq)}. First-step loss {row['loss']:.6f}; every side within "
         f"{row['loss_diff']:.1e} (tolerance {LOSS_TOLERANCE:.0e})."),
        "",
        *tables(row, peak),
        "",
    ]


def record(row: dict, args: argparse.Namespace, entry: list[str], loads: list[float]) -> None:
    """Append ``entry`` to History and replace this benchmark's row of the Current table."""
    description = (f"transformers `DeepseekV3ForCausalLM` train step (MLA, grouped_mm experts, group-limited sigmoid "
                   f"routing), eager and `torch.compile`, the faster of the two each round (fp32, DeepSeek-V3 shape "
                   f"shrunk: 16 experts top-4, batch {args.batch} x {args.seq}, same first-step loss)")
    update_results([current_row("bench.mla_moe_step", description, row, args, loads)], entry)


def main() -> None:
    parser = step_parser(__doc__)
    parser.add_argument("--seq", type=int, default=512)
    args = parse_counts(parser)
    args.config = CONFIG
    if args.child:
        print(json.dumps(run_side(args.child[0], args.child[1], args.batch, args.seq, args.steps, args.warmup)))
        return
    run_rounds(args, bench, report, record)


if __name__ == "__main__":
    main()
