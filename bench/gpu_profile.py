"""Where llmflow's training step spends its device time: ``torch.profiler`` over the
production step of bench/gpu_train.py (``llmflow train``'s one-worker setup, compile on
CUDA), after warm-up steps so that compilation is left out.

The report (markdown, ready for bench/RESULTS.md) lists the kernels by total device time
with their share of the profiled steps, the totals per category (matmul, attention,
Triton/fused elementwise, communication, memory copies, other) and the idle share: the
steps' wall time not covered by device work, which is launch and host overhead.

    python -m bench.gpu_profile [--device cuda] [--steps 3] [--trace trace.json] [--record]
    python -m bench.gpu_profile --device cpu --tiny
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.flops import synchronize
from bench.gpu import SHAPES, publish, resolve_device

CATEGORIES = (  # the first category with a pattern in the kernel's lower-cased name
    ("cross-entropy", ("crossentropy", "cross_entropy", "log_softmax")),
    ("matmul", ("gemm", "matmul", "aten::mm", "aten::bmm", "aten::addmm", "cutlass", "nvjet", "sm90_xmma")),
    ("attention", ("flash", "attention", "fmha", "sdpa")),
    ("communication", ("nccl", "all_reduce", "allgather", "reduce_scatter", "gloo")),
    ("memory copy", ("memcpy", "memset", "copy_")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("triton / fused", ("triton", "fused")),
)


def category(name: str) -> str:
    lowered = name.lower()
    return next((c for c, patterns in CATEGORIES if any(p in lowered for p in patterns)), "other")


def profile_steps(device: torch.device, args: argparse.Namespace, work: Path):
    """The profiler's events over ``args.steps`` steps after ``args.warmup``, and their wall time."""
    from bench.gpu_train import join_one_rank_group, llmflow_run, train_config, write_assets
    from llmflow.train.loop import train_step

    shape = SHAPES["tiny" if args.tiny else "full"]
    total = args.warmup + args.steps
    model_dir, data = write_assets(work, shape, total * args.micro_batch + 1, args.seq, device)
    join_one_rank_group(device)
    run = llmflow_run(train_config(model_dir, data, work / "run", args.seq, args.micro_batch, total,
                                   compile=device.type != "cpu"))
    for step in range(1, args.warmup + 1):
        train_step(run, step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for step in range(args.warmup + 1, total + 1):
            train_step(run, step)
        synchronize(device)
        wall = time.perf_counter() - start
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    return prof, wall


def kernel_times(prof, device: torch.device) -> dict[str, tuple[int, float]]:
    """(calls, seconds) per kernel: device kernels on CUDA, leaf operators' own CPU time on CPU."""
    times: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        own = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if own <= 0 or (device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        times[event.key][0] += event.count
        times[event.key][1] += own / 1e6
    return {name: (calls, seconds) for name, (calls, seconds) in times.items()}


def report(times: dict[str, tuple[int, float]], wall: float, steps: int, device: torch.device, top: int) -> list[str]:
    busy = sum(s for _, s in times.values())
    measured = "device" if device.type == "cuda" else "CPU (operators' own time)"
    lines = [f"#### Profile of llmflow's training step ({steps} steps)", "",
             (f"Step {wall / steps * 1e3:,.1f} ms wall; {measured} busy {busy / steps * 1e3:,.1f} ms a step "
              f"({min(busy / wall, 1.0):.0%}); idle (launch and host overhead) {max(1 - busy / wall, 0.0):.0%}."), "",
             "| category | ms a step | share of busy time |", "|---|---|---|"]
    per_category: dict[str, float] = defaultdict(float)
    for name, (_, seconds) in times.items():
        per_category[category(name)] += seconds
    for name, seconds in sorted(per_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {seconds / steps * 1e3:,.2f} | {seconds / busy:.1%} |")
    lines += ["", "| kernel | category | calls a step | ms a step | share of busy time |", "|---|---|---|---|---|"]
    for name, (calls, seconds) in sorted(times.items(), key=lambda kv: -kv[1][1])[:top]:
        shown = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{shown}` | {category(name)} | {calls / steps:g} | {seconds / steps * 1e3:,.3f} | "
                     f"{seconds / busy:.1%} |")
    return lines + [""]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the --tiny smoke run")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path only")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny 64)")
    parser.add_argument("--micro-batch", type=int, default=None, help="micro batch (default 4; tiny 2)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before profiling (compilation happens there)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--trace", type=Path, help="write a Chrome trace of the profiled steps here")
    parser.add_argument("--record", action="store_true", help="append the report to bench/RESULTS.md")
    args = parser.parse_args(argv)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.micro_batch = args.micro_batch or (2 if args.tiny else 4)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as work:
        prof, wall = profile_steps(device, args, Path(work))
    publish(report(kernel_times(prof, device), wall, args.steps, device, args.top), args.record)


if __name__ == "__main__":
    main()
