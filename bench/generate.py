"""Generation benchmark: llmflow's KV-cache decoding against transformers' ``generate``,
eager and at its fastest CPU settings, next to the memory-bandwidth roofline.

Greedy decoding, CPU, fp32, the same ~50M-parameter Llama weights and the same prompts
(random token ids of different lengths, left-padded in a batch), every row generating
exactly ``--new-tokens`` tokens. Three sides, each in its own process with the model loaded
once:

- ``transformers``: ``model.generate``, eager, its default dynamic cache;
- ``transformers+compile``: transformers' documented fast path, a static cache
  (``generation_config.cache_implementation = "static"``) and a compiled forward
  (``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``);
- ``llmflow``: ``llmflow.infer.generate``.

Every side first runs each batch size's calls twice over (the compiled side compiles there,
for each shape and once more when a second batch size makes a dimension dynamic: the warm-up
seconds are reported, never timed). Then ``--rounds`` rounds, the sides' order
alternating: each side runs ``--new-tokens`` tokens (the end-to-end time: tokens/s) and one
token (the prefill alone); the decode time per step is the difference over the other
steps. All sides must produce the same tokens, or the benchmark fails.

Roofline: a decode step of batch B reads every weight once (the output projection
included, the embedding only for B rows) and the keys and values cached so far; at the
memory bandwidth the benchmark measures itself (the best of repeated sums of a 256 MiB
tensor on the same threads, between rounds) that is the fastest a step can be.

    python -m bench.generate [--batches 1 8] [--new-tokens 64] [--rounds 5] [--record]
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
from bench.results import update_results
from bench.roofline import decode_step_bytes, measured_bandwidth

REPO = Path(__file__).resolve().parent.parent
CONFIG = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 2048}
SIDES = ("transformers", "transformers+compile", "llmflow")
BASELINES = ("transformers", "transformers+compile")


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(16, 65, (batch,), generator=g).tolist()
    return [torch.randint(3, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def hf_runner(model_dir: str, compiled: bool):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if compiled:
        # transformers' documented recipe (docs: "LLM inference optimization", static cache and torch.compile).
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run(rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
        return out[:, width:].tolist()

    return run


def llmflow_runner(model_dir: str):
    import transformers  # noqa: F401  (same imports on every side)

    from llmflow.infer import GenerateConfig, generate
    from llmflow.weights import load_hf_model

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


def child(side: str, model_dir: str, threads: int) -> None:
    """Serve timing requests on stdin ({"batch", "new_tokens"}), one JSON line per answer."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    run = llmflow_runner(model_dir) if side == "llmflow" else hf_runner(model_dir, side.endswith("+compile"))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = run(prompts(request["batch"]), request["new_tokens"])
        print(json.dumps({"s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "tokens": tokens}), flush=True)


class Side:
    """One side's process, kept alive across rounds."""

    def __init__(self, side: str, model_dir: str, threads: int, env: dict[str, str]) -> None:
        self.name = side
        cmd = [sys.executable, "-m", "bench.generate", "--child", side, model_dir, "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"bench.generate: the {self.name} side failed:\n{self.proc.stderr.read()[-4000:]}")
        return json.loads(line)

    def run(self, batch: int, new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"batch": batch, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every round, every side and batch; the rows of the report and the warm-up seconds."""
    runs: dict[str, dict[int, list[dict]]] = {s: {b: [] for b in args.batches} for s in args.sides}
    bandwidths, warmup = [], {}
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as cache:
        make_model(model_dir)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        sides = {}
        for side in args.sides:
            t0 = time.perf_counter()
            sides[side] = Side(side, model_dir, args.threads, env)
            warmup[side] = {"load": time.perf_counter() - t0}
            # Two passes over the batch sizes, the longest call first (transformers sizes later static caches
            # to it): a compiled forward that sees a second batch size recompiles once more, here and not in a round.
            for _ in range(2):
                for batch in args.batches:
                    seconds = sides[side].run(batch, args.new_tokens)["s"] + sides[side].run(batch, 1)["s"]
                    warmup[side][batch] = warmup[side].get(batch, 0.0) + seconds
            print(f"{side}: loaded in {warmup[side]['load']:.1f} s; first calls "
                  + ", ".join(f"batch {b} {warmup[side][b]:.1f} s" for b in args.batches), flush=True)
        torch.set_num_threads(args.threads)
        for r in range(args.rounds):
            bandwidths.append(measured_bandwidth(torch.device("cpu")))
            for side in args.sides if r % 2 == 0 else reversed(args.sides):
                for batch in args.batches:
                    full, prefill = sides[side].run(batch, args.new_tokens), sides[side].run(batch, 1)
                    step = (full["s"] - prefill["s"]) / (args.new_tokens - 1)
                    cpu_step = (full["cpu_s"] - prefill["cpu_s"]) / (args.new_tokens - 1)
                    runs[side][batch].append({"s": full["s"], "prefill_s": prefill["s"], "step_s": step,
                                              "cpu_step_s": cpu_step, "tokens": full["tokens"]})
                    print(f"round {r + 1}/{args.rounds} {side} batch {batch}: {batch * args.new_tokens / full['s']:.1f} "
                          f"tok/s, decode {step * 1e3:.1f} ms/step, prefill {prefill['s'] * 1e3:.0f} ms", flush=True)
        for s in sides.values():
            s.close()
    bandwidth = max(bandwidths)
    rows = []
    for batch in args.batches:
        reference = runs["llmflow"][batch][0]["tokens"]
        for side in args.sides:
            for run in runs[side][batch]:
                if run["tokens"] != reference:
                    sys.exit(f"bench.generate: {side} generated other tokens than llmflow at batch {batch}")
        width = max(len(p) for p in prompts(batch))
        roofline_s = decode_step_bytes(CONFIG, batch, width + args.new_tokens / 2, value_bytes=4) / bandwidth
        row = {"batch": batch, "roofline_ms": roofline_s * 1e3, "sides": {}, "ratios": {}}
        for side in args.sides:
            rs = runs[side][batch]
            row["sides"][side] = {
                "tokens_per_s": spread([batch * args.new_tokens / r["s"] for r in rs]),
                "step_ms": spread([r["step_s"] * 1e3 for r in rs]),
                "cpu_step_ms": statistics.median(r["cpu_step_s"] * 1e3 for r in rs),
                "prefill_ms": statistics.median(r["prefill_s"] * 1e3 for r in rs),
                "of_roofline": spread([roofline_s / r["step_s"] for r in rs]),
            }
        for base in (b for b in BASELINES if b in args.sides):
            ours, theirs = runs["llmflow"][batch], runs[base][batch]
            row["ratios"][f"llmflow / {base}"] = spread([t["s"] / o["s"] for o, t in zip(ours, theirs)])
            row["ratios"][f"llmflow / {base}, decode"] = spread([t["step_s"] / o["step_s"] for o, t in zip(ours, theirs)])
        rows.append(row)
    return rows, {"bandwidth": bandwidth, "bandwidths": bandwidths, "warmup": warmup}


def make_model(directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=False)).save_pretrained(directory)


def report(rows: list[dict], extra: dict, args: argparse.Namespace, load_before: tuple, load_after: tuple) -> list[str]:
    """The History entry (markdown lines)."""
    import transformers

    load = ", ".join(f"{x:.1f}" for x in load_before)
    bw = extra["bandwidth"]
    lines = [
        (f"### Generation, greedy, {args.new_tokens} new tokens, CPU fp32, ~50M Llama ({time.strftime('%Y-%m-%d')}, "
         f"{cpu_model()}, {os.cpu_count()} cores, {args.threads} threads, torch {torch.__version__}, transformers "
         f"{transformers.__version__}, load average {load} before, {load_after[0]:.1f} after)"),
        "",
        (f"`python -m bench.generate --batches {' '.join(map(str, args.batches))} --new-tokens {args.new_tokens} "
         f"--rounds {args.rounds}`: {args.rounds} rounds, sides alternating, same tokens on every side. tokens/s = "
         f"batch x new tokens / the whole `generate` call; decode ms/step = (time of {args.new_tokens} tokens - time "
         f"of 1) / {args.new_tokens - 1}. Memory bandwidth measured by the benchmark (best 256 MiB sum, "
         f"{args.threads} threads): {bw / 1e9:.1f} GB/s (per round: "
         + ", ".join(f"{b / 1e9:.1f}" for b in extra["bandwidths"]) + "). Roofline = bytes a decode step reads "
         "(weights + cached keys and values at the mean context) / that bandwidth. Warm-up (two passes over each batch "
         "size's calls, not timed): " + "; ".join(
             f"{side} " + ", ".join(f"batch {b} {extra['warmup'][side][b]:.1f} s" for b in args.batches)
             for side in args.sides) + "."),
        "",
    ]
    for row in rows:
        lines += [
            f"Batch {row['batch']}: roofline {row['roofline_ms']:.2f} ms/step ({row['batch'] / row['roofline_ms'] * 1e3:.0f} tok/s).",
            "",
            ("| side | tokens/s median (min-max) | decode ms/step median (min-max) | decode tok/s | of roofline median "
             "(min-max) | decode CPU ms/step (all threads) | prefill ms |"),
            "|---|---|---|---|---|---|---|",
        ]
        for side, s in row["sides"].items():
            t, m, f = s["tokens_per_s"], s["step_ms"], s["of_roofline"]
            lines.append(f"| {side} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | {m['median']:.2f} "
                         f"({m['min']:.2f}-{m['max']:.2f}) | {row['batch'] / m['median'] * 1e3:.1f} | {f['median']:.0%} "
                         f"({f['min']:.0%}-{f['max']:.0%}) | {s['cpu_step_ms']:.2f} | {s['prefill_ms']:.0f} |")
        lines += ["", "| speed ratio | median | min | max |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['median']:.2f}x | {v['min']:.2f}x | {v['max']:.2f}x |" for k, v in row["ratios"].items()]
        lines.append("")
    return lines


def record(rows: list[dict], args: argparse.Namespace, entry: list[str], load_before: tuple) -> None:
    """Append ``entry`` to History and replace this benchmark's rows of the Current table."""
    day = time.strftime("%Y-%m-%d")
    load = ", ".join(f"{x:.1f}" for x in load_before)
    current = []
    for row in rows:
        eager, compiled = row["ratios"]["llmflow / transformers"], row["ratios"]["llmflow / transformers+compile"]
        ours = row["sides"]["llmflow"]
        current.append(
            f"| `bench.generate` batch {row['batch']} | transformers `generate` eager and static cache + "
            f"`torch.compile`, greedy, same tokens (fp32, {args.new_tokens} new tokens) | {compiled['median']:.2f}x "
            f"compiled, {eager['median']:.2f}x eager; {ours['tokens_per_s']['median']:.0f} tok/s, decode at "
            f"{ours['of_roofline']['median']:.0%} of the bandwidth roofline | compiled {compiled['min']:.2f}x-"
            f"{compiled['max']:.2f}x, eager {eager['min']:.2f}x-{eager['max']:.2f}x over {args.rounds} rounds "
            f"| {args.threads} | {load} | {day} |")
    update_results(current, entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES,
                        help="the sides to run (all of them for --record)")
    parser.add_argument("--record", action="store_true", help="record the result in bench/RESULTS.md")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.threads)
        return
    for flag in ("rounds", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2 (decode time = N tokens - 1 token), got {args.new_tokens}")
    if "llmflow" not in args.sides or (args.record and len(args.sides) < len(SIDES)):
        parser.error(f"--sides must include llmflow, and all of {' '.join(SIDES)} with --record; got {args.sides}")
    if any(b < 1 for b in args.batches):
        parser.error(f"--batches must be at least 1, got {args.batches}")
    load_before = os.getloadavg()
    rows, extra = bench(args)
    entry = report(rows, extra, args, load_before, os.getloadavg())
    print("\n".join(entry), flush=True)
    if args.record:
        record(rows, args, entry, load_before)


if __name__ == "__main__":
    main()
