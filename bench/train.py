"""Training-pipeline overhead: ``llmflow train`` against the bare train step it runs.

Both sides train the sample model (``llmflow sample``) on one CPU rank, fp32, with the same
batch shape and AdamW settings:

- ``pipeline``: the real worker (``python -m llmflow.train``) on the tokenized sample
  corpus: data reading and vocabulary checks, loss normalisation, gradient clipping, the
  per-step log line, and a DCP checkpoint every ``--save-interval`` steps. Its time runs
  from the first step's log line to the process exit, so checkpoints are included;
- ``bare``: forward, backward and AdamW step on one fixed random batch, nothing else.

tokens/s is measured after the first step (warm-up). The sides alternate for ``--rounds``
rounds and each keeps its best round, so a burst of load on a shared machine does not
decide the ratio. The ratio pipeline / bare is the share of speed the pipeline keeps
(target >= 0.9). ``--record`` appends to bench/RESULTS.md.

    python -m bench.train [--steps 60] [--batch 8] [--seq 256] [--save-interval 30] [--rounds 3] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def prepare(work: Path) -> tuple[Path, Path]:
    """Sample assets and their tokenized corpus; returns (model dir, data prefix)."""
    from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain
    from llmflow.sample.assets import SampleConfig, write_sample

    sample = write_sample(SampleConfig(out=work / "sample"))
    model = sample / "model"
    corpus = sample / "pretrain" / "corpus.parquet"
    tokenize_pretrain(PretrainTokenizeConfig(input=[corpus], tokenizer=model, out=work / "wiki", append_eod=True))
    return model, work / "wiki"


def run_pipeline(model: Path, data: Path, work: Path, args) -> float:
    from llmflow.train.config import TrainConfig

    config = TrainConfig.model_validate(
        {
            "model": str(model),
            "out": str(work / "run"),
            "data": {"kind": "pretrain", "paths": [str(data)]},
            "steps": args.steps,
            "seq_length": args.seq,
            "micro_batch_size": args.batch,
            "global_batch_size": args.batch,
            "optim": {"lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
            "save_interval": args.save_interval,
            "log_interval": 1,
        }
    )
    shutil.rmtree(work / "run", ignore_errors=True)
    path = work / "train.json"
    path.write_text(config.model_dump_json())
    env = {**os.environ, "LLMFLOW_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "llmflow.train", str(path)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    start = None
    for line in proc.stdout:
        if start is None and line.startswith("step 1/"):
            start = time.perf_counter()
    if proc.wait() != 0 or start is None:
        sys.exit("the training worker failed")
    seconds = time.perf_counter() - start
    return (args.steps - 1) * args.batch * args.seq / seconds


def run_bare(model_dir: Path, args) -> float:
    from llmflow.weights import load_hf_model

    torch.manual_seed(0)
    model = load_hf_model(model_dir)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)
    model.train()
    start = 0.0
    for step in range(args.steps):
        if step == 1:
            start = time.perf_counter()
        loss = model(inputs, labels=targets, loss_reduction="sum") / targets.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (args.steps - 1) * args.batch * args.seq / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--save-interval", type=int, default=30)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data = prepare(work)
        params = json.loads((model / "config.json").read_text())
        bare = pipeline = 0.0
        for _ in range(args.rounds):
            bare = max(bare, run_bare(model, args))
            pipeline = max(pipeline, run_pipeline(model, data, work, args))
    ratio = pipeline / bare
    print(json.dumps({"bare_tokens_per_s": round(bare), "pipeline_tokens_per_s": round(pipeline), "ratio": round(ratio, 3)}))
    if args.record:
        machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads"
        lines = [
            "",
            f"### train ({time.strftime('%Y-%m-%d')}, {machine})",
            (f"sample model (hidden {params['hidden_size']}, {params['num_hidden_layers']} layers, vocab {params['vocab_size']}), batch {args.batch} x seq {args.seq}, fp32, one rank, "
            f"{args.steps} steps, checkpoint every {args.save_interval}, best of {args.rounds} alternating rounds; "
            "`python -m bench.train`"),
            "",
            "| bare step tok/s | llmflow train tok/s | ratio |",
            "|---|---|---|",
            f"| {bare:.0f} | {pipeline:.0f} | {ratio:.2f}x |",
        ]
        with open(Path(__file__).with_name("RESULTS.md"), "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
