"""Pipeline-parallel throughput: ``llmflow train`` with pp=2 against pp=1 (dp=2) on the same 2 ranks.

Both sides are the real training worker (``torchrun -m llmflow.train``, CPU, gloo, fp32, one
thread per rank) on the same two ranks, training a random Llama-shaped model (untied
embeddings, the sample tokenizer's 896-token vocabulary, ``--layers`` x ``--hidden``) on the
tokenized sample corpus with the same global batch (``--microbatches`` x ``--micro-batch``
samples of ``--seq`` tokens) and the same optimizer:

- ``pp=1``: dp=2, each rank runs half the micro-batches through the whole model. FSDP2
  shards it, as it does every fp32 run with dp > 1: each layer's parameters are all-gathered
  in every micro-batch's forward and again in its backward, the gradients reduce-scattered
  once per step;
- ``pp=2``: dp=1, each rank holds half the layers (stage 0 also the embedding, stage 1 the
  norm, output projection and loss) and the schedule (1F1B, GPipe, and Interleaved1F1B with
  ``--virtual-stages`` chunks per rank when the model has enough layers) runs all
  ``--microbatches`` micro-batches through both stages, activations and their gradients
  sent between the ranks; no FSDP (fp32, dp=1);
- ``compute``, a reference that is no layout: two independent one-rank workers (no process
  group) started side by side, each training on half the global batch, i.e. one dp=2 rank's
  work without any collective. Its step time is the slower worker's.

Every rank does the same matmul FLOPs per step on all sides (up to the output projection and
loss on the last stage), so the ratio of tokens/s pp2 / pp1 measures what pipelining costs
against data parallelism. tokens/s is the global batch's tokens over the summed step times
(the worker's ``step`` lines) after ``--warmup`` steps; start-up and the final checkpoint are
excluded. Each round runs, for every schedule, pp=1 and pp=2 back to back (alternating which
goes first), then the compute reference; ratios are taken per round, and the median and
spread (min-max) over rounds are printed, so a burst of load on the shared machine moves one
round, not the result. pp=1 and pp=2 must log the same loss at every step (within 1e-5): the
loss does not depend on the layout.

Bubble fraction, predicted: the share of a step a pipeline rank idles under the schedule with
equal stage times and free communication, (p-1)/(m+p-1) for 1F1B and GPipe with p stages and
m micro-batches, (p-1)/(v*m+p-1) for Interleaved1F1B with v chunks per rank. Measured, two
ways (T: seconds per step, medians of the per-round ratios):

- against dp=2: 1 - T_pp1/T_pp2 = 1 - ratio. It lumps together everything that differs
  between the layouts: the bubble, the stage imbalance (output projection and loss on the
  last stage), the point-to-point sends and the schedule's own overhead, less FSDP's
  all-gathers and reduce-scatter that the pp=1 side pays (negative when those cost more);
- against compute: 1 - T_compute/T_pp2, the share of the pp=2 step beyond the same work with
  no communication at all: the bubble plus imbalance, sends and schedule overhead. This is
  the figure to hold against the prediction (it cannot be below it unless the idle rank's
  core speeds up the busy one).

On a shared machine other people's jobs take CPU time from whichever side runs beside them:
before each launch the benchmark waits (``--max-wait`` seconds in all) until the rest of the
machine is idle, and measures during each launch the cores the rest of the machine used
(/proc/stat's busy time less this benchmark's own processes), printed per run and, as the
median, in the result. A round in which other jobs used more than 0.25 cores during any of
its runs is left out of the medians and spreads (all rounds count when none was quiet).

``--record`` appends the result to bench/RESULTS.md: a row per schedule in the Current table
(replacing this benchmark's earlier rows) and the full table under History.

    python -m bench.pipeline [--layers 8] [--hidden 256] [--seq 256] [--micro-batch 1] [--microbatches 4] [--steps 8] [--warmup 2] [--rounds 3] [--schedules 1F1B GPipe Interleaved1F1B] [--max-wait 120] [--record]
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

from bench.machine import cpu_model
from bench.process import (
    LOSS_TOLERANCE,
    QUIET_CORES,
    WORKER_ENV,
    CpuMeter,
    parse_steps,
    training_assets,
    training_config,
    wait_quiet,
)
from bench.results import update_results

REPO = Path(__file__).resolve().parent.parent


def layouts(args) -> list[tuple[str, dict]]:
    """(name, pipeline settings) of each pp=2 side to measure."""
    sides = []
    for schedule in args.schedules:
        if schedule == "Interleaved1F1B":
            if args.layers < 2 * args.virtual_stages:
                print(f"skipping Interleaved1F1B: {args.layers} layers cannot fill pp=2 x "
                      f"virtual_stages={args.virtual_stages} stages", flush=True)
                continue
            sides.append((f"{schedule} v={args.virtual_stages}",
                          {"pp": 2, "pp_schedule": schedule, "virtual_stages": args.virtual_stages}))
        else:
            sides.append((schedule, {"pp": 2, "pp_schedule": schedule}))
    return sides


def run_layout(model: Path, data: Path, work: Path, pipeline: dict, args) -> dict:
    """pp=1 (dp=2, pipeline empty) or pp=2 on 2 torchrun ranks, the whole global batch."""
    from llmflow.cluster.nodes import torchrun_command
    from llmflow.launch import run_workers

    dp = 2 // pipeline.get("pp", 1)
    samples = args.micro_batch * args.microbatches
    path = training_config(model, data, work / "run", args.warmup + args.steps, args.seq, args.micro_batch, samples,
                           args.lr, microbatches=args.microbatches // dp, **pipeline)
    lines: list[str] = []
    meter = CpuMeter()
    run_workers(torchrun_command("llmflow.train", [str(path)], 2), on_line=lines.append, cwd=REPO, env=WORKER_ENV)
    return {**parse_steps(lines, args.warmup, args.steps, samples * args.seq), "other_cores": meter.other_cores()}


def run_compute(model: Path, data: Path, work: Path, args) -> dict:
    """Two independent one-rank workers side by side, each on half the global batch (one dp=2
    rank's work, no collectives); tokens/s of the whole global batch at the slower one's pace."""
    samples = args.micro_batch * args.microbatches // 2
    paths = [training_config(model, data, work / f"compute{i}", args.warmup + args.steps, args.seq, args.micro_batch,
                             samples, args.lr, microbatches=args.microbatches // 2) for i in range(2)]
    env = {**os.environ, **WORKER_ENV, "PYTHONUNBUFFERED": "1"}
    meter = CpuMeter()
    procs = [subprocess.Popen([sys.executable, "-m", "llmflow.train", str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO) for path in paths]
    outputs = [proc.communicate()[0] for proc in procs]
    other = meter.other_cores()
    for proc, output in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise SystemExit("a compute-reference worker failed:\n" + "\n".join(output.splitlines()[-30:]))
    slower = max((parse_steps(output.splitlines(), args.warmup, args.steps, samples * args.seq) for output in outputs),
                 key=lambda result: result["step_s"])
    return {"step_s": slower["step_s"], "tokens_per_s": 2 * samples * args.seq / slower["step_s"],
            "other_cores": other}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step of the pp=2 pipeline (m)")
    parser.add_argument("--virtual-stages", type=int, default=2, help="model chunks per rank for Interleaved1F1B (v)")
    parser.add_argument("--schedules", nargs="+", default=["1F1B", "GPipe", "Interleaved1F1B"],
                        choices=["1F1B", "GPipe", "Interleaved1F1B"])
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-wait", type=float, default=120.0,
                        help="seconds in all to wait, before launches, for other jobs to leave the CPUs idle")
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    if args.microbatches % 2 or args.microbatches < 2:
        parser.error("--microbatches must be even: pp=1 splits them over dp=2 ranks (and 1F1B needs >= pp=2)")
    load_before = os.getloadavg()
    started = time.perf_counter()
    wait = [float(args.max_wait)]

    sides = layouts(args)
    pairs: dict[str, list[tuple[dict, dict]]] = {name: [] for name, _ in sides}
    compute: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data, params = training_assets(work, args.layers, args.hidden, args.intermediate, args.heads, args.seq)
        for r in range(args.rounds):
            for name, pipeline in sides:
                order = [("pp1", {}), ("pp2", pipeline)]
                got = {}
                for label, settings in order[:: 1 - 2 * (r % 2)]:
                    wait_quiet(wait)
                    got[label] = run_layout(model, data, work, settings, args)
                one, two = got["pp1"], got["pp2"]
                diff = max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True))
                print(f"round {r + 1} {name}: pp1 {one['tokens_per_s']:.0f} tok/s ({one['step_s']:.3f} s/step, other jobs "
                      f"{one['other_cores']:.2f} cores), pp2 {two['tokens_per_s']:.0f} tok/s ({two['step_s']:.3f} s/step, "
                      f"other jobs {two['other_cores']:.2f} cores), ratio {two['tokens_per_s'] / one['tokens_per_s']:.3f}, "
                      f"max loss diff {diff:.1e}", flush=True)
                if diff > LOSS_TOLERANCE:
                    raise SystemExit(f"{name}: pp=2 and pp=1 logged different losses (max diff {diff:.2e} > "
                                     f"{LOSS_TOLERANCE}):\npp1 {one['losses']}\npp2 {two['losses']}")
                pairs[name].append((one, two))
            wait_quiet(wait)
            compute.append(run_compute(model, data, work, args))
            print(f"round {r + 1} compute reference: {compute[-1]['tokens_per_s']:.0f} tok/s "
                  f"({compute[-1]['step_s']:.3f} s/step, other jobs {compute[-1]['other_cores']:.2f} cores)", flush=True)

    rows = []
    for name, pipeline in sides:
        every = [(one, two, ref) for (one, two), ref in zip(pairs[name], compute, strict=True)]
        quiet = [run for run in every if all(side["other_cores"] <= QUIET_CORES for side in run)]
        runs = quiet or every
        ratios = [two["tokens_per_s"] / one["tokens_per_s"] for one, two, _ in runs]
        against_compute = [two["tokens_per_s"] / ref["tokens_per_s"] for _, two, ref in runs]
        p, m, v = 2, args.microbatches, pipeline.get("virtual_stages", 1)
        rows.append({
            "schedule": name,
            "rounds_used": len(runs),
            "quiet": bool(quiet),
            "rounds": len(every),
            "pp1_tokens_per_s": round(statistics.median(one["tokens_per_s"] for one, _, _ in runs)),
            "pp2_tokens_per_s": round(statistics.median(two["tokens_per_s"] for _, two, _ in runs)),
            "compute_tokens_per_s": round(statistics.median(ref["tokens_per_s"] for _, _, ref in runs)),
            "pp1_step_s": round(statistics.median(one["step_s"] for one, _, _ in runs), 3),
            "pp2_step_s": round(statistics.median(two["step_s"] for _, two, _ in runs), 3),
            "compute_step_s": round(statistics.median(ref["step_s"] for _, _, ref in runs), 3),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3),
            "bubble_predicted": round((p - 1) / (v * m + p - 1), 3),
            "bubble_vs_compute": round(1 - statistics.median(against_compute), 3),
            "bubble_vs_compute_min": round(1 - max(against_compute), 3),
            "bubble_vs_compute_max": round(1 - min(against_compute), 3),
            "bubble_vs_dp2": round(1 - statistics.median(ratios), 3),
            "other_cores": round(statistics.median(side["other_cores"] for run in runs for side in run), 2),
            "max_loss_diff": max(max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True))
                                 for one, two, _ in every),
        })
        print(json.dumps(rows[-1]), flush=True)
    load_after = os.getloadavg()
    print(f"model {params / 1e6:.1f}M parameters; m={args.microbatches}; {time.perf_counter() - started:.0f} s in all; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after", flush=True)
    if args.record:
        record(rows, args, params, load_before, load_after)


def record(rows: list[dict], args, params: int, load_before: tuple, load_after: tuple) -> None:
    day = time.strftime("%Y-%m-%d")
    load = ", ".join(f"{x:.1f}" for x in load_before)
    tokens = args.micro_batch * args.microbatches * args.seq
    command = (f"python -m bench.pipeline --layers {args.layers} --hidden {args.hidden} --seq {args.seq} "
               f"--micro-batch {args.micro_batch} --microbatches {args.microbatches} --steps {args.steps} "
               f"--warmup {args.warmup} --rounds {args.rounds}")
    current = [
        f"| `bench.pipeline` {row['schedule']} | pp=1 (dp=2, FSDP) on the same 2 ranks, same global batch and losses "
        f"(fp32, m={args.microbatches}) | {row['ratio_median']:.2f}x tokens/s; bubble {row['bubble_predicted']:.0%} "
        f"predicted, {row['bubble_vs_compute']:.0%} measured against compute alone, {row['bubble_vs_dp2']:.0%} "
        f"against dp=2 | {row['ratio_min']:.2f}x-{row['ratio_max']:.2f}x over "
        + (f"the {row['rounds_used']} quiet rounds of {row['rounds']}" if row["quiet"] else f"{row['rounds']} rounds, none quiet")
        + f" | 1 per rank | {load} before; other jobs {row['other_cores']:.2f} cores | {day} |"
        for row in rows
    ]
    entry = [
        (f"### Pipeline parallelism, pp=2 against pp=1 ({day}, {cpu_model()}, {os.cpu_count()} cores, "
         f"torch {torch.__version__}, 1 thread per rank, cpu, gloo, load average {load} before the run, "
         f"{load_after[0]:.1f} after)"),
        "",
        (f"`{command}`: `llmflow train` on 2 ranks, pp=2 (dp=1) against pp=1 (dp=2, FSDP), random Llama-shaped "
         f"model ({params / 1e6:.1f}M parameters: {args.layers} layers, hidden {args.hidden}, FFN {args.intermediate}, "
         f"untied, vocab 896), fp32, global batch {args.micro_batch * args.microbatches} x seq {args.seq} "
         f"({tokens} tokens) in m={args.microbatches} pipeline micro-batches of {args.micro_batch} "
         f"({args.microbatches // 2} per rank at dp=2); compute = two independent one-rank workers side by side, each "
         f"on half the batch (no collectives). tokens/s over {args.steps} steps after {args.warmup} warm-up steps; "
         f"{args.rounds} rounds, pp=1 and pp=2 alternating; medians and spreads over the quiet rounds (other jobs "
         f"under {QUIET_CORES} cores during each of the round's runs; all rounds where none was quiet). "
         "Bubble measured against dp=2: "
         "1 - T_pp1/T_pp2; against compute: 1 - T_compute/T_pp2 (bubble, stage imbalance, sends, schedule overhead)."),
        "",
        ("| schedule | pp=1 tok/s | pp=2 tok/s | compute tok/s | pp=1 step s | pp=2 step s | compute step s "
         "| pp2 / pp1, median | min | max | bubble predicted | measured vs compute (min-max) | measured vs dp=2 "
         "| max loss diff | rounds used | other jobs, cores |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    entry += [
        f"| {row['schedule']} | {row['pp1_tokens_per_s']} | {row['pp2_tokens_per_s']} | {row['compute_tokens_per_s']} | "
        f"{row['pp1_step_s']:.3f} | {row['pp2_step_s']:.3f} | {row['compute_step_s']:.3f} | {row['ratio_median']:.3f}x | "
        f"{row['ratio_min']:.3f}x | {row['ratio_max']:.3f}x | {row['bubble_predicted']:.1%} | "
        f"{row['bubble_vs_compute']:.1%} ({row['bubble_vs_compute_min']:.1%} to {row['bubble_vs_compute_max']:.1%}) | "
        f"{row['bubble_vs_dp2']:.1%} | {row['max_loss_diff']:.1e} | "
        f"{row['rounds_used']} of {row['rounds']} | {row['other_cores']:.2f} |"
        for row in rows
    ]
    update_results(current, entry, stale=lambda row: row.startswith("| `bench.pipeline`"))


if __name__ == "__main__":
    main()
