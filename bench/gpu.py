"""One-shot benchmark of one accelerator (CUDA), for the day one is lent: run it with
``bench/gpu.sh`` (which says what the machine needs) or ``python -m bench.gpu``.

Sections (``--only`` picks some; they run in this order):

- ``kernels``: every kernel the device dispatches to against its reference, fp32 and bf16
  (bench/gpu_kernels.py, the checks and tolerances of tests/test_kernels.py);
- ``decode``: greedy decoding tokens/s, batch 1 and 8, bf16, llmflow against transformers
  ``generate`` (bench/gpu_decode.py);
- ``precision``: the precision flow (flows/precision.py) comparing the same training step
  in bf16 on the device against fp32 on the CPU, both dumped in msprobe's format; prints
  the advisor's verdict;
- ``train``: bf16 training-step throughput and MFU of a ~1.5B Llama-shaped model (hidden
  2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocabulary 128,256; seq 2048, micro
  batch 4), llmflow's production step (FSDP2 mixed precision, compile on) against
  transformers with ``torch.compile`` and Liger-Kernel where installed (bench/gpu_train.py).
  It runs last: Liger patches transformers' Llama classes for the rest of the process.

MFU = model FLOPs per token (bench/flops.py: 6N + 12 x layers x hidden x seq, PaLM's
count) x tokens/s / the device's dense bf16 peak (``llmflow.train.metrics.PEAK_FLOPS``,
vendor datasheets, keyed by ``torch.cuda.get_device_name``); a device not in the table gets
a message and no MFU. The measured bf16 matmul peak is printed beside it. Goal: MFU >= 45%.

``--device cpu --tiny`` runs every section on a tiny model on the CPU (compile off unless
``--compile``; no MFU: a CPU has no datasheet peak, the measured matmul peak is used
instead): a smoke test of the code paths, not a measurement.

The report is a markdown block ready for bench/RESULTS.md; ``--record`` appends it there.

    python -m bench.gpu [--device cuda] [--only kernels decode precision train] [--rounds 5] [--record]
    python -m bench.gpu --device cpu --tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.flops import count_flops, describe, measured_peak_flops
from llmflow.models import ModelConfig
from llmflow.train.metrics import peak_flops

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "RESULTS.md"
SECTIONS = ("kernels", "decode", "precision", "train")
GOAL_MFU = 0.45
GOAL_ROOFLINE = 0.5
SHAPES = {
    "full": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
             "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096,
             "rope_theta": 500000.0},
    # bench.generate's prompts draw ids below 32,000: the tiny model keeps that vocabulary.
    "tiny": {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256},
}
TORCHTITAN = ("torchtitan reports 33% to 39% MFU for Llama 3.1 8B on 8 H100s with FSDP in bf16 (with and without "
              "torch.compile; 5,762 and 6,667 tokens/s/GPU, local batch 2, selective activation checkpointing): "
              "pytorch/torchtitan docs/performance.md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="device type to benchmark (cuda; cpu for the --tiny smoke run)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and few steps: checks the code paths only")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    parser.add_argument("--seq", type=int, help="training sequence length (default 2048; tiny 64)")
    parser.add_argument("--micro-batch", type=int, help="training micro batch (default 4; tiny 2)")
    parser.add_argument("--steps", type=int, help="timed training steps per side and round (default 10; tiny 2)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per side and round, compilation included (default 3; tiny 1)")
    parser.add_argument("--rounds", type=int, help="alternating rounds of train and decode (default 5; tiny 1)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per row (default 128; tiny 8)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="compile both training sides (default: on, off on CPU where a cold compile takes minutes)")
    parser.add_argument("--liger", action=argparse.BooleanOptionalAction, default=True,
                        help="Liger-Kernel on the transformers side where installed (--no-liger: Liger-Kernel 0.8.5's "
                             "fused cross-entropy fails under torch.compile on torch 2.11)")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--record", action="store_true", help="append the report to bench/RESULTS.md")
    args = parser.parse_args(argv)
    tiny = args.tiny
    defaults = {"seq": 64 if tiny else 2048, "micro_batch": 2 if tiny else 4, "steps": 2 if tiny else 10,
                "warmup": 1 if tiny else 3, "rounds": 1 if tiny else 5, "new_tokens": 8 if tiny else 128,
                "compile": args.device != "cpu"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        elif name != "compile" and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def resolve_device(name: str) -> torch.device:
    """The device to benchmark, or exit with a one-line reason before any work."""
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        sys.exit(f"bench.gpu --device {name}: expected cuda or cpu")
    if not torch.cuda.is_available():
        sys.exit(f"bench.gpu --device cuda: torch {torch.__version__} sees no CUDA device (a CPU build of torch, or no "
                 "driver); bench/gpu.sh says what the machine needs, --device cpu --tiny checks the code paths")
    return torch.device("cuda", torch.cuda.current_device())


def device_name(device: torch.device) -> str:
    return "CPU: " + _cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device)


def _cpu_model() -> str:
    from bench.machine import cpu_model

    return cpu_model()


def run_kernels(device: torch.device) -> list[str]:
    from bench.gpu_kernels import check_kernels, optional_kernels

    checks = check_kernels(device)
    installed = ", ".join(f"{name} {'importable' if ok else 'not installed'}" for name, ok in optional_kernels().items())
    lines = ["#### Kernels against their reference", "",
             (f"`kernels_for('{device.type}')` on the device; fp32 against the reference on the CPU, bf16 against the "
              "reference on the device (outputs; the cross-entropy's gradients against F.cross_entropy). "
              f"{installed} (their kernels run on CUDA in bf16 only)."), "",
             "| op | dtype | max abs diff | tolerance (abs + rel) | within |", "|---|---|---|---|---|"]
    lines += [f"| {c.op} | {c.dtype} | {c.max_abs_diff:.2e} | {c.atol:.0e} + {c.rtol:.0e} | {'yes' if c.ok else 'NO'} |"
              for c in checks]
    failed = [f"{c.op} {c.dtype}" for c in checks if not c.ok]
    lines += ["", f"{len(checks) - len(failed)} of {len(checks)} within tolerance"
              + (f"; outside: {', '.join(failed)}" if failed else ""), ""]
    return lines


def run_decode(model_dir: Path, device: torch.device, args: argparse.Namespace, vocab: int) -> list[str]:
    from bench.gpu_decode import decode_rounds

    rows = decode_rounds(model_dir, device, vocab, [1, 8], args.new_tokens, args.rounds, args.compile)
    sides = ("llmflow `decode: compiled` (static KV cache, torch.compile reduce-overhead) against transformers' "
             "static-cache generate, compiled by transformers" if args.compile else
             "llmflow's eager decode step against transformers' static-cache generate, uncompiled")
    lines = ["#### Decode, greedy, bf16", "",
             (f"{sides}; {args.new_tokens} new tokens per row, {args.rounds} rounds alternating; peak memory per side "
              "includes the other side's weights (both stay loaded)."), "",
             ("| batch | llmflow tok/s | transformers tok/s | ratio median (min-max) | rows with the same tokens "
              "| llmflow GiB | transformers GiB |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        median, low, high = r["ratio"]
        memory = [f"{r['memory_gib'][s]:.2f}" if s in r["memory_gib"] else "-" for s in ("llmflow", "transformers")]
        lines.append(f"| {r['batch']} | {r['rates']['llmflow']:,.1f} | {r['rates']['transformers']:,.1f} | "
                     f"{median:.2f}x ({low:.2f}-{high:.2f}) | {r['same_rows']:.0%} | {memory[0]} | {memory[1]} |")
    return lines + [""] + roofline_lines(rows[0], device) + [""]


def roofline_lines(batch_one: dict, device: torch.device) -> list[str]:
    """Batch 1's bytes/s (the bytes a step reads x steps/s) against the memory bandwidth."""
    from bench.roofline import measured_bandwidth, peak_bandwidth

    datasheet = peak_bandwidth(device)
    measured = measured_bandwidth(device, megabytes=256 if device.type == "cpu" else 4096)
    step = batch_one["step_bytes"]
    lines = [f"Batch 1 reads {step / 2**20:,.1f} MiB a step (weights and KV cache); the measured read bandwidth "
             f"(a tensor's sum) is {measured / 1e9:,.0f} GB/s"
             + (f", the datasheet's {datasheet / 1e9:,.0f} GB/s." if datasheet else ".")]
    for side, rate in batch_one["rates"].items():
        achieved = rate * step
        share = f"{achieved / datasheet:.0%} of the datasheet roofline, " if datasheet else ""
        lines.append(f"- {side}: {achieved / 1e9:,.0f} GB/s, {share}{achieved / measured:.0%} of the measured "
                     "bandwidth")
    if datasheet:
        met = batch_one["rates"]["llmflow"] * step / datasheet >= GOAL_ROOFLINE
        lines.append(f"\nllmflow batch 1 against the goal of {GOAL_ROOFLINE:.0%} of the roofline: "
                     + ("met." if met else "missed."))
    return lines


def run_precision(device: torch.device, work: Path, tiny: bool) -> list[str]:
    """The precision flow, bf16 on ``device`` against fp32 on the CPU, on the sample model."""
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(work / "prefect" / "results"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from llmflow.flows.params import PrecisionParams
    from llmflow.flows.precision import precision

    params = PrecisionParams.model_validate({
        "workspace": str(work / "precision-ws"), "target": {"dtype": "bf16", "device": device.type},
        "bench": {"dtype": "fp32", "device": "cpu"}, "steps": 1, "seq_length": 32 if tiny else 128, "batch_size": 2,
    })
    result = precision(**dict(params))
    advice = result["advice"].strip().splitlines()
    return ["#### Precision: bf16 on the device against fp32 on the CPU", "",
            (f"The precision flow on the sample model (1 step, seq {params.seq_length}, batch 2, tensor dumps, level "
             f"mix); comparison in `{result['comparison']}`. The advisor's first lines:"), "", "```",
            *advice[:12], "```", ""]


def mfu_lines(results: dict, flops_per_token: float, device: torch.device, measured: float) -> list[str]:
    datasheet = peak_flops(device) if device.type != "cpu" else None
    lines = []
    if device.type != "cpu" and datasheet is None:
        lines.append(f"MFU omitted: {device_name(device)} has no dense bf16 peak in llmflow.train.metrics.PEAK_FLOPS.")
    lines += [("| side | tok/s median (min-max) | model TFLOP/s | MFU (datasheet peak) | of the measured matmul peak "
               "| first loss | first step s | peak memory GiB |"), "|---|---|---|---|---|---|---|---|"]
    for side, r in results.items():
        tok = statistics.median(r.tokens_per_s)
        achieved = tok * flops_per_token
        mfu = f"{achieved / datasheet:.1%}" if datasheet else "-"
        lines.append(f"| {side} | {tok:,.0f} ({min(r.tokens_per_s):,.0f}-{max(r.tokens_per_s):,.0f}) | "
                     f"{achieved / 1e12:.3g} | {mfu} | {achieved / measured:.1%} | {r.first_loss[0]:.4f} | "
                     f"{statistics.median(r.first_step_s):.1f} | {r.memory_gib:.2f} |")
    if datasheet:
        best = statistics.median(results["llmflow"].tokens_per_s) * flops_per_token / datasheet
        lines += ["", f"llmflow MFU {best:.1%} against the goal of {GOAL_MFU:.0%}: "
                  + ("met." if best >= GOAL_MFU else "missed.")]
    return lines


def run_train(model_dir: Path, data: Path, work: Path, device: torch.device, args: argparse.Namespace) -> list[str]:
    from bench.gpu_train import LIGER_MISSING, liger_available, train_config, train_rounds

    liger = device.type == "cuda" and args.liger and liger_available()
    if device.type == "cuda" and args.liger and not liger:
        print(LIGER_MISSING, flush=True)
    config = train_config(model_dir, data, work / "run", args.seq, args.micro_batch, args.warmup + args.steps,
                          args.compile)
    results = train_rounds(config, device, args.rounds, args.warmup, args.compile, liger)
    model = ModelConfig.from_file(model_dir)
    flops = count_flops(model, args.seq)
    measured = measured_peak_flops(device, torch.bfloat16, n=1024 if args.tiny else 8192)
    ratios = [o / t for o, t in zip(results["llmflow"].tokens_per_s, results["transformers"].tokens_per_s, strict=True)]
    loss_diff = abs(results["llmflow"].first_loss[0] - results["transformers"].first_loss[0])
    peer = "transformers + torch.compile" if args.compile else "transformers"
    if liger:
        peer += " + Liger-Kernel"
    elif device.type == "cuda":
        peer += " (Liger-Kernel not installed)" if args.liger else " (without Liger-Kernel: --no-liger)"
    lines = ["#### Training step, bf16", "",
             (f"{model.num_hidden_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads "
              f"({model.num_key_value_heads} KV), FFN {model.intermediate_size}, vocabulary {model.vocab_size}, "
              f"untied; seq {args.seq}, micro batch {args.micro_batch}; llmflow's train step (FSDP2 bf16 mixed "
              f"precision, compile {'on' if args.compile else 'off'}) against {peer}; {args.rounds} rounds "
              f"alternating, {args.steps} timed steps after {args.warmup} warm-up steps each."),
             "", describe(flops, args.seq) + ".",
             f"Measured bf16 matmul peak: {measured / 1e12:.3g} TFLOP/s.", ""]
    lines += mfu_lines(results, flops.per_token, device, measured)
    lines += ["", (f"llmflow / {peer}: {statistics.median(ratios):.2f}x tokens/s ({min(ratios):.2f}x-{max(ratios):.2f}x); "
                   f"first-step losses differ by {loss_diff:.1e} (bf16, same samples and targets)."),
              "", f"For reference, {TORCHTITAN}.", ""]
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    load = os.getloadavg()
    sections = [s for s in SECTIONS if s in args.only]
    shape = SHAPES["tiny" if args.tiny else "full"]
    lines = [
        (f"### gpu ({time.strftime('%Y-%m-%d')}, {device_name(device)}, torch {torch.__version__}"
         + (f", CUDA {torch.version.cuda}" if device.type == "cuda" else f", {torch.get_num_threads()} threads")
         + f", load average {load[0]:.1f})"),
        "",
        f"`python -m bench.gpu --device {args.device}{' --tiny' if args.tiny else ''} --only {' '.join(sections)}`"
        + (" (a smoke run on a tiny model: not a measurement)" if args.tiny else ""),
        "",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = data = None
        if "decode" in sections or "train" in sections:
            from bench.gpu_train import write_assets

            samples = (args.warmup + args.steps) * args.micro_batch + 1
            model_dir, data = write_assets(work, shape, samples, args.seq, device)
        for section in sections:
            print(f"== {section}", flush=True)
            if section == "kernels":
                lines += run_kernels(device)
            elif section == "decode":
                lines += run_decode(model_dir, device, args, shape["vocab_size"])
            elif section == "precision":
                lines += run_precision(device, work, args.tiny)
            else:
                lines += run_train(model_dir, data, work, device, args)
    publish(lines, args.record)


def publish(lines: list[str], record: bool) -> None:
    """Print the report's markdown; with ``record``, append it to bench/RESULTS.md."""
    report = "\n".join(lines).rstrip("\n") + "\n"
    print(report, flush=True)
    if record:
        with RESULTS.open("a") as f:
            f.write("\n" + report)
        print(f"recorded in {RESULTS}", flush=True)


if __name__ == "__main__":
    main()
