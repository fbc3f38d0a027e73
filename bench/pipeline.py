"""Pipeline-parallel throughput: ``llmflow train`` with pp=2 against pp=1 (dp=2) on the same 2 ranks.

Both sides are the real training worker (``torchrun -m llmflow.train``, CPU, gloo, fp32, one
thread per rank) on the same two ranks, training a random Llama-shaped model (untied
embeddings, the sample tokenizer's 896-token vocabulary, ``--layers`` x ``--hidden``) on the
tokenized sample corpus with the same global batch (``--microbatches`` x ``--micro-batch``
samples of ``--seq`` tokens) and the same optimizer:

- ``pp=1``: dp=2, each rank runs half the micro-batches through the whole model (FSDP2
  shards it, as it does every fp32 run with dp > 1: parameters all-gathered per micro-batch,
  gradients reduce-scattered once per step);
- ``pp=2``: dp=1, each rank holds half the layers (stage 0 also the embedding, stage 1 the
  norm, output projection and loss) and the schedule (1F1B, GPipe, and Interleaved1F1B with
  ``--virtual-stages`` chunks per rank when the model has enough layers) runs all
  ``--microbatches`` micro-batches through both stages, activations and their gradients
  sent between the ranks.

Every rank does the same matmul FLOPs per step on both sides (up to the output projection
and loss on the last stage), so the ratio of tokens/s pp2 / pp1 measures what pipelining
costs. tokens/s is the global batch's tokens over the summed step times (the worker's
``step`` lines) after ``--warmup`` steps; checkpointing and start-up are excluded. Each
round runs both sides of every schedule, pp=1 and pp=2 alternating which goes first, and
the ratio is taken per round; the median and the spread (min-max) over rounds are printed,
so a burst of load on the shared machine moves one round, not the result. Both sides must
log the same loss at every step (within 1e-5): the loss does not depend on the layout.

Bubble fraction, predicted: the share of a step a pipeline rank idles in the schedule with
equal stage times and free communication, (p-1)/(m+p-1) for 1F1B and GPipe with p stages and
m micro-batches, (p-1)/(v*m+p-1) for Interleaved1F1B with v chunks per rank. Measured:
1 - T_pp1/T_pp2 = 1 - ratio, the share of the pp=2 step time beyond the dp=2 step time (T:
seconds per step). It is an upper bound on the bubble only in the sense that it lumps
together everything that differs between the sides: the bubble, the stage imbalance (the
last stage's output projection and loss), the point-to-point sends, the schedule's Python
overhead, and, with the opposite sign, FSDP's all-gathers and reduce-scatter on the dp=2
side. ``--record`` appends the result to bench/RESULTS.md (a row per schedule in the
Current table, replacing this benchmark's earlier rows, and the full table under History).

    python -m bench.pipeline [--layers 8] [--hidden 256] [--seq 256] [--micro-batch 1] [--microbatches 4] [--steps 8] [--warmup 2] [--rounds 3] [--schedules 1F1B GPipe Interleaved1F1B] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_name("RESULTS.md")
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss ([-+0-9.eE]+|nan|inf) \|.* \| ([0-9.]+) tokens/s \|")
LOSS_TOLERANCE = 1e-5


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


def prepare(work: Path, args) -> tuple[Path, Path, int]:
    """The benchmark model (random weights, the sample tokenizer) and the tokenized sample
    corpus; returns (model dir, data prefix, parameter count)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain
    from llmflow.sample import SampleConfig, write_sample

    sample = write_sample(SampleConfig(out=work / "sample")) / "model"
    tokenize_pretrain(PretrainTokenizeConfig(input=[work / "sample" / "pretrain" / "corpus.parquet"], tokenizer=sample,
                                             out=work / "wiki", append_eod=True))
    vocab = json.loads((sample / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=max(1024, args.seq), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (sample / name).is_file():
            shutil.copy(sample / name, model_dir / name)
    return model_dir, work / "wiki", params


def layouts(args, layers: int) -> list[tuple[str, dict]]:
    """(name, pipeline settings) of each pp=2 side to measure."""
    sides = []
    for schedule in args.schedules:
        if schedule == "Interleaved1F1B":
            if layers < 2 * args.virtual_stages or args.microbatches % 2:
                print(f"skipping Interleaved1F1B: {layers} layers / microbatches {args.microbatches} "
                      f"do not fit pp=2 x virtual_stages={args.virtual_stages}", flush=True)
                continue
            sides.append((schedule, {"pp": 2, "pp_schedule": schedule, "virtual_stages": args.virtual_stages}))
        else:
            sides.append((schedule, {"pp": 2, "pp_schedule": schedule}))
    return sides


def run_side(model: Path, data: Path, work: Path, pipeline: dict, args) -> dict:
    """One launch of the training worker on 2 ranks; returns its per-step losses and step
    seconds and the tokens/s after the warm-up steps."""
    from llmflow.launch import run_workers, torchrun_command
    from llmflow.train.config import TrainConfig

    pp = pipeline.get("pp", 1)
    dp = 2 // pp
    config = TrainConfig.model_validate({
        "model": str(model),
        "out": str(work / "run"),
        "data": {"kind": "pretrain", "paths": [str(data)]},
        "steps": args.warmup + args.steps,
        "seq_length": args.seq,
        "micro_batch_size": args.micro_batch,
        "global_batch_size": args.micro_batch * args.microbatches,
        "microbatches": args.microbatches // dp,
        "optim": {"lr": args.lr, "warmup_steps": 0, "decay": "constant"},
        "dtype": "fp32",
        "log_interval": 1,
        **pipeline,
    })
    shutil.rmtree(work / "run", ignore_errors=True)  # a run directory with a checkpoint would resume
    path = work / "train.json"
    path.write_text(config.model_dump_json())
    lines: list[str] = []
    start = time.perf_counter()
    run_workers(torchrun_command("llmflow.train", [str(path)], 2), on_line=lines.append, cwd=REPO,
                env={"OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu"})
    wall = time.perf_counter() - start
    tokens = config.global_batch_size * args.seq
    losses, seconds = {}, {}
    for line in lines:
        match = STEP_LINE.match(line)
        if match:
            step = int(match[1])
            losses[step] = float(match[3])
            seconds[step] = tokens / float(match[4])
    if sorted(losses) != list(range(1, config.steps + 1)):
        raise SystemExit("the training worker logged no step line for some steps; its output:\n" + "\n".join(lines[-30:]))
    timed = [seconds[s] for s in range(args.warmup + 1, config.steps + 1)]
    return {"losses": [losses[s] for s in sorted(losses)], "step_s": timed,
            "tokens_per_s": tokens * len(timed) / sum(timed), "wall_s": wall}


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
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    if args.microbatches % 2:
        parser.error("--microbatches must be even: the pp=1 side splits them over dp=2 ranks")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data, params = prepare(work, args)
        sides = layouts(args, args.layers)
        runs: dict[str, list[tuple[dict, dict]]] = {name: [] for name, _ in sides}
        for r in range(args.rounds):
            for name, pipeline in sides:
                order = [("pp1", {}), ("pp2", pipeline)]
                if r % 2:
                    order.reverse()
                got = {label: run_side(model, data, work, settings, args) for label, settings in order}
                ratio = got["pp2"]["tokens_per_s"] / got["pp1"]["tokens_per_s"]
                diff = max(abs(a - b) for a, b in zip(got["pp1"]["losses"], got["pp2"]["losses"], strict=True))
                print(f"round {r + 1} {name}: pp1 {got['pp1']['tokens_per_s']:.0f} tok/s, pp2 "
                      f"{got['pp2']['tokens_per_s']:.0f} tok/s, ratio {ratio:.3f}, max loss diff {diff:.1e}", flush=True)
                if diff > LOSS_TOLERANCE:
                    raise SystemExit(f"{name}: pp=2 and pp=1 logged different losses (max diff {diff:.2e} > "
                                     f"{LOSS_TOLERANCE}):\npp1 {got['pp1']['losses']}\npp2 {got['pp2']['losses']}")
                runs[name].append((got["pp1"], got["pp2"]))

    rows = []
    for name, pipeline in sides:
        pairs = runs[name]
        ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in pairs]
        p, m, v = 2, args.microbatches, pipeline.get("virtual_stages", 1)
        rows.append({
            "schedule": name if v == 1 else f"{name} v={v}",
            "pp1_tokens_per_s": round(statistics.median(a["tokens_per_s"] for a, _ in pairs)),
            "pp2_tokens_per_s": round(statistics.median(b["tokens_per_s"] for _, b in pairs)),
            "pp1_step_s": round(statistics.median(s for a, _ in pairs for s in a["step_s"]), 3),
            "pp2_step_s": round(statistics.median(s for _, b in pairs for s in b["step_s"]), 3),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3),
            "bubble_predicted": round((p - 1) / (v * m + p - 1), 3),
            "bubble_measured": round(1 - statistics.median(ratios), 3),
            "max_loss_diff": max(max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) for a, b in pairs),
            "launch_wall_s": round(statistics.median(x["wall_s"] for pair in pairs for x in pair), 1),
        })
        print(json.dumps(rows[-1]), flush=True)
    total = time.perf_counter() - started
    print(f"model {params / 1e6:.1f}M parameters; {total:.0f} s in all", flush=True)
    if args.record:
        record(rows, args, params, load)


def record(rows: list[dict], args, params: int, load: str) -> None:
    day = time.strftime("%Y-%m-%d")
    tokens = args.micro_batch * args.microbatches * args.seq
    command = (f"python -m bench.pipeline --layers {args.layers} --hidden {args.hidden} --seq {args.seq} "
               f"--micro-batch {args.micro_batch} --microbatches {args.microbatches} --steps {args.steps} "
               f"--warmup {args.warmup} --rounds {args.rounds}")
    current = [
        f"| `bench.pipeline` {row['schedule']} | pp=1 (dp=2, FSDP) on the same 2 ranks, same global batch and losses "
        f"(fp32, m={args.microbatches}) | {row['ratio_median']:.2f}x tokens/s; bubble {row['bubble_measured']:.0%} "
        f"measured, {row['bubble_predicted']:.0%} predicted | {row['ratio_min']:.2f}x-{row['ratio_max']:.2f}x over "
        f"{args.rounds} rounds | 1 per rank | {load} | {day} |"
        for row in rows
    ]
    text = RESULTS.read_text()
    head, sep, history = text.partition("\n## History\n")
    lines = [line for line in head.split("\n") if not line.startswith("| `bench.pipeline`")]
    last_row = max(i for i, line in enumerate(lines) if line.startswith("| `bench."))
    lines[last_row + 1:last_row + 1] = current
    entry = [
        "",
        (f"### Pipeline parallelism, pp=2 against pp=1 ({day}, {cpu_model()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, 1 thread per rank, cpu, gloo, load average {load} before the run)"),
        "",
        (f"`{command}`: `llmflow train` on 2 ranks, pp=2 (dp=1) against pp=1 (dp=2, FSDP), random Llama-shaped "
        f"model ({params / 1e6:.1f}M parameters: {args.layers} layers, hidden {args.hidden}, FFN {args.intermediate}, "
        f"untied, vocab 896), fp32, global batch {args.micro_batch * args.microbatches} x seq {args.seq} "
        f"({tokens} tokens) in m={args.microbatches} micro-batches of {args.micro_batch} for the pipeline "
        f"({args.microbatches // 2} per rank at dp=2); tokens/s over {args.steps} steps after {args.warmup} warm-up "
        f"steps, medians over {args.rounds} alternating rounds. Measured bubble = 1 - T_pp1/T_pp2 (bubble, stage "
        "imbalance, sends and schedule overhead, less FSDP's collectives on the pp=1 side)."),
        "",
        ("| schedule | pp=1 tok/s | pp=2 tok/s | pp=1 step s | pp=2 step s | pp2 / pp1, median | min | max "
        "| bubble predicted | bubble measured | max loss diff |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    entry += [
        f"| {row['schedule']} | {row['pp1_tokens_per_s']} | {row['pp2_tokens_per_s']} | {row['pp1_step_s']:.3f} | "
        f"{row['pp2_step_s']:.3f} | {row['ratio_median']:.3f}x | {row['ratio_min']:.3f}x | {row['ratio_max']:.3f}x | "
        f"{row['bubble_predicted']:.1%} | {row['bubble_measured']:.1%} | {row['max_loss_diff']:.1e} |"
        for row in rows
    ]
    RESULTS.write_text("\n".join(lines) + sep + history.rstrip("\n") + "\n" + "\n".join(entry) + "\n")
    print(f"recorded in {RESULTS}", flush=True)


if __name__ == "__main__":
    main()
