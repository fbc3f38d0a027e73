"""Training-step benchmark: llmflow's decoder against transformers' LlamaForCausalLM.

One forward + backward + AdamW step on the same weights and batch, CPU, fp32, one process,
for a ~50M-parameter config and the same config with Qwen's 151,936-token vocabulary.
Each side runs in its own subprocess (both import the same libraries) so that peak
resident memory is measured per side. Prints tokens/s, peak RSS and the ratios, and with
--record appends the result to bench/RESULTS.md.

    python -m bench.train_step [--steps 4] [--batch 4] [--seq 512] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

CONFIGS = {
    "50m": {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048},
    "large-vocab": {"vocab_size": 151936, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                    "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048},
}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_side(side: str, model_dir: str, batch: int, seq: int, steps: int) -> dict:
    """Runs in a child process: train ``steps`` steps, report timings and memory."""
    import transformers  # noqa: F401  (same imports on both sides: equal baseline memory)

    import llmflow.models

    torch.manual_seed(0)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (batch, seq))
    if side == "transformers":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

        def loss_fn():
            return model(input_ids=tokens, labels=tokens).loss
    else:
        model = llmflow.models.load_hf_model(model_dir)
        labels = torch.cat([tokens[:, 1:], torch.full((batch, 1), -100)], dim=1)

        def loss_fn():
            return model(tokens, labels=labels)

    model.train()
    # The same optimizer on both sides: the fused AdamW kernel where torch has one.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    rss_before = _rss_mib()
    times, losses = [], []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step_s = statistics.median(times[1:])  # the first step includes allocator warm-up
    return {
        "side": side,
        "tokens_per_s": batch * seq / step_s,
        "step_s": step_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_load_mib": rss_before,
        "first_loss": losses[0],
    }


def make_model(name: str, directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    LlamaForCausalLM(LlamaConfig(**CONFIGS[name], tie_word_embeddings=False)).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_side(args.child[0], args.child[1], args.batch, args.seq, args.steps)))
        return

    rows = []
    for name in args.configs:
        with tempfile.TemporaryDirectory() as model_dir:
            make_model(name, model_dir)
            result = {}
            for side in ("transformers", "llmflow"):
                cmd = [sys.executable, "-m", "bench.train_step", "--child", side, model_dir,
                       "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ, cwd=REPO).stdout
                result[side] = json.loads(out.strip().splitlines()[-1])
        hf, ours = result["transformers"], result["llmflow"]
        row = {
            "config": name,
            "hf_tok_s": hf["tokens_per_s"], "ours_tok_s": ours["tokens_per_s"],
            "speed_ratio": ours["tokens_per_s"] / hf["tokens_per_s"],
            "hf_peak_mib": hf["peak_rss_mib"], "ours_peak_mib": ours["peak_rss_mib"],
            "mem_ratio": ours["peak_rss_mib"] / hf["peak_rss_mib"],
            "loss_diff": abs(hf["first_loss"] - ours["first_loss"]),
        }
        rows.append(row)
        print(json.dumps(row))

    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    lines = [
        f"### train_step ({time.strftime('%Y-%m-%d')}, {machine})",
        f"batch {args.batch} x seq {args.seq}, fp32, forward+backward+AdamW, median of {args.steps} steps after 1 warm-up",
        "",
        "| config | transformers tok/s | llmflow tok/s | speed ratio | transformers peak RSS MiB | llmflow peak RSS MiB | memory ratio | first-step loss diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['hf_tok_s']:.0f} | {r['ours_tok_s']:.0f} | {r['speed_ratio']:.2f}x "
            f"| {r['hf_peak_mib']:.0f} | {r['ours_peak_mib']:.0f} | {r['mem_ratio']:.2f}x | {r['loss_diff']:.1e} |"
        )
    print("\n".join(lines))
    if args.record:
        results = Path(__file__).with_name("RESULTS.md")
        with results.open("a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
