"""Generation benchmark: llmflow's KV-cache decoding against transformers' ``generate``.

Greedy decoding, CPU, fp32, the same ~50M-parameter Llama weights and the same prompts
(random token ids of different lengths, left-padded in a batch), every row generating
exactly ``--new-tokens`` tokens. Each side runs in its own subprocess after one warm-up
call. Prints generated tokens/s per batch size, the ratio and whether both sides produced
the same tokens; with --record appends the result to bench/RESULTS.md.

    python -m bench.generate [--batches 1 8] [--new-tokens 64] [--record]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CONFIG = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048}


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(16, 65, (batch,), generator=g).tolist()
    return [torch.randint(3, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def hf_runner(model_dir: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
        return out[:, width:].tolist()

    return run


def llmflow_runner(model_dir: str):
    import transformers  # noqa: F401  (same imports on both sides)

    from llmflow.infer import GenerateConfig, generate
    from llmflow.models import load_hf_model

    model = load_hf_model(model_dir).eval()
    tokenizer = word_tokenizer()

    def run(rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        config = GenerateConfig(max_new_tokens=new_tokens)
        return [r.tokens for r in generate(model, tokenizer, rows, config)]

    return run


def word_tokenizer():
    """A tokenizer with one word per id, for turning the generated ids into text."""
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(CONFIG["vocab_size"])}, unk_token="w0"))


def run_side(side: str, model_dir: str, batches: list[int], new_tokens: int) -> dict:
    """Runs in a child process: time each batch size after a warm-up call."""
    torch.manual_seed(0)
    run = hf_runner(model_dir) if side == "transformers" else llmflow_runner(model_dir)
    run(prompts(2), 4)
    result = {}
    for batch in batches:
        t0 = time.perf_counter()
        tokens = run(prompts(batch), new_tokens)
        seconds = time.perf_counter() - t0
        result[str(batch)] = {"tokens_per_s": batch * new_tokens / seconds, "s": seconds, "tokens": tokens}
    return result


def make_model(directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=False)).save_pretrained(directory)


def record(rows: list[dict], args: argparse.Namespace) -> None:
    import transformers

    lines = [
        f"\n## Generation, greedy, {args.new_tokens} new tokens, CPU fp32 (~50M Llama) ({time.strftime('%Y-%m-%d')})\n",
        (f"{platform.machine()}, {torch.get_num_threads()} threads, Python {platform.python_version()}, "
         f"torch {torch.__version__}, transformers {transformers.__version__}. `python -m bench.generate`\n"),
        "| batch | transformers tokens/s | llmflow tokens/s | ratio | same tokens |",
        "|---|---|---|---|---|",
        *(f"| {r['batch']} | {r['transformers']:,.1f} | {r['llmflow']:,.1f} | {r['ratio']:.2f}x | {r['same']} |" for r in rows),
    ]
    with (REPO / "bench" / "RESULTS.md").open("a") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_side(args.child[0], args.child[1], args.batches, args.new_tokens)))
        return
    sides = {}
    with tempfile.TemporaryDirectory() as model_dir:
        make_model(model_dir)
        for side in ("transformers", "llmflow"):
            cmd = [sys.executable, "-m", "bench.generate", "--child", side, model_dir,
                   "--new-tokens", str(args.new_tokens), "--batches", *map(str, args.batches)]
            out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout
            sides[side] = json.loads(out.strip().splitlines()[-1])
    rows = []
    for batch in map(str, args.batches):
        hf, ours = sides["transformers"][batch], sides["llmflow"][batch]
        rows.append({"batch": batch, "transformers": hf["tokens_per_s"], "llmflow": ours["tokens_per_s"],
                     "ratio": ours["tokens_per_s"] / hf["tokens_per_s"], "same": hf["tokens"] == ours["tokens"]})
        print(f"batch {batch}: transformers {hf['tokens_per_s']:,.1f} tok/s, llmflow {ours['tokens_per_s']:,.1f} tok/s, "
              f"{rows[-1]['ratio']:.2f}x, same tokens: {rows[-1]['same']}")
    if args.record:
        record(rows, args)


if __name__ == "__main__":
    main()
