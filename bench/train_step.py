"""Training-step benchmark: llmflow's decoder against transformers' LlamaForCausalLM.

One forward + backward + AdamW step on the same weights and batch, CPU, fp32, one process,
for a ~50M-parameter config and the same config with Qwen's 151,936-token vocabulary. Four
sides, each in its own subprocess (all import the same libraries, so peak resident memory
is measured per side):

- ``transformers``: ``LlamaForCausalLM`` eager;
- ``transformers+compile``: the same model through ``torch.compile(model)``, as transformers'
  and PyTorch's training guides recommend;
- ``llmflow``: llmflow's decoder eager (the training default, ``compile: false``);
- ``llmflow+compile``: with the training config's ``compile: true`` (``apply_compile``:
  ``torch.compile`` of every decoder layer).

A round runs every side once (the order reversed every other round), each side timing
``--steps`` steps after ``--warmup`` warm-up steps (``--eager-warmup`` for the eager sides);
compilation happens in the first warm-up step and its time (that step less a timed step) is
reported, not counted. Inductor's cache starts empty in each run, so the first round
compiles cold and later rounds reuse the cache.
Per round, each llmflow side's tokens/s is divided by each transformers side's; the median
and spread (min-max) of each ratio over the rounds are printed. The first-step losses of
every side must agree with transformers eager within ``LOSS_TOLERANCE``.

Achieved FLOP/s = model FLOPs per token (bench/flops.py: 6N + 12 x layers x hidden x seq) x
tokens/s, shown as a fraction of the machine's measured peak: the best fp32 2048^3 matmul
on the same threads, measured between the rounds.

    python -m bench.train_step [--configs 50m large-vocab] [--rounds 5] [--steps 3] [--warmup 2] [--eager-warmup 1] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.flops import count_flops, describe, measured_peak_flops
from bench.machine import cpu_model, own_memory_mib
from bench.results import update_results
from llmflow.models import ModelConfig

REPO = Path(__file__).resolve().parent.parent

CONFIGS = {
    "50m": {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048},
    "large-vocab": {"vocab_size": 151936, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                    "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048},
}
SIDES = ("transformers", "transformers+compile", "llmflow", "llmflow+compile")
BASELINES = ("transformers", "transformers+compile")
OURS = ("llmflow", "llmflow+compile")
LOSS_TOLERANCE = 1e-5
"""Largest first-step loss difference (absolute, fp32, losses ~10.4-11.9) allowed between
any side and transformers eager: the same sums in another order (fused kernels, Inductor's
fusions) differ by a few fp32 roundings of the loss, ~1e-6 each."""


def build_side(side: str, model_dir: str, tokens: torch.Tensor):
    """The model of ``side`` and a function computing its loss on ``tokens``."""
    if side.startswith("transformers"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        step_model = torch.compile(model) if side.endswith("+compile") else model
        return model, lambda: step_model(input_ids=tokens, labels=tokens).loss

    import transformers  # noqa: F401  (the same imports on every side: equal baseline memory)

    from llmflow.models.parallelize import apply_compile
    from llmflow.weights import load_hf_model

    model = load_hf_model(model_dir)
    model.train()
    if side.endswith("+compile"):
        apply_compile(model)
    labels = torch.cat([tokens[:, 1:], torch.full((tokens.shape[0], 1), -100)], dim=1)
    return model, lambda: model(tokens, labels=labels)


def run_side(side: str, model_dir: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """Runs in a child process: train warm-up and timed steps, report timings and memory."""
    torch.manual_seed(0)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (batch, seq))
    model, loss_fn = build_side(side, model_dir, tokens)
    # The same optimizer on every side: the fused AdamW kernel where torch has one.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times, losses = [], []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step_s = statistics.median(times[warmup:])
    return {
        "side": side,
        "tokens_per_s": batch * seq / step_s,
        "step_s": step_s,
        "first_step_s": times[0],
        "peak_rss_mib": own_memory_mib(),
        "first_loss": losses[0],
    }


def make_model(name: str, directory: str) -> ModelConfig:
    """Random weights of config ``name`` saved in ``directory``; returns their config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    LlamaForCausalLM(LlamaConfig(**CONFIGS[name], tie_word_embeddings=False)).save_pretrained(directory)
    return ModelConfig.from_file(directory)


def run_child(side: str, model_dir: str, args: argparse.Namespace, env: dict[str, str],
              module: str = "bench.train_step", extra: tuple[str, ...] = ()) -> dict:
    """One side's steps in a fresh process of ``module`` (its ``--child`` mode, with ``extra``
    arguments); its JSON result."""
    warmup = args.warmup if side.endswith("+compile") else args.eager_warmup or args.warmup
    cmd = [sys.executable, "-m", module, "--child", side, model_dir, "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(warmup), *extra]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"{module}: the {side} side failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_config(name: str, args: argparse.Namespace, peaks: list[float]) -> dict:
    """Every round of config ``name``; appends the peaks measured between rounds to ``peaks``."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as cache:
        config = make_model(name, model_dir)
        flops = count_flops(config, args.seq)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for r in range(args.rounds):
            peaks.append(measured_peak_flops(torch.device("cpu")))
            for side in SIDES if r % 2 == 0 else reversed(SIDES):
                result = run_child(side, model_dir, args, env)
                runs[side].append(result)
                print(f"{name} round {r + 1}/{args.rounds} {side}: {result['tokens_per_s']:.0f} tok/s, "
                      f"first step {result['first_step_s']:.1f} s, loss {result['first_loss']:.6f}", flush=True)
    reference = runs["transformers"][0]["first_loss"]
    loss_diff = max(abs(run["first_loss"] - reference) for side in SIDES for run in runs[side])
    if loss_diff > LOSS_TOLERANCE:
        sys.exit(f"bench.train_step {name}: first-step losses differ by {loss_diff:.2e} > {LOSS_TOLERANCE:.0e}: "
                 "the sides did not compute the same step")
    sides = {}
    for side, results in runs.items():
        tok = [r["tokens_per_s"] for r in results]
        sides[side] = {
            "tokens_per_s": spread(tok),
            "flops_per_s": statistics.median(tok) * flops.per_token,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
            "compile_s": [r["first_step_s"] - r["step_s"] for r in results] if side.endswith("+compile") else None,
        }
    ratios = {
        f"{ours} / {base}": spread([o["tokens_per_s"] / b["tokens_per_s"] for o, b in zip(runs[ours], runs[base])])
        for ours in OURS for base in BASELINES
    }
    best = [max(runs[s][r]["tokens_per_s"] for s in OURS) / max(runs[s][r]["tokens_per_s"] for s in BASELINES)
            for r in range(args.rounds)]
    ratios["best llmflow / best transformers"] = spread(best)
    return {"config": name, "flops": flops, "sides": sides, "ratios": ratios, "loss_diff": loss_diff}


def report(rows: list[dict], args: argparse.Namespace, peak: float, load_before: tuple, load_after: tuple) -> list[str]:
    """The History entry (markdown lines)."""
    load = ", ".join(f"{x:.1f}" for x in load_before)
    lines = [
        (f"### train_step ({time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores, torch "
         f"{torch.__version__}, {torch.get_num_threads()} threads, load average {load} before, "
         f"{load_after[0]:.1f} after)"),
        "",
        (f"`python -m bench.train_step --configs {' '.join(args.configs)} --rounds {args.rounds} --steps {args.steps} "
         f"--warmup {args.warmup} --eager-warmup {args.eager_warmup or args.warmup}`: batch "
         f"{args.batch} x seq {args.seq}, fp32, forward+backward+AdamW (fused), each side in its own process; "
         f"{args.rounds} rounds, sides alternating; tokens/s = median of {args.steps} steps after {args.warmup} "
         f"warm-up steps ({args.eager_warmup or args.warmup} on the eager sides). Peak = best fp32 2048^3 matmul on the same threads over all rounds: "
         f"{peak / 1e9:.1f} GFLOP/s."),
        "",
    ]
    for row in rows:
        lines += [
            (f"{row['config']}: {describe(row['flops'], args.seq)}; first-step losses agree within "
             f"{row['loss_diff']:.1e} (tolerance {LOSS_TOLERANCE:.0e})."),
            "",
            "| side | tok/s median (min-max) | achieved GFLOP/s | of peak | peak RSS MiB | compile s (first round, cold; later) |",
            "|---|---|---|---|---|---|",
        ]
        for side, s in row["sides"].items():
            t = s["tokens_per_s"]
            compile_s = "-" if s["compile_s"] is None else (
                f"{s['compile_s'][0]:.0f}; {statistics.median(s['compile_s'][1:]) if len(s['compile_s']) > 1 else 0:.0f}")
            lines.append(f"| {side} | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f}) | {s['flops_per_s'] / 1e9:.1f} "
                         f"| {s['flops_per_s'] / peak:.1%} | {s['peak_rss_mib']:.0f} | {compile_s} |")
        lines += ["", "| speed ratio | median | min | max |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['median']:.2f}x | {v['min']:.2f}x | {v['max']:.2f}x |" for k, v in row["ratios"].items()]
        lines.append("")
    return lines


def record(rows: list[dict], args: argparse.Namespace, entry: list[str], load_before: tuple, peak: float) -> None:
    """Append ``entry`` to History and replace this benchmark's rows of the Current table."""
    day = time.strftime("%Y-%m-%d")
    load = ", ".join(f"{x:.1f}" for x in load_before)
    current = []
    for row in rows:
        r, s = row["ratios"], row["sides"]
        eager, compiled = r["llmflow / transformers"], r["llmflow+compile / transformers+compile"]
        best = r["best llmflow / best transformers"]
        memory = s["llmflow"]["peak_rss_mib"] / s["transformers"]["peak_rss_mib"]
        best_side = max(s, key=lambda side: s[side]["flops_per_s"])
        current.append(
            f"| `bench.train_step` {row['config']} | transformers train step, eager and `torch.compile` (fp32, batch "
            f"{args.batch} x {args.seq}, same first-step loss) | {best['median']:.2f}x speed, best against best; "
            f"eager {eager['median']:.2f}x, compiled {compiled['median']:.2f}x; {memory:.2f}x memory (eager); fastest "
            f"side {best_side} at {s[best_side]['flops_per_s'] / peak:.0%} of the measured fp32 matmul peak "
            f"| best {best['min']:.2f}x-{best['max']:.2f}x over {args.rounds} rounds | {torch.get_num_threads()} "
            f"| {load} | {day} |")
    update_results(current, entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every side, alternating (at least 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps of the compiled sides (compilation happens in the first)")
    parser.add_argument("--eager-warmup", type=int, help="warm-up steps of the eager sides (default: --warmup)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--record", action="store_true", help="record the result in bench/RESULTS.md")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("rounds", "steps", "warmup", "eager_warmup", "batch", "seq"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.child:
        print(json.dumps(run_side(args.child[0], args.child[1], args.batch, args.seq, args.steps, args.warmup)))
        return

    load_before = os.getloadavg()
    peaks: list[float] = []
    rows = [bench_config(name, args, peaks) for name in args.configs]
    entry = report(rows, args, max(peaks), load_before, os.getloadavg())
    print("\n".join(entry))
    if args.record:
        record(rows, args, entry, load_before, max(peaks))


if __name__ == "__main__":
    main()
