"""DPO training-step benchmark: llmflow's preference objective against TRL's ``DPOTrainer``.

One DPO optimizer step (loss_type sigmoid, beta 0.1) on the same weights and the same
batch of chosen/rejected pairs, full weights, fp32, CPU, one process, for the ~58M-parameter
Llama config ``50m`` of ``bench.train_step``. Two sides, each in its own subprocess (both
import the same libraries, so peak resident memory is measured per side):

- ``trl``: ``DPOTrainer`` (TRL 1.16) at its defaults but for what the comparison fixes:
  fp32 (``bf16=False``; TRL turns bf16 on by default), activation checkpointing off (TRL's
  default is on; llmflow's side does not recompute either) and ``precompute_ref_log_probs=True``
  (reference log-probs computed once at construction, no reference model in memory). The
  trainer tokenizes the text pairs itself; a step is ``trainer.training_step`` (its
  ``compute_loss``: the fused, chunked LM head with its entropy/logit/accuracy metrics,
  then ``backward``) and ``trainer.optimizer.step()``, the optimizer its
  ``create_optimizer`` builds from the defaults (fused AdamW, lr 1e-6, no weight decay);
- ``llmflow``: llmflow's ``CausalLM`` on the same ids packed as preference rows (one pair per
  row: chosen and rejected side by side as documents, then padding), every token's cross
  entropy (``loss_reduction="none"``) summed per document and turned into the DPO loss by
  ``llmflow.train.preference`` against reference log-probs computed once before the steps;
  then ``backward`` and the same AdamW (``torch.optim.AdamW``, fused, TRL's lr, betas, eps).

A round runs both sides once (the order reversed every other round), each side timing
``--steps`` steps after ``--warmup`` warm-up steps; the reference pass and construction are
not timed. Every step's loss must agree between the sides within ``LOSS_TOLERANCE`` in every
round (the first step's is log 2 on both, since the policy starts as the reference; the later
ones follow the AdamW updates). The ratio per round is TRL's step time / llmflow's (> 1: llmflow
faster); its median and spread (min-max) over the rounds are printed, with each side's peak
RSS (largest over the rounds).

    python -m bench.dpo [--rounds 3] [--steps 1] [--warmup 1] [--pairs 2] [--prompt 128] [--response 128] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import cpu_model, own_memory_mib
from bench.results import update_results
from bench.train_step import CONFIGS, make_model, spread

REPO = Path(__file__).resolve().parent.parent
CONFIG = "50m"
SIDES = ("trl", "llmflow")
BETA = 0.1
LOSS_TOLERANCE = 5e-5
"""Largest |loss difference| allowed between the sides at any step (fp32, losses ~0.6-0.69).
The first step's is log 2 exactly on both; after an update, each sequence's log-prob is a sum
of ~200 token log-probs of ~-10.4 (~-2e3, where fp32's spacing is 2.4e-4), which the two LM
heads round differently: up to ~1e-3 in a margin, ~5e-5 in the loss at beta 0.1 (measured:
~6e-6). A step that differs (another learning rate, a missed update, other reference
log-probs) moves the loss by ~1e-2 or more."""
PAD, IM_START, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def word_tokenizer(vocab_size: int):
    """One token per whitespace-separated word "w<id>" (ids 3 up), pad 0, EOS 2: text of
    random ids round-trips exactly, so TRL's tokenization gives back the ids drawn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, IM_START: 1, EOS: 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([PAD, IM_START, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)


def make_pairs(vocab_size: int, pairs: int, prompt: int, response: int) -> list[tuple[list[int], ...]]:
    """Seeded random (prompt, chosen, rejected) ids: prompts of ``prompt`` less 8 per pair,
    responses of ``response / 2`` to ``response`` tokens (EOS not included)."""
    g = torch.Generator().manual_seed(0)

    def draw(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=g).tolist()

    def length() -> int:
        return int(torch.randint(response // 2, response + 1, (1,), generator=g))

    return [(draw(max(1, prompt - 8 * k)), draw(length()), draw(length())) for k in range(pairs)]


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def build_trl(model_dir: str, pairs: list, out_dir: str):
    """TRL's trainer, its collated batch (reference log-probs included) and its step."""
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    tokenizer = word_tokenizer(vocab)
    texts = {"prompt": [words(p) for p, _, _ in pairs], "chosen": [" " + words(c) for _, c, _ in pairs],
             "rejected": [" " + words(r) for _, _, r in pairs]}
    args = DPOConfig(output_dir=out_dir, report_to="none", use_cpu=True, bf16=False, activation_checkpointing=False,
                     precompute_ref_log_probs=True, per_device_train_batch_size=len(pairs), beta=BETA,
                     loss_type="sigmoid", max_length=None, seed=0, disable_tqdm=True)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_dict(texts), processing_class=tokenizer)
    rows = [trainer.train_dataset[k] for k in range(len(pairs))]
    for row, (p, c, r) in zip(rows, pairs):  # both sides consume the same ids
        eos = tokenizer.eos_token_id
        if (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) != (p, c + [eos], r + [eos]):
            sys.exit("bench.dpo: TRL tokenized other ids than the pairs drawn")
    batch = trainer._prepare_inputs(trainer.data_collator(rows))
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # what its train loop sets (no accumulation)

    def step() -> float:
        loss = trainer.training_step(trainer.model, batch)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    group = trainer.optimizer.param_groups[0]
    optim = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "fused")}
    return step, optim, int(batch["attention_mask"].sum()), batch["input_ids"].numel()


def pack(pairs: list, eos: int, pad: int) -> dict[str, torch.Tensor]:
    """One preference row per pair: chosen (prompt + response + EOS) as document 0, rejected
    as document 1, then padding (document 2); targets are the next response token, -100 on
    prompt positions, each document's last position and padding."""
    import numpy as np

    from llmflow.data.instruction_dataset import next_token_targets

    docs = [[(p + c + [eos], len(p)), (p + r + [eos], len(p))] for p, c, r in pairs]
    length = max(sum(len(ids) for ids, _ in row) for row in docs)
    input_ids = np.full((len(docs), length), pad, dtype=np.int64)
    labels = np.full((len(docs), length), -100, dtype=np.int64)
    document_ids = np.zeros((len(docs), length), dtype=np.int64)
    for b, row in enumerate(docs):
        pos = 0
        for d, (ids, prompt) in enumerate(row):
            input_ids[b, pos : pos + len(ids)] = ids
            labels[b, pos + prompt : pos + len(ids)] = ids[prompt:]
            document_ids[b, pos : pos + len(ids)] = d
            pos += len(ids)
        document_ids[b, pos:] = len(row)
    return {"input_ids": torch.from_numpy(input_ids), "document_ids": torch.from_numpy(document_ids),
            "targets": torch.from_numpy(next_token_targets(labels, document_ids))}


def build_llmflow(model_dir: str, pairs: list, optim: dict):
    """llmflow's model, its reference log-probs and its step."""
    from llmflow.train.preference import PreferenceConfig, document_sums, pair_documents, pair_logps, pair_terms
    from llmflow.weights import load_hf_model

    model = load_hf_model(model_dir).train()
    rows = pack(pairs, eos=2, pad=0)
    response = rows["targets"] != -100
    documents = pair_documents(rows["document_ids"])
    counts = document_sums(response.float(), response, rows["document_ids"], documents)
    config = PreferenceConfig(beta=BETA, loss_type="sigmoid")

    def logps():
        ce = model(rows["input_ids"], labels=rows["targets"], document_ids=rows["document_ids"], loss_reduction="none")
        return pair_logps(document_sums(-ce, response, rows["document_ids"], documents), counts)[0]

    with torch.no_grad():
        reference = logps()
    opt = torch.optim.AdamW(model.parameters(), **optim)

    def step() -> float:
        policy = logps()
        loss = pair_terms("dpo", config, policy, reference).losses.sum() / len(pairs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, int((rows["document_ids"] < 2).sum()), rows["input_ids"].numel()


def run_side(side: str, model_dir: str, args: argparse.Namespace) -> dict:
    """Runs in a child process: build the side, run its warm-up and timed steps, report."""
    # The same imports on every side: equal baseline memory.
    import datasets  # noqa: F401
    import trl  # noqa: F401

    import llmflow.train.preference  # noqa: F401
    from llmflow.weights import load_hf_model  # noqa: F401

    torch.manual_seed(0)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    pairs = make_pairs(vocab, args.pairs, args.prompt, args.response)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        optim = {"lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "fused": True}
        if side == "trl":
            step, optim, tokens, positions = build_trl(model_dir, pairs, out_dir)
        else:
            step, tokens, positions = build_llmflow(model_dir, pairs, optim)
        setup_s = time.perf_counter() - t0
        times, losses = [], []
        for _ in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t0)
    return {
        "side": side,
        "step_s": statistics.median(times[args.warmup :]),
        "first_step_s": times[0],
        "setup_s": setup_s,
        "losses": losses,
        "tokens": tokens,
        "positions": positions,
        "optim": {k: list(v) if isinstance(v, tuple) else v for k, v in optim.items()},
        "peak_rss_mib": own_memory_mib(),
        "threads": torch.get_num_threads(),
    }


def run_child(side: str, model_dir: str, args: argparse.Namespace) -> dict:
    import subprocess

    cmd = [sys.executable, "-m", "bench.dpo", "--child", side, model_dir, "--pairs", str(args.pairs),
           "--prompt", str(args.prompt), "--response", str(args.response), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"bench.dpo: the {side} side failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(args: argparse.Namespace, loads: list[float]) -> dict:
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    loss_diff = 0.0
    with tempfile.TemporaryDirectory() as model_dir:
        config = make_model(CONFIG, model_dir)
        params = count_params(model_dir)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for side in SIDES if r % 2 == 0 else tuple(reversed(SIDES)):
                result = run_child(side, model_dir, args)
                runs[side].append(result)
                print(f"round {r + 1}/{args.rounds} {side}: step {result['step_s']:.2f} s (first {result['first_step_s']:.2f} s, "
                      f"setup {result['setup_s']:.1f} s), losses {', '.join(f'{x:.7f}' for x in result['losses'])}, "
                      f"peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
            trl, ours = runs["trl"][-1], runs["llmflow"][-1]
            diff = max(abs(a - b) for a, b in zip(trl["losses"], ours["losses"]))
            if diff > LOSS_TOLERANCE:
                sys.exit(f"bench.dpo round {r + 1}: step losses differ by {diff:.2e} > {LOSS_TOLERANCE:.0e}: "
                         "the sides did not compute the same steps")
            loss_diff = max(loss_diff, diff)
    if runs["trl"][0]["optim"] != runs["llmflow"][0]["optim"]:
        sys.exit(f"bench.dpo: the optimizers differ: {runs['trl'][0]['optim']} against {runs['llmflow'][0]['optim']}")
    ratios = [t["step_s"] / o["step_s"] for t, o in zip(runs["trl"], runs["llmflow"])]
    return {
        "config": config,
        "params": params,
        "runs": runs,
        "ratio": spread(ratios),
        "memory": max(r["peak_rss_mib"] for r in runs["llmflow"]) / max(r["peak_rss_mib"] for r in runs["trl"]),
        "loss_diff": loss_diff,
    }


def count_params(model_dir: str) -> int:
    """Parameters in the checkpoint (every *.safetensors file), without loading them."""
    import math

    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    return total


def describe(row: dict, args: argparse.Namespace) -> str:
    trl, ours = row["runs"]["trl"][0], row["runs"]["llmflow"][0]
    return (f"Llama {CONFIG} ({row['params'] / 1e6:.1f}M parameters: vocabulary {CONFIGS[CONFIG]['vocab_size']}, "
            f"hidden {CONFIGS[CONFIG]['hidden_size']}, {CONFIGS[CONFIG]['num_hidden_layers']} layers), {args.pairs} "
            f"pairs (prompts of {args.prompt} less 8 per pair, responses of {args.response // 2}-{args.response} tokens "
            f"plus EOS): {trl['tokens']} real tokens a step, in {trl['positions']} positions on TRL's side "
            f"({2 * args.pairs} sequences padded to the longest) and {ours['positions']} on llmflow's ({args.pairs} rows "
            f"of chosen | rejected | padding)")


def trl_heading(name: str, threads: int, loads: list[float], load_after: float) -> str:
    """The History heading of a benchmark against TRL: the date, machine, libraries, threads and load."""
    import transformers
    import trl

    load = ", ".join(f"{x:.1f}" for x in loads)
    return (f"### {name} ({time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, trl {trl.__version__}, {threads} threads, "
            f"load average {load} at the rounds' starts, {load_after:.1f} after)")


def report(row: dict, args: argparse.Namespace, loads: list[float], load_after: float) -> list[str]:
    """The History entry (markdown lines)."""

    runs = row["runs"]
    lines = [
        trl_heading("dpo", runs['llmflow'][0]['threads'], loads, load_after),
        "",
        (f"`python -m bench.dpo --rounds {args.rounds} --steps {args.steps} --warmup {args.warmup} --pairs {args.pairs} "
         f"--prompt {args.prompt} --response {args.response}`: one DPO step (sigmoid, beta {BETA}), fp32, full "
         f"weights, forward + backward + fused AdamW (lr {runs['trl'][0]['optim']['lr']:g}), reference log-probs "
         f"precomputed on both sides (TRL's `precompute_ref_log_probs=True`), TRL's activation checkpointing off; "
         f"{describe(row, args)}. Each side in its own process, {args.rounds} rounds, sides alternating; step time = "
         f"median of {args.steps} steps after {args.warmup} warm-up; every step's loss agrees within "
         f"{row['loss_diff']:.1e} (tolerance {LOSS_TOLERANCE:.0e})."),
        "",
        "| side | step s median (min-max) | first step s | setup s (incl. reference pass) | peak RSS MiB |",
        "|---|---|---|---|---|",
    ]
    for side in SIDES:
        step = spread([r["step_s"] for r in runs[side]])
        lines.append(f"| {side} | {step['median']:.2f} ({step['min']:.2f}-{step['max']:.2f}) "
                     f"| {statistics.median(r['first_step_s'] for r in runs[side]):.2f} "
                     f"| {statistics.median(r['setup_s'] for r in runs[side]):.1f} "
                     f"| {max(r['peak_rss_mib'] for r in runs[side]):.0f} |")
    ratio = row["ratio"]
    lines += [
        "",
        (f"Speed ratio (TRL step time / llmflow step time, per round): median {ratio['median']:.2f}x, "
         f"min {ratio['min']:.2f}x, max {ratio['max']:.2f}x; memory ratio (llmflow peak RSS / TRL's): "
         f"{row['memory']:.2f}x."),
        "",
    ]
    return lines


def record(row: dict, args: argparse.Namespace, entry: list[str], loads: list[float]) -> None:
    """Append ``entry`` to History and replace this benchmark's row of the Current table."""
    ratio = row["ratio"]
    load = ", ".join(f"{x:.1f}" for x in loads)
    current = [
        (f"| `bench.dpo` | TRL `DPOTrainer` training step (sigmoid, fp32, full weights, reference log-probs "
         f"precomputed on both sides, {args.pairs} pairs of up to {args.prompt + args.response + 1} tokens a side, "
         f"~{row['params'] / 1e6:.0f}M Llama, same step losses) | {ratio['median']:.2f}x speed; {row['memory']:.2f}x "
         f"memory | {ratio['min']:.2f}x-{ratio['max']:.2f}x over {args.rounds} rounds "
         f"| {row['runs']['llmflow'][0]['threads']} | {load} | {time.strftime('%Y-%m-%d')} |")
    ]
    update_results(current, entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both sides, alternating (at least 1)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per side and round")
    parser.add_argument("--pairs", type=int, default=2, help="chosen/rejected pairs in the batch")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of the first pair (8 fewer per pair after)")
    parser.add_argument("--response", type=int, default=128, help="longest response (each drawn from half this up)")
    parser.add_argument("--record", action="store_true", help="record the result in bench/RESULTS.md")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("rounds", "steps", "warmup", "pairs", "prompt", "response"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.child:
        print(json.dumps(run_side(args.child[0], args.child[1], args)))
        return

    loads: list[float] = []
    row = bench(args, loads)
    entry = report(row, args, loads, os.getloadavg()[0])
    print("\n".join(entry))
    if args.record:
        record(row, args, entry, loads)


if __name__ == "__main__":
    main()
