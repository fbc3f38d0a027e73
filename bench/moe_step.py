"""Mixture-of-experts training-step benchmark: llmflow's Qwen3-MoE against transformers'
Qwen3MoeForCausalLM.

One training step (forward, backward, gradient clipping at 1.0, AdamW) on the same weights
and samples, CPU, fp32, one process,
for a Qwen3-30B-A3B-shaped model shrunk to fit two cores (GQA, q/k norms, every layer sparse,
top-8 of 32 experts with renormalised weights, load-balancing auxiliary loss at
``router_aux_loss_coef`` 0.001). Four sides, each in its own subprocess (all import the same
libraries, so peak resident memory is measured per side):

- ``transformers``: ``Qwen3MoeForCausalLM`` as ``from_pretrained`` sets it up: SDPA attention
  and its default experts implementation, ``grouped_mm`` (``F.grouped_mm`` over the experts'
  stacked ``gate_up_proj``/``down_proj``; transformers 5's other choices are ``eager``, a
  Python loop over the experts, and ``batched_mm``, which gathers every token's k expert
  matrices); ``output_router_logits`` on, so its loss includes the auxiliary loss; the
  samples llmflow's data source reads (``shift_labels``: the same targets), clipping and
  AdamW as ``llmflow train`` sets them up (fused);
- ``transformers+compile``: the same model through ``torch.compile(model)``, as
  transformers' and PyTorch's training guides recommend (in fp32 its experts then run its
  ``grouped_mm_fallback`` custom op: Inductor takes ``grouped_mm`` in bf16 only);
- ``llmflow``: what ``llmflow train`` runs on one worker, ``setup`` then ``train_step``: a
  one-rank process group, the decoder eager (the training default, ``compile: false``), the
  data read from a Megatron indexed dataset of random tokens, the auxiliary loss at the
  coefficient of config.json, clipping, AdamW and the non-finite guard;
- ``llmflow+compile``: with the training config's ``compile: true`` (``apply_compile``).

A round runs every side once (the order reversed every other round), each side timing
``--steps`` steps after ``--warmup`` warm-up steps (``--eager-warmup`` for the eager sides);
compilation happens in the first warm-up step and its time (that step less a timed step) is
reported, not counted. Inductor's cache starts empty in each run, so the first round
compiles cold and later rounds reuse the cache.
Per round, each llmflow side's tokens/s is divided by each transformers side's; the median
and spread (min-max) of each ratio over the rounds are printed, with llmflow eager against
the faster transformers side of the round (the bar: 1.5x). The first-step losses (cross
entropy + 0.001 x auxiliary loss) of every side must agree with transformers eager within
``LOSS_TOLERANCE``, and so must their auxiliary losses within ``AUX_TOLERANCE``.

Achieved FLOP/s = model FLOPs per token of the weights a token goes through (6 x the active
matmul weights: attention, router, its k experts' SwiGLU and the output layer, plus
12 x layers x heads x head_dim x seq for attention) x tokens/s, shown as a fraction of the
machine's measured peak: the best fp32 2048^3 matmul on the same threads, measured between
the rounds.

``--device cuda`` runs the same sides on one GPU in bf16 (``--dtype``), on four of
Qwen3-30B-A3B's own layers (``DEVICE_CONFIG``): llmflow's step as ``llmflow train`` runs it
there (FSDP2 mixed precision: bf16 compute over fp32 master weights), transformers' model in
bf16 weights (its ``grouped_mm`` experts run natively in eager and compiled); peak memory is
``max_memory_allocated``. ``--dtype bf16`` on the CPU runs that code path on the small model.

    python -m bench.moe_step [--rounds 5] [--steps 3] [--warmup 2] [--eager-warmup 1] [--record]
    python -m bench.moe_step --device cuda [--rounds 3] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.flops import measured_peak_flops, synchronize
from bench.gpu_train import join_one_rank_group, llmflow_run, peer_step, train_config, write_tokens
from bench.machine import cpu_model, peak_memory_mib
from bench.results import update_results
from bench.train_step import run_child, spread

CONFIG = {
    "vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768, "num_experts": 32,
    "num_experts_per_tok": 8, "moe_intermediate_size": 128, "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001, "output_router_logits": True, "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}
"""Qwen3-30B-A3B (hidden 2048, 48 layers, 32 heads / 4 KV of 128, 128 experts, top-8 of
width 768, vocabulary 151,936, untied) shrunk to two cores: hidden 256 with 8 heads / 2 KV
of 64 (attention twice the hidden width, as there), 32 experts, top-8 of width 128 (a
token's experts 4x the hidden width, as 8 x 768 is 3x 2048 there), 4 layers, vocabulary
8,192 (small enough that the output layer, the same matmul on every side, does not hide
the experts)."""
DEVICE_CONFIG = {
    **CONFIG, "vocab_size": 32768, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "num_experts": 128, "moe_intermediate_size": 768,
    "max_position_embeddings": 4096,
}
"""``--device cuda``: ``CONFIG``'s routing (top-8, renormalised, aux loss 0.001) and 4 layers,
the layers being Qwen3-30B-A3B's as published (hidden 2048, 32 heads / 4 KV of 128, 128
experts of width 768; 4 of its 48), vocabulary 32,768 (the output layer would otherwise be
most of the active weights): 2.6B parameters, 0.3B active matmul weights per token."""
SIDES = ("transformers", "transformers+compile", "llmflow", "llmflow+compile")
BASELINES = ("transformers", "transformers+compile")
OURS = ("llmflow", "llmflow+compile")
TARGET = 1.5
"""The bar: llmflow's eager MoE step at least this times the faster transformers side."""
SHAPE_NAMES = {"cpu": "Qwen3-30B-A3B shape shrunk: 32 experts top-8", "cuda": "4 of Qwen3-30B-A3B's layers: 128 experts top-8"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEAK_N = {"cpu": 2048, "cuda": 8192}
"""Size of the square matmul whose best FLOP/s is the device's measured peak."""
BF16_SIDES = " (llmflow: bf16 compute over fp32 master weights, FSDP2 mixed precision; transformers: bf16 weights)"
TOLERANCES = {"fp32": (1e-5, 1e-5), "bf16": (5e-2, 5e-2)}
"""Largest first-step loss and auxiliary-loss differences (absolute) allowed between any side
and transformers eager. fp32 (losses ~9.1, auxiliary ~8: top-k, its value at perfect
balance): the same sums in another order differ by a few roundings. bf16: llmflow computes
in bf16 from fp32 master weights and transformers in bf16 weights, with the same values (the
model is saved in bf16), but each rounds its intermediate results in its own places."""


def moe_flops_per_token(config: dict, seq: int) -> tuple[int, float]:
    """(active matmul weights per token, training FLOPs per token) of the MoE config."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    experts = config["num_experts_per_tok"] * 3 * h * config["moe_intermediate_size"]
    per_layer = h * q + 2 * h * kv + q * h + h * config["num_experts"] + experts
    active = layers * per_layer + config["vocab_size"] * h
    return active, 6 * active + 12 * layers * q * seq


DATA = "data_text_document"
"""The benchmark's random token ids (a Megatron indexed dataset) in the model directory."""


def transformers_step(side: str, config, device: torch.device):
    """transformers' model and its training step (``peer_step``: the samples llmflow's data
    source reads, forward with ``shift_labels``, llmflow's targets, then clipping and AdamW as
    ``llmflow train`` sets them); the step returns (loss, auxiliary loss). In bf16 the weights
    themselves are bf16 (``from_pretrained(dtype=torch.bfloat16)``): its experts'
    ``grouped_mm`` then runs natively under torch.compile too."""
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(config.model, dtype=DTYPES[config.dtype]).to(device)
    model.train()
    implementation = model.config._experts_implementation
    assert implementation == "grouped_mm", f"transformers' experts implementation is {implementation}"
    compiled = torch.compile(model) if side.endswith("+compile") else model

    def forward(ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = compiled(input_ids=ids, labels=targets, shift_labels=targets)
        return out.loss, out.aux_loss

    return peer_step(config, device, list(model.parameters()), forward)


def llmflow_step(config, device: torch.device):
    """``llmflow train``'s worker on one process (``setup``, then ``train_step``); returns
    (loss as transformers reports it: cross entropy + coefficient x auxiliary loss, auxiliary loss)."""
    from llmflow.train.loop import train_step

    join_one_rank_group(device)
    run = llmflow_run(config)

    def step(n: int) -> tuple[float, float]:
        loss = train_step(run, n)[0]
        aux = float(run.routing.aux_sum)
        return loss + run.routing.aux_loss_coef * aux, aux

    return step


def timed_steps(side: str, step, tokens: int, steps: int, warmup: int,
                device: torch.device) -> tuple[dict, list]:
    """``step(n)`` for n = 1 .. warmup + steps: (``side``'s timings of the steps after ``warmup``
    on ``tokens`` tokens a step, its first step's time, peak memory and threads; what each step
    returned)."""
    times, cpu, values = [], [], []
    for n in range(1, warmup + steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        values.append(step(n))
        synchronize(device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    step_s = statistics.median(times[warmup:])
    return {
        "side": side,
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "cpu_s": statistics.median(cpu[warmup:]),
        "first_step_s": times[0],
        "peak_mib": peak_memory_mib(device),
        "threads": torch.get_num_threads(),
    }, values


def run_side(side: str, model_dir: str, batch: int, seq: int, steps: int, warmup: int, device: torch.device,
             dtype: str) -> dict:
    """Runs in a child process: train warm-up and timed steps, report timings and memory."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        config = train_config(Path(model_dir), Path(model_dir) / DATA, Path(out), seq, batch, warmup + steps,
                              side.endswith("+compile"), dtype=dtype)
        step = transformers_step(side, config, device) if side.startswith("transformers") else llmflow_step(config, device)
        result, losses = timed_steps(side, step, batch * seq, steps, warmup, device)
    return {**result, "first_loss": losses[0][0], "first_aux": losses[0][1]}


def make_model(directory: str, config: dict, device: torch.device, dtype: str) -> None:
    """Random weights of ``config`` saved in ``directory`` in ``dtype`` (transformers' own
    initialisation: normal(0, 0.02) for every matrix, the router and the experts included),
    made on ``device``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1234)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))
    model.to(DTYPES[dtype]).save_pretrained(directory)


def summarise(runs: dict[str, list[dict]], flops_per_token: float, rounds: int) -> tuple[dict, dict]:
    """(each side's tokens/s spread, achieved FLOP/s, CPU s/step, peak memory and compile times;
    the speed ratios of every llmflow side against every transformers side, against the faster
    one each round, and in CPU time against the cheaper one) of ``run_side``'s results."""
    summary = {}
    for side, results in runs.items():
        tok = [r["tokens_per_s"] for r in results]
        summary[side] = {
            "tokens_per_s": spread(tok),
            "flops_per_s": statistics.median(tok) * flops_per_token,
            "cpu_s": statistics.median(r["cpu_s"] for r in results),
            "peak_mib": max(r["peak_mib"] for r in results),
            "compile_s": [r["first_step_s"] - r["step_s"] for r in results] if side.endswith("+compile") else None,
        }
    ours = [s for s in OURS if s in runs]
    bases = [s for s in BASELINES if s in runs]
    ratios = {f"{o} / {b}": spread([x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[o], runs[b])])
              for o in ours for b in bases}
    for o in ours:
        ratios[f"{o} / faster transformers"] = spread(
            [runs[o][r]["tokens_per_s"] / max(runs[b][r]["tokens_per_s"] for b in bases) for r in range(rounds)])
    for o in ours:
        ratios[f"{o} / cheaper transformers, CPU time"] = spread(
            [min(runs[b][r]["cpu_s"] for b in bases) / runs[o][r]["cpu_s"] for r in range(rounds)])
    return summary, ratios


def bench(args: argparse.Namespace, sides: tuple[str, ...], peaks: list[float], loads: list[float]) -> dict:
    """Every round; appends the peaks measured and the load average at each round's start."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as cache:
        make_model(model_dir, args.config, args.device, args.dtype)
        longest = max(args.warmup, args.eager_warmup or args.warmup) + args.steps
        write_tokens(Path(model_dir) / DATA, args.config["vocab_size"], longest * args.batch * args.seq + 1)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            peaks.append(measured_peak_flops(args.device, DTYPES[args.dtype], n=PEAK_N[args.device.type]))
            for side in sides if r % 2 == 0 else reversed(sides):
                result = run_child(side, model_dir, args, env, module="bench.moe_step",
                                   extra=("--device", args.device.type, "--dtype", args.dtype))
                runs[side].append(result)
                print(f"round {r + 1}/{args.rounds} {side}: {result['tokens_per_s']:.0f} tok/s "
                      f"({result['step_s']:.2f} s/step, CPU {result['cpu_s']:.2f} s), first step {result['first_step_s']:.1f} s, "
                      f"loss {result['first_loss']:.6f}, aux {result['first_aux']:.6f}, "
                      f"peak {result['peak_mib']:.0f} MiB", flush=True)
    reference = runs["transformers"][0]
    loss_diff = max(abs(run["first_loss"] - reference["first_loss"]) for side in sides for run in runs[side])
    aux_diff = max(abs(run["first_aux"] - reference["first_aux"]) for side in sides for run in runs[side])
    loss_tolerance, aux_tolerance = TOLERANCES[args.dtype]
    if loss_diff > loss_tolerance or aux_diff > aux_tolerance:
        sys.exit(f"bench.moe_step: first-step losses differ by {loss_diff:.2e} (tolerance {loss_tolerance:.0e}), "
                 f"auxiliary losses by {aux_diff:.2e} ({aux_tolerance:.0e}): the sides did not compute the same step")
    _, flops = moe_flops_per_token(args.config, args.seq)
    summary, ratios = summarise(runs, flops, args.rounds)
    return {"sides": summary, "ratios": ratios, "loss_diff": loss_diff, "aux_diff": aux_diff,
            "loss": reference["first_loss"], "aux": reference["first_aux"],
            "threads": reference["threads"]}


def machine(device: torch.device) -> str:
    if device.type == "cpu":
        return f"{cpu_model()}, {os.cpu_count()} cores"
    return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"


def describe_config(c: dict, seq: int) -> str:
    active, flops = moe_flops_per_token(c, seq)
    return (f"Qwen3-MoE, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads / "
            f"{c['num_key_value_heads']} KV of {c['head_dim']}, {c['num_experts']} experts, top-{c['num_experts_per_tok']} "
            f"of width {c['moe_intermediate_size']} (renormalised), vocabulary {c['vocab_size']}, untied, aux loss "
            f"coefficient {c['router_aux_loss_coef']}; model FLOPs per token = 6 x {active / 1e6:.2f}M active matmul "
            f"weights (q, k, v, o, router, k experts' gate/up/down, output layer) + 12 x layers x heads x head_dim x "
            f"seq = {flops / 1e9:.3f} GFLOP")


def tables(row: dict, peak: float) -> list[str]:
    """The sides' table and the speed ratios' table of ``row`` (``summarise``'s), markdown lines;
    achieved FLOP/s shown against ``peak``."""
    lines = [
        "| side | tok/s median (min-max) | CPU s/step (all threads) | achieved GFLOP/s | of peak | peak MiB | compile s (first round, cold; later) |",
        "|---|---|---|---|---|---|---|",
    ]
    for side, s in row["sides"].items():
        t = s["tokens_per_s"]
        compile_s = "-" if s["compile_s"] is None else (
            f"{s['compile_s'][0]:.0f}; {statistics.median(s['compile_s'][1:]) if len(s['compile_s']) > 1 else 0:.0f}")
        lines.append(f"| {side} | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f}) | {s['cpu_s']:.2f} "
                     f"| {s['flops_per_s'] / 1e9:.1f} "
                     f"| {s['flops_per_s'] / peak:.1%} | {s['peak_mib']:.0f} | {compile_s} |")
    lines += ["", "| speed ratio | median | min | max |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['median']:.2f}x | {v['min']:.2f}x | {v['max']:.2f}x |" for k, v in row["ratios"].items()]
    return lines


def report(row: dict, args: argparse.Namespace, peak: float, loads: list[float], load_after: float) -> list[str]:
    """The History entry (markdown lines)."""
    import transformers

    load = ", ".join(f"{x:.1f}" for x in loads)
    eager = row["ratios"]["llmflow / faster transformers"]
    lines = [
        (f"### moe_step ({time.strftime('%Y-%m-%d')}, {machine(args.device)}, torch "
         f"{torch.__version__}, transformers {transformers.__version__}, {row['threads']} threads, load average "
         f"{load} at the rounds' starts, {load_after:.1f} after)"),
        "",
        (f"`python -m bench.moe_step --device {args.device.type} --dtype {args.dtype} --rounds {args.rounds} "
         f"--steps {args.steps} --warmup {args.warmup} --eager-warmup {args.eager_warmup or args.warmup}"
         f"{' --sides ' + ' '.join(args.sides) if args.sides != list(SIDES) else ''}`: "
         f"batch {args.batch} x seq {args.seq}, {args.dtype}{BF16_SIDES if args.dtype == 'bf16' else ''}, "
         f"forward+backward+clipping+AdamW (fused), each side in its own process; "
         f"{args.rounds} rounds, sides alternating; tokens/s = median of {args.steps} steps after {args.warmup} warm-up "
         f"steps ({args.eager_warmup or args.warmup} on the eager sides). transformers: `Qwen3MoeForCausalLM`, "
         f"`output_router_logits=True`, SDPA attention, experts_implementation `grouped_mm` (its default). Peak = "
         f"best {args.dtype} {PEAK_N[args.device.type]}^3 matmul over all rounds: {peak / 1e9:.1f} GFLOP/s. Peak "
         f"memory: {'each process high-water RSS' if args.device.type == 'cpu' else 'max_memory_allocated'}."),
        "",
        (f"{describe_config(args.config, args.seq)}. First-step loss {row['loss']:.6f} (auxiliary {row['aux']:.6f}); "
         f"every side within {row['loss_diff']:.1e} (tolerance {TOLERANCES[args.dtype][0]:.0e}), auxiliary within "
         f"{row['aux_diff']:.1e} ({TOLERANCES[args.dtype][1]:.0e})."),
        "",
        *tables(row, peak),
    ]
    lines += ["", (f"Bar: llmflow eager at least {TARGET}x the faster transformers side: "
              f"{'met' if eager['median'] >= TARGET else 'not met'} ({eager['median']:.2f}x median)."), ""]
    return lines


def current_row(name: str, description: str, row: dict, args: argparse.Namespace, loads: list[float],
                bar: str = "") -> str:
    """This benchmark's row of RESULTS.md's Current table: ``description`` of the sides, then
    llmflow eager's speed against the faster transformers side (and compiled llmflow's), its
    peak memory against the lighter one, the spread, threads and loads."""
    r, s = row["ratios"], row["sides"]
    eager = r["llmflow / faster transformers"]
    memory = s["llmflow"]["peak_mib"] / min(s[b]["peak_mib"] for b in BASELINES if b in s)
    compiled = (f"; compiled llmflow {r['llmflow+compile / faster transformers']['median']:.2f}x"
                if "llmflow+compile / faster transformers" in r else "")
    return (f"| `{name}` | {description} | {eager['median']:.2f}x speed, llmflow eager against the faster "
            f"transformers side{bar}{compiled}; {memory:.2f}x peak memory (llmflow eager against the lighter "
            f"transformers side) | {eager['min']:.2f}x-{eager['max']:.2f}x over {args.rounds} rounds "
            f"| {row['threads']} | {', '.join(f'{x:.1f}' for x in loads)} | {time.strftime('%Y-%m-%d')} |")


def record(row: dict, args: argparse.Namespace, entry: list[str], loads: list[float]) -> None:
    """Append ``entry`` to History and replace this benchmark's row of the Current table."""
    name = f"bench.moe_step{'' if args.device.type == 'cpu' else ' ' + args.device.type}"
    description = (f"transformers `Qwen3MoeForCausalLM` train step (grouped_mm experts, aux loss), eager and "
                   f"`torch.compile`, the faster of the two each round ({args.dtype}, {SHAPE_NAMES[args.device.type]}, "
                   f"batch {args.batch} x {args.seq}, same first-step loss)")
    update_results([current_row(name, description, row, args, loads, f" (bar {TARGET}x)")], entry)


def step_parser(doc: str) -> argparse.ArgumentParser:
    """The command line every train-step benchmark of this kind shares (its own flags added after)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every side, alternating (at least 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps of the compiled sides (compilation happens in the first)")
    parser.add_argument("--eager-warmup", type=int, help="warm-up steps of the eager sides (default: --warmup)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES),
                        help="sides to run (transformers and llmflow always run: the loss check and the ratio need them)")
    parser.add_argument("--record", action="store_true", help="record the result in bench/RESULTS.md")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "MODEL_DIR"), help=argparse.SUPPRESS)
    return parser


def parse_counts(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed command line, each count at least 1."""
    args = parser.parse_args()
    for flag in ("rounds", "steps", "warmup", "eager_warmup", "batch", "seq"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def run_rounds(args: argparse.Namespace, bench, report, record) -> None:
    """The rounds of the sides asked for (transformers and llmflow always), the History entry
    printed, and recorded with ``--record``."""
    args.sides = [s for s in SIDES if s in args.sides or s in ("transformers", "llmflow")]
    peaks: list[float] = []
    loads: list[float] = []
    row = bench(args, tuple(args.sides), peaks, loads)
    entry = report(row, args, max(peaks), loads, os.getloadavg()[0])
    print("\n".join(entry))
    if args.record:
        record(row, args, entry, loads)


def main() -> None:
    parser = step_parser(__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: the shrunk CONFIG; cuda: DEVICE_CONFIG (4 of Qwen3-30B-A3B's layers)")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: fp32 on the CPU, bf16 on a device")
    parser.add_argument("--seq", type=int, help="default: 512 on the CPU, 2048 on a device")
    args = parse_counts(parser)
    args.device = torch.device(args.device)
    args.dtype = args.dtype or ("fp32" if args.device.type == "cpu" else "bf16")
    args.seq = args.seq or (512 if args.device.type == "cpu" else 2048)
    args.config = CONFIG if args.device.type == "cpu" else DEVICE_CONFIG
    if args.child:
        print(json.dumps(run_side(args.child[0], args.child[1], args.batch, args.seq, args.steps, args.warmup,
                                  args.device, args.dtype)))
        return
    if args.device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench.moe_step: torch {torch.__version__} sees no CUDA device (--device cpu runs on this machine)")
    run_rounds(args, bench, report, record)


if __name__ == "__main__":
    main()
