"""Non-finite guard overhead: a train step with the training loop's guard against the same
step without it.

The guarded step is the loop's: total gradient norm, ``finite_step`` (the loss and the norm
fetched in one host sync and checked), then clipping with that norm and AdamW. The
unguarded step is the loop's before the guard: ``clip_grad_norm_`` and AdamW, with no host
sync at all (the worst case for the guard: the old loop synced only on logging steps).
The sample model (``llmflow sample``), one process, fp32, one fixed batch. Each round runs
both sides (a warm-up step, then ``--steps`` timed steps each, in alternating order), and
the ratio guarded / unguarded is taken per round; the median and the spread of the ratios
are printed, so a burst of load on a shared machine moves one round, not the result.
Target: <= 1.01x.

    python -m bench.nonfinite_guard [--steps 20] [--rounds 9] [--batch 8] [--seq 256] [--threads N] [--device cpu] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from llmflow.train.loop import finite_step


def time_steps(model, batch: tuple[torch.Tensor, torch.Tensor], optimizer, guarded: bool, steps: int, out: Path) -> float:
    """Seconds per step, after one warm-up step."""
    inputs, targets = batch
    params = [p for p in model.parameters() if p.requires_grad]
    start = 0.0
    for step in range(steps + 1):
        if step == 1:
            _sync(inputs.device)
            start = time.perf_counter()
        loss = model(inputs, labels=targets, loss_reduction="sum") / targets.numel()
        loss.backward()
        if guarded:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            finite_step(step, loss.detach(), norm, [model], out)
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(inputs.device)
    return (time.perf_counter() - start) / steps


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    from llmflow.sample.assets import SampleConfig, write_sample
    from llmflow.weights import load_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = write_sample(SampleConfig(out=work / "sample")) / "model"
        model = load_hf_model(model_dir, device=device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
        batch = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for guarded in (r % 2 == 0, r % 2 == 1):  # alternate which side goes first
                seconds[guarded].append(time_steps(model, batch, optimizer, guarded, args.steps, work / "run"))
    ratios = [g / u for g, u in zip(seconds[True], seconds[False], strict=True)]
    median = statistics.median(ratios)
    result = {
        "unguarded_step_s": round(statistics.median(seconds[False]), 4),
        "guarded_step_s": round(statistics.median(seconds[True]), 4),
        "ratio_median": round(median, 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
    }
    print(json.dumps(result))
    if args.record:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        with Path(__file__).with_name("RESULTS.md").open("a") as f:
            f.write(
                f"\n## Non-finite guard overhead ({time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores, "
                f"torch {torch.__version__}, {args.threads} threads, {args.device}, load average {load})\n\n"
                f"`python -m bench.nonfinite_guard --steps {args.steps} --rounds {args.rounds} --batch {args.batch} "
                f"--seq {args.seq} --threads {args.threads}`: a train step of the sample "
                f"model (batch {args.batch} x seq {args.seq}, fp32: forward, backward, gradient norm, clipping, AdamW), "
                f"with the training loop's guard (loss and gradient norm fetched in one host sync and checked) and "
                f"without (no host sync); ratio per round, {args.rounds} alternating rounds.\n\n"
                "| unguarded step s | guarded step s | guarded / unguarded, median | min | max |\n|---|---|---|---|---|\n"
                f"| {result['unguarded_step_s']:.4f} | {result['guarded_step_s']:.4f} | {median:.4f}x | "
                f"{min(ratios):.4f}x | {max(ratios):.4f}x |\n\n"
                f"Target: <= 1.01x ({'met' if median <= 1.01 else 'not met'}).\n"
            )


if __name__ == "__main__":
    main()
