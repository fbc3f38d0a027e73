"""MMLU scoring benchmark: llmflow's one-pass letter scoring against lm-evaluation-harness-style
log-likelihood scoring (four context + continuation requests per question, each its own
sequence), same model, data and batch size. Both must give identical predictions. Prints
questions/s and the speed ratio, and with --record appends the result to bench/RESULTS.md.

    python -m bench.mmlu [--model DIR --data DIR] [--shots 5] [--limit 20] [--batch-size 8] [--record]

Without --model/--data it runs on the built-in sample assets (tiny random model).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from llmflow.evaluate.benchmarks import MMLU
from llmflow.evaluate.engine import prompts_for, select_questions
from llmflow.evaluate.mmlu_data import load_mmlu
from llmflow.evaluate.prompts import CONTINUATIONS
from llmflow.evaluate.scoring import (
    Request,
    model_requests,
    score_loglikelihood,
    score_requests,
)
from llmflow.model_loading import load_model, tokenizer_dir
from llmflow.sample import SampleConfig, write_sample


def timed(fn, repeats: int = 2):
    """The result of ``fn()`` and its fastest time over ``repeats`` runs (the first run of
    each new input shape pays one-off kernel set-up)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, min(times)


def run(model_path: Path, data_path: Path, shots: int, limit: int, batch_size: int) -> dict:
    """Score the same requests both ways (each run twice, the faster run timed); returns
    questions/s of each and the agreement."""
    model, hf_config = load_model(model_path)
    model.eval()
    max_length = int(hf_config.get("max_position_embeddings") or 2048)
    data = load_mmlu(data_path)
    prompts = prompts_for(MMLU, select_questions(MMLU, data, limit), data, shots)
    requests: list[Request] = model_requests(tokenizer_dir(model_path), prompts, CONTINUATIONS)
    (ours, _), ours_s = timed(lambda: score_requests(model, requests, batch_size, max_length))
    theirs, theirs_s = timed(lambda: score_loglikelihood(model, requests, batch_size, max_length))
    n = len(requests)
    return {
        "questions": n,
        "prompt_tokens": sum(len(r.context) for r in requests) / n,
        "ours_q_s": n / ours_s,
        "loglikelihood_q_s": n / theirs_s,
        "speed_ratio": theirs_s / ours_s,
        "same_predictions": ours.argmax(1).tolist() == theirs.argmax(1).tolist(),
        "max_score_diff": float((ours - theirs).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory or checkpoint (default: the sample model)")
    parser.add_argument("--data", type=Path, help="MMLU directory (default: the sample MMLU set)")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--limit", type=int, default=20, help="test questions per subject")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None or args.data is None:
            sample = write_sample(SampleConfig(out=Path(tmp) / "sample", test_questions=args.limit))
        model = args.model or sample / "model"
        data = args.data or sample / "mmlu" / "hf"
        row = run(model, data, args.shots, args.limit, args.batch_size)
    if not row["same_predictions"]:
        raise SystemExit(f"predictions differ: {row}")

    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    lines = [
        f"### mmlu ({time.strftime('%Y-%m-%d')}, {machine})",
        (f"{args.shots}-shot, {row['questions']} questions, {row['prompt_tokens']:.0f} prompt tokens on average, "
        f"batch {args.batch_size}, fp32; model {'sample' if args.model is None else args.model}"),
        "",
        "| one-pass letters q/s | log-likelihood (4 requests) q/s | speed ratio | same predictions | max score diff |",
        "|---|---|---|---|---|",
        (f"| {row['ours_q_s']:.1f} | {row['loglikelihood_q_s']:.1f} | {row['speed_ratio']:.2f}x "
        f"| {row['same_predictions']} | {row['max_score_diff']:.1e} |"),
    ]
    print("\n".join(lines))
    if args.record:
        with Path(__file__).with_name("RESULTS.md").open("a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
