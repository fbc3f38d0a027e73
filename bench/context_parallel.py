"""Context parallelism: ``llmflow train`` with cp=2 on 2 ranks against cp=1 on one rank, the same
long sequences; tokens/s, and memory per rank against the 1/cp context parallelism promises.

Both sides are the real training worker (``torchrun -m llmflow.train``, CPU, gloo, fp32, one
thread per rank) training a random Llama-shaped model (untied embeddings, the sample
tokenizer's 896-token vocabulary, ``--layers`` x ``--hidden``, ``--heads`` heads) on the
tokenized sample corpus packed into samples of ``--seq`` tokens (plain causal attention over
the packed documents), with the same global batch (``--batch`` samples, one micro-batch) and
the same optimizer:

- ``cp=1``: one rank runs every token of every sample; no FSDP (fp32, dp=1);
- ``cp=2``: two ranks each hold half of every sample's tokens and attention reaches the other
  half by ``--cp-algo`` (``models/context_parallel.py``): ``ulysses`` (each rank a contiguous
  half; each attention layer all-to-alls its queries, keys and values to half the heads over
  the whole sequence and the output back) or ``ring`` (each rank two of four chunks; each
  layer all-gathers the keys and values); FSDP2 shards the weights over the two ranks
  (dp*cp), all-gathering each layer for its forward and backward.

The sequence length: the issue asks for the longest that fits cp=1 on this machine, but that
is far beyond what two shared cores run in minutes. The CPU attention kernel here
(``kernels/fused.py``: ``scaled_dot_product_attention`` with ``is_causal``, no document ids)
is torch's flash kernel, which keeps an output and a log-sum-exp per position and never
materialises the [seq, seq] scores, so memory grows linearly with the sequence while the
step time grows quadratically (4 layers, hidden 256: cp=1 steps of 14 s at 8192 tokens and
51 s at 16384 on this machine). The default, 12288 tokens, is the longest multiple of 4096
whose cp=1 step stays near 30 s; activations then hold about four fifths of cp=1's peak.
(With ``data.document_attention`` the kernel takes an explicit boolean mask [seq, seq],
which every cp rank builds over the whole sequence: that part would not fall with cp.)

Memory per rank: each rank's peak RSS (VmHWM, polled from /proc: ``rank_peaks_mib``) over
the whole run. The activations are isolated by difference: every side also trains the same
steps at ``--short`` tokens (same model, batch and layout), and the activation memory per
rank is ``(peak(seq) - peak(short)) * seq / (seq - short)``, for the busiest rank. The
difference removes what does not grow with the sequence (the Python and torch runtime, the
weights, FSDP2's gathered layers, gradients, AdamW state, the optimizer step's temporaries)
and the factor restores the short run's own token-proportional part, which is exact when
that part grows linearly with the tokens (as above). It counts everything a rank holds per
token at its peak: what autograd keeps of each layer, the backward working set of one layer,
the loss's hidden-state gradient and logits, and under cp=2 the all-to-all buffers; the
ratio cp2 / cp1 of it is the figure to hold against 1/cp. RSS counts what the allocator
holds, not only live tensors: glibc serves large blocks from its heap once it has raised its
mmap threshold and keeps what is freed there, which adds more to cp=2's figure than to
cp=1's; ``--mmap-threshold`` sets the workers' ``MALLOC_MMAP_THRESHOLD_``, which fixes the
threshold so that glibc returns every larger freed block to the system. The training
memory plan (``llmflow/train/memory.py``: ``train_plan`` of ``train_shape`` for each side's
config on its ranks) is printed beside it: its per-rank activation term and its peak.

tokens/s is the global batch's tokens over the summed step times (the worker's ``step``
lines) after ``--warmup`` steps; start-up and the final checkpoint are excluded. Each round
runs cp=1 and cp=2 at ``--seq`` back to back (alternating which goes first), then both at
``--short``; ratios are taken per round and the median and spread (min-max) over rounds are
printed, so a burst of load on the shared machine moves one round, not the result. cp=1 and
cp=2 must log the same loss at every step (within 1e-5), at both lengths: the loss does not
depend on the layout.

On a shared machine other people's jobs take CPU time from whichever side runs beside them:
before each launch the benchmark waits (``--max-wait`` seconds in all) until the rest of the
machine is idle, and measures during each launch the cores the rest of the machine used
(``CpuMeter``), printed per run and, as the median, in the result. A round in which other
jobs used more than 0.25 cores during any of its runs is left out of the tokens/s medians
and spreads (all rounds count when none was quiet); memory does not depend on load, and its
medians and spreads take every round.

``--record`` appends the result to bench/RESULTS.md: a row in the Current table (replacing
this benchmark's earlier row) and the full table under History.

    python -m bench.context_parallel [--layers 4] [--hidden 256] [--heads 4] [--seq 12288] [--short 512] [--batch 1] [--steps 2] [--warmup 1] [--rounds 3] [--cp-algo ulysses] [--mmap-threshold 65536] [--max-wait 120] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from bench.process import (
    LOSS_TOLERANCE,
    QUIET_CORES,
    WORKER_ENV,
    CpuMeter,
    parse_steps,
    rank_peaks_mib,
    training_assets,
    training_config,
    wait_quiet,
)
from bench.results import update_results

REPO = Path(__file__).resolve().parent.parent
SIDES = (1, 2)
"""The cp degrees compared, each on as many ranks."""
MIB = 2**20


def run_side(model: Path, data: Path, work: Path, cp: int, seq: int, args: argparse.Namespace) -> dict:
    """cp=``cp`` on ``cp`` torchrun ranks (dp=1), the global batch at ``seq`` tokens: losses,
    step seconds, tokens/s, other jobs' cores and each rank's peak RSS (MiB)."""
    from llmflow.cluster.nodes import torchrun_command
    from llmflow.launch import run_workers

    path = training_config(model, data, work / f"cp{cp}", args.warmup + args.steps, seq, args.batch, args.batch,
                           args.lr, cp=cp, cp_algo=args.cp_algo)
    lines: list[str] = []
    peaks: dict[int, list[float]] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=rank_peaks_mib, args=(stop, cp, peaks), daemon=True)
    meter = CpuMeter()
    watcher.start()
    try:
        run_workers(torchrun_command("llmflow.train", [str(path)], cp), on_line=lines.append, cwd=REPO,
                    env=worker_env(args))
    finally:
        stop.set()
        watcher.join()
    other = meter.other_cores()
    if sorted(peaks) != list(range(cp)):
        raise SystemExit(f"cp={cp}: found the peak RSS of ranks {sorted(peaks)} only, of {cp}")
    return {**parse_steps(lines, args.warmup, args.steps, args.batch * seq), "other_cores": other,
            "rss_mib": [peaks[rank][0] for rank in range(cp)]}


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' environment: one thread, the CPU, and glibc's mmap threshold when given."""
    if args.mmap_threshold is None:
        return WORKER_ENV
    return {**WORKER_ENV, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}


def variant(args: argparse.Namespace) -> str:
    """The run's algorithm and allocator setting, as its row names them."""
    allocator = f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold is not None else ""
    return f"{args.cp_algo}{allocator}"


def activation_mib(long: dict, short: dict, args: argparse.Namespace) -> float:
    """The busiest rank's activation memory at ``--seq`` tokens (MiB): its peak RSS less the
    same rank's at ``--short`` tokens, scaled by seq / (seq - short)."""
    return max(a - b for a, b in zip(long["rss_mib"], short["rss_mib"], strict=True)) * args.seq / (args.seq - args.short)


def planned(model: Path, data: Path, work: Path, cp: int, args: argparse.Namespace) -> dict:
    """The training memory plan of side ``cp`` at ``--seq`` tokens on its ``cp`` CPU ranks: its
    title, per-rank activation term and peak (MiB)."""
    from llmflow.models import ModelConfig
    from llmflow.train.config import TrainConfig
    from llmflow.train.memory import train_plan, train_shape
    from llmflow.weights import hf_config_of

    path = training_config(model, data, work / f"plan{cp}", args.warmup + args.steps, args.seq, args.batch, args.batch,
                           args.lr, cp=cp, cp_algo=args.cp_algo)
    config = TrainConfig.model_validate_json(path.read_text())
    plan = train_plan(ModelConfig.from_hf(hf_config_of(model)), train_shape(config, cp, args.seq, "cpu"))
    activations = next(term.bytes for term in plan.terms if term.name.startswith("activations"))
    return {"title": plan.title, "activation_mib": activations / MIB, "peak_mib": plan.peak / MIB}


def max_loss_diff(one: dict, two: dict) -> float:
    return max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True))


def summarize(rounds: list[dict], plans: dict[int, dict], args: argparse.Namespace) -> dict:
    """Medians and spreads over the rounds: tokens/s over the quiet rounds, memory over all."""
    quiet = [got for got in rounds if all(run["other_cores"] <= QUIET_CORES for run in got.values())]
    timed = quiet or rounds
    speed = [got[2, args.seq]["tokens_per_s"] / got[1, args.seq]["tokens_per_s"] for got in timed]
    acts = {cp: [activation_mib(got[cp, args.seq], got[cp, args.short], args) for got in rounds] for cp in SIDES}
    act_ratios = [two / one for one, two in zip(acts[1], acts[2], strict=True)]

    def per_rank(cp: int, seq: int) -> list[int]:
        return [round(statistics.median(got[cp, seq]["rss_mib"][rank] for got in rounds)) for rank in range(cp)]

    row = {"rounds": len(rounds), "rounds_used": len(timed), "quiet": bool(quiet)}
    for cp in SIDES:
        row |= {
            f"cp{cp}_tokens_per_s": round(statistics.median(got[cp, args.seq]["tokens_per_s"] for got in timed)),
            f"cp{cp}_step_s": round(statistics.median(got[cp, args.seq]["step_s"] for got in timed), 2),
            f"cp{cp}_peak_mib": per_rank(cp, args.seq),
            f"cp{cp}_short_peak_mib": per_rank(cp, args.short),
            f"cp{cp}_activation_mib": round(statistics.median(acts[cp])),
            f"cp{cp}_plan_activation_mib": round(plans[cp]["activation_mib"]),
            f"cp{cp}_plan_peak_mib": round(plans[cp]["peak_mib"]),
        }
    row |= {
        "ratio_median": round(statistics.median(speed), 3),
        "ratio_min": round(min(speed), 3),
        "ratio_max": round(max(speed), 3),
        "activation_ratio_median": round(statistics.median(act_ratios), 3),
        "activation_ratio_min": round(min(act_ratios), 3),
        "activation_ratio_max": round(max(act_ratios), 3),
        "plan_activation_ratio": round(plans[2]["activation_mib"] / plans[1]["activation_mib"], 3),
        "other_cores": round(statistics.median(run["other_cores"] for got in timed for run in got.values()), 2),
        "max_loss_diff": max(max_loss_diff(got[1, seq], got[2, seq]) for got in rounds for seq in (args.seq, args.short)),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=12288, help="tokens per sample, the long sequence compared")
    parser.add_argument("--short", type=int, default=512,
                        help="tokens per sample of the runs whose peak is subtracted to isolate the activations")
    parser.add_argument("--batch", type=int, default=1, help="samples per step, in one micro-batch")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-wait", type=float, default=120.0,
                        help="seconds in all to wait, before launches, for other jobs to leave the CPUs idle")
    parser.add_argument("--cp-algo", choices=["ulysses", "ring"], default="ulysses")
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="the workers' MALLOC_MMAP_THRESHOLD_ (bytes): glibc then returns freed blocks above it")
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    if args.seq % 4 or args.short % 4 or not 0 < args.short < args.seq:
        parser.error("--seq and --short must be multiples of 4 (ring at cp=2 cuts them in 4 chunks) and --short "
                     "below --seq")
    if args.cp_algo == "ulysses" and args.heads % 2:
        parser.error("--heads must be even: Ulysses gives each cp=2 rank half of them")
    load_before = os.getloadavg()
    started = time.perf_counter()
    wait = [float(args.max_wait)]

    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data, params = training_assets(work, args.layers, args.hidden, args.intermediate, args.heads, args.seq)
        plans = {cp: planned(model, data, work, cp, args) for cp in SIDES}
        for cp in SIDES:
            print(f"cp={cp} {plans[cp]['title']}: activations {plans[cp]['activation_mib']:.0f} MiB, "
                  f"peak {plans[cp]['peak_mib']:.0f} MiB", flush=True)
        for r in range(args.rounds):
            got: dict[tuple[int, int], dict] = {}
            for seq in (args.seq, args.short):
                for cp in SIDES[:: 1 - 2 * (r % 2)]:
                    wait_quiet(wait)
                    got[cp, seq] = run_side(model, data, work, cp, seq, args)
                    run = got[cp, seq]
                    print(f"round {r + 1} cp={cp} seq {seq}: {run['tokens_per_s']:.0f} tok/s ({run['step_s']:.2f} s/step), "
                          f"peak RSS per rank {', '.join(f'{x:.0f}' for x in run['rss_mib'])} MiB, other jobs "
                          f"{run['other_cores']:.2f} cores", flush=True)
                diff = max_loss_diff(got[1, seq], got[2, seq])
                if diff > LOSS_TOLERANCE:
                    raise SystemExit(f"seq {seq}: cp=2 and cp=1 logged different losses (max diff {diff:.2e} > "
                                     f"{LOSS_TOLERANCE}):\ncp1 {got[1, seq]['losses']}\ncp2 {got[2, seq]['losses']}")
            one, two = (activation_mib(got[cp, args.seq], got[cp, args.short], args) for cp in SIDES)
            print(f"round {r + 1}: tokens/s cp2/cp1 {got[2, args.seq]['tokens_per_s'] / got[1, args.seq]['tokens_per_s']:.3f}, "
                  f"activations per rank cp1 {one:.0f} MiB, cp2 {two:.0f} MiB, ratio {two / one:.3f}; max loss diff "
                  f"{max(max_loss_diff(got[1, seq], got[2, seq]) for seq in (args.seq, args.short)):.1e}", flush=True)
            rounds.append(got)

    row = summarize(rounds, plans, args)
    print(json.dumps(row), flush=True)
    load_after = os.getloadavg()
    print(f"model {params / 1e6:.1f}M parameters; {time.perf_counter() - started:.0f} s in all; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after", flush=True)
    if args.record:
        record(row, plans, args, params, load_before, load_after)


def record(row: dict, plans: dict[int, dict], args: argparse.Namespace, params: int, load_before: tuple[float, ...],
           load_after: tuple[float, ...]) -> None:
    day = time.strftime("%Y-%m-%d")
    load = ", ".join(f"{x:.1f}" for x in load_before)
    command = (f"python -m bench.context_parallel --layers {args.layers} --hidden {args.hidden} --heads {args.heads} "
               f"--seq {args.seq} --short {args.short} --batch {args.batch} --steps {args.steps} "
               f"--warmup {args.warmup} --rounds {args.rounds} --cp-algo {args.cp_algo}"
               + (f" --mmap-threshold {args.mmap_threshold}" if args.mmap_threshold is not None else ""))
    rounds = (f"the {row['rounds_used']} quiet rounds of {row['rounds']}" if row["quiet"]
              else f"{row['rounds']} rounds, none quiet")
    peaks = {cp: ", ".join(map(str, row[f"cp{cp}_peak_mib"])) for cp in SIDES}
    current = [(
        f"| `bench.context_parallel` {variant(args)} | cp=1 on one rank, same model, global batch {args.batch} x {args.seq} tokens and "
        f"losses (fp32) | cp=2: {row['ratio_median']:.2f}x tokens/s; activation memory per rank "
        f"{row['activation_ratio_median']:.2f}x (1/cp = 0.50; the plan's activation term "
        f"{row['plan_activation_ratio']:.2f}x); peak RSS per rank {peaks[2]} against "
        f"{peaks[1]} MiB | tokens/s {row['ratio_min']:.2f}x-{row['ratio_max']:.2f}x over {rounds}; activations "
        f"{row['activation_ratio_min']:.2f}x-{row['activation_ratio_max']:.2f}x over {row['rounds']} rounds | 1 per rank "
        f"| {load} before; other jobs {row['other_cores']:.2f} cores | {day} |"
    )]
    entry = [
        (f"### Context parallelism, cp=2 ({variant(args)}) against cp=1 ({day}, {cpu_model()}, {os.cpu_count()} cores, "
         f"torch {torch.__version__}, 1 thread per rank, cpu, gloo, load average {load} before the run, "
         f"{load_after[0]:.1f} after)"),
        "",
        (f"`{command}`: `llmflow train`, cp=2 on 2 ranks ({args.cp_algo}, FSDP2 over dp*cp=2) against cp=1 on one rank, "
         f"random Llama-shaped model ({params / 1e6:.1f}M parameters: {args.layers} layers, hidden {args.hidden}, FFN "
         f"{args.intermediate}, {args.heads} heads, untied, vocab 896), fp32, global batch {args.batch} x seq "
         f"{args.seq} (packed sample corpus, plain causal attention: the CPU flash kernel, memory linear in the "
         f"sequence). {args.seq} tokens: the longest multiple of 4096 whose cp=1 step stays near 30 s on these "
         f"2 cores (16384: 51 s), far below what fits this machine's memory. tokens/s over {args.steps} steps after "
         f"{args.warmup} warm-up; {args.rounds} rounds, cp=1 and cp=2 alternating; tokens/s medians and spreads over "
         f"{rounds}, memory over every round. Peak RSS: each rank's VmHWM. Activations per rank: the busiest "
         f"rank's peak RSS at seq {args.seq} less its peak at seq {args.short} (same run otherwise), times "
         f"{args.seq}/({args.seq}-{args.short}). Plan: `train_plan(train_shape(config, ranks, seq, 'cpu'))`, its "
         f"activation term and peak per rank ({plans[1]['title']}; {plans[2]['title']})."),
        "",
        ("| side | tok/s | step s | peak RSS per rank MiB | at seq "
         f"{args.short} MiB | activations per rank MiB | plan: activations MiB | plan: peak MiB |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    entry += [
        f"| cp={cp}, {cp} rank{'s' if cp > 1 else ''} | {row[f'cp{cp}_tokens_per_s']} | {row[f'cp{cp}_step_s']:.2f} | "
        f"{peaks[cp]} | {', '.join(map(str, row[f'cp{cp}_short_peak_mib']))} | {row[f'cp{cp}_activation_mib']} | "
        f"{row[f'cp{cp}_plan_activation_mib']} | {row[f'cp{cp}_plan_peak_mib']} |"
        for cp in SIDES
    ]
    entry += [
        "",
        (f"cp2 / cp1: tokens/s {row['ratio_median']:.3f}x ({row['ratio_min']:.3f}x-{row['ratio_max']:.3f}x); "
         f"activations per rank {row['activation_ratio_median']:.3f}x ({row['activation_ratio_min']:.3f}x-"
         f"{row['activation_ratio_max']:.3f}x) against 1/cp = 0.5; plan's activation term "
         f"{row['plan_activation_ratio']:.3f}x. Max loss diff {row['max_loss_diff']:.1e}; other jobs "
         f"{row['other_cores']:.2f} cores (median over the runs)."),
    ]
    update_results(current, entry)


if __name__ == "__main__":
    main()
