"""Gated delta rule benchmark: llmflow's ``gated_delta_rule`` (on CPU the chunked torch path with
its hand-written backward) against transformers' ``torch_chunk_gated_delta_rule`` (the torch
path Qwen3-Next and Qwen3.5 run without flash-linear-attention), forward + backward through
autograd, CPU, fp32.

Inputs as the model makes them: B = 1, ``--heads`` heads of 128 for q, k and v (q/k already
repeated to the value heads), q/k L2-normalised in the kernel, g = -exp(A_log) *
softplus(a + dt_bias) with A ~ U(0.01, 16) and dt_bias = 1 (transformers' initialisation),
beta = sigmoid(b). The loss is <output, fixed random tensor>, so backward computes the
gradients of q, k, v, g and beta.

Each side runs in its own process per length and round (both import the same libraries):
``--warmup`` steps then ``--steps`` timed steps, the median reported; peak memory is the
process's peak resident set (VmHWM) less its resident set after building the inputs,
i.e. what forward + backward added at their peak. Rounds alternate the sides' order. In the
first round both sides write their output and gradients at every 16th position; they must agree
within ``TOLERANCE``. The time ratio (transformers / llmflow, > 1 favours llmflow) and the memory
ratio (llmflow / transformers) are given per length as median and spread over the rounds;
growth with length is each side's time and memory at the longest length over the shortest,
against the length ratio (linear = equal).

    python -m bench.gated_delta [--lengths 1024 4096 16384] [--rounds 3] [--steps 2] [--warmup 1] [--threads N] [--record]
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

from bench.machine import cpu_model, own_memory_mib
from bench.results import update_results

REPO = Path(__file__).resolve().parents[1]
SIDES = ("transformers", "llmflow")
HEAD_DIM = 128
SAMPLE_EVERY = 16
"""Positions kept for the output check (every 16th)."""
TOLERANCE = 1e-4
"""Largest abs difference allowed between the sides' outputs and gradients (fp32; the two
chunked forms sum in different orders over up to 256 chunks of state updates)."""


def make_inputs(length: int, heads: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, length, heads, HEAD_DIM, generator=gen) for _ in range(3))
    a_log = torch.empty(heads).uniform_(0.01, 16, generator=gen).log()
    a = torch.randn(1, length, heads, generator=gen)
    g = -a_log.exp() * torch.nn.functional.softplus(a + 1.0)
    beta = torch.randn(1, length, heads, generator=gen).sigmoid()
    return [q, k, v, g, beta]


def run_side(side: str, length: int, heads: int, steps: int, warmup: int, sample: str | None) -> dict:
    """In a child process: the side's forward + backward, timed, with its peak memory."""
    import transformers.models.qwen3_next.modeling_qwen3_next as hf

    import llmflow.kernels as K

    inputs = [x.requires_grad_(True) for x in make_inputs(length, heads)]
    weight = torch.randn(1, length, heads, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    if side == "transformers":
        def forward():
            return hf.torch_chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)[0]
    else:
        def forward():
            return K.gated_delta_rule(*inputs)[0]
    base = own_memory_mib("VmRSS")
    times = []
    for i in range(warmup + steps):
        for x in inputs:
            x.grad = None
        t0 = time.perf_counter()
        out = forward()
        (out * weight).sum().backward()
        times.append(time.perf_counter() - t0)
        if i == 0 and sample:
            keep = slice(None, None, SAMPLE_EVERY)
            torch.save([t[:, keep].clone() for t in [out.detach()] + [x.grad for x in inputs]], sample)
        del out
    return {"side": side, "length": length, "step_s": statistics.median(times[warmup:]),
            "peak_mib": own_memory_mib() - base, "threads": torch.get_num_threads()}


def run_child(side: str, length: int, args: argparse.Namespace, sample: str | None) -> dict:
    cmd = [sys.executable, "-m", "bench.gated_delta", "--child", side, str(length), "--heads", str(args.heads),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if sample:
        cmd += ["--sample", sample]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"bench.gated_delta: the {side} side failed at length {length}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench(args: argparse.Namespace, loads: list[float]) -> dict:
    runs = {(side, n): [] for side in SIDES for n in args.lengths}
    diffs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for n in args.lengths:
                for side in SIDES if r % 2 == 0 else reversed(SIDES):
                    sample = str(Path(tmp) / f"{side}-{n}.pt") if r == 0 else None
                    result = run_child(side, n, args, sample)
                    runs[side, n].append(result)
                    print(f"round {r + 1}/{args.rounds} length {n} {side}: {result['step_s']:.3f} s, "
                          f"peak +{result['peak_mib']:.0f} MiB", flush=True)
                if r == 0:
                    theirs, ours = (torch.load(Path(tmp) / f"{side}-{n}.pt") for side in SIDES)
                    diffs[n] = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
                    if diffs[n] > TOLERANCE:
                        sys.exit(f"bench.gated_delta: outputs or gradients differ by {diffs[n]:.2e} at length {n} "
                                 f"(tolerance {TOLERANCE:.0e}): the sides did not compute the same thing")
    rows = {}
    for n in args.lengths:
        t, o = runs["transformers", n], runs["llmflow", n]
        rows[n] = {
            "transformers_s": spread([x["step_s"] for x in t]), "llmflow_s": spread([x["step_s"] for x in o]),
            "speed": spread([a["step_s"] / b["step_s"] for a, b in zip(t, o)]),
            "transformers_mib": max(x["peak_mib"] for x in t), "llmflow_mib": max(x["peak_mib"] for x in o),
            "memory": spread([b["peak_mib"] / a["peak_mib"] for a, b in zip(t, o)]),
            "diff": diffs[n],
        }
    return {"rows": rows, "threads": runs["llmflow", args.lengths[0]][0]["threads"]}


def report(result: dict, args: argparse.Namespace, loads: list[float], load_after: float) -> list[str]:
    import transformers

    rows = result["rows"]
    short, long_ = min(rows), max(rows)
    lines = [
        (f"### gated_delta ({time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores, torch "
         f"{torch.__version__}, transformers {transformers.__version__}, {result['threads']} threads, load average "
         f"{', '.join(f'{x:.1f}' for x in loads)} at the rounds' starts, {load_after:.1f} after)"),
        "",
        (f"`python -m bench.gated_delta --lengths {' '.join(map(str, args.lengths))} --rounds {args.rounds} "
         f"--heads {args.heads} --steps {args.steps} --warmup {args.warmup}{f' --threads {args.threads}' if args.threads else ''}`: "
         f"B = 1, {args.heads} heads of {HEAD_DIM} (q, k, v), fp32, forward + backward of <output, random>; "
         f"transformers `torch_chunk_gated_delta_rule` (autograd) against llmflow `gated_delta_rule` (CPU: the "
         f"chunked torch path, hand-written backward); each side in its own process, sides alternating; time = "
         f"median of {args.steps} steps after {args.warmup} warm-up (the first step of a process included where 0); peak = peak RSS less RSS with the inputs built."),
        "",
        "| length | transformers s | llmflow s | speed ratio median (min-max) | transformers peak MiB | llmflow peak MiB | memory ratio | max abs diff (outputs, grads) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, row in rows.items():
        s = row["speed"]
        lines.append(f"| {n} | {row['transformers_s']['median']:.3f} | {row['llmflow_s']['median']:.3f} | "
                     f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}) | {row['transformers_mib']:.0f} | "
                     f"{row['llmflow_mib']:.0f} | {row['memory']['median']:.2f}x | {row['diff']:.1e} |")
    if long_ != short:
        growth = long_ / short
        lines += ["", (f"Growth from {short} to {long_} positions ({growth:.0f}x): time transformers "
                       f"{rows[long_]['transformers_s']['median'] / rows[short]['transformers_s']['median']:.1f}x, "
                       f"llmflow {rows[long_]['llmflow_s']['median'] / rows[short]['llmflow_s']['median']:.1f}x; "
                       f"peak memory transformers {rows[long_]['transformers_mib'] / rows[short]['transformers_mib']:.1f}x, "
                       f"llmflow {rows[long_]['llmflow_mib'] / rows[short]['llmflow_mib']:.1f}x.")]
    return lines + [""]


def record(result: dict, args: argparse.Namespace, entry: list[str], loads: list[float]) -> None:
    rows = result["rows"]
    speeds = "; ".join(f"{n}: {r['speed']['median']:.2f}x speed, {r['memory']['median']:.2f}x memory"
                       for n, r in rows.items())
    spreads = "; ".join(f"{n}: {r['speed']['min']:.2f}x-{r['speed']['max']:.2f}x" for n, r in rows.items())
    current = [(f"| `bench.gated_delta` {', '.join(map(str, rows))} | transformers `torch_chunk_gated_delta_rule` forward + backward (fp32, B = 1, "
                f"{args.heads} heads of {HEAD_DIM}, same outputs and gradients) | {speeds} | {spreads} over "
                f"{args.rounds} rounds | {result['threads']} | {', '.join(f'{x:.1f}' for x in loads)} "
                f"| {time.strftime('%Y-%m-%d')} |")]
    update_results(current, entry, stale=lambda row: row.startswith("| `bench.gated_delta` "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (0: the first step is timed)")
    parser.add_argument("--threads", type=int, help="torch threads in each side's process (default: torch's)")
    parser.add_argument("--record", action="store_true", help="record the result in bench/RESULTS.md")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--sample", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("heads", "rounds", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(run_side(args.child[0], int(args.child[1]), args.heads, args.steps, args.warmup,
                                  args.sample)))
        return
    loads: list[float] = []
    result = bench(args, loads)
    entry = report(result, args, loads, os.getloadavg()[0])
    print("\n".join(entry))
    if args.record:
        record(result, args, entry, loads)


if __name__ == "__main__":
    main()
