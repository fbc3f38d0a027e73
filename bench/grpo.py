"""GRPO step benchmark: llmflow's ``method: grpo`` against TRL's ``GRPOTrainer``.

One GRPO optimizer step, rollout (sampling ``num_generations`` completions of each prompt,
scoring them, the group advantages) and update (forward, backward, clipping, AdamW), on the
same weights and prompts, fp32, CPU, one process per side, for a ~39M-parameter Qwen2
(vocabulary 32000, hidden 512, 8 layers, 8 heads / 2 KV, tied embeddings). Two sides, each
in its own subprocess (both import the same libraries, so peak resident memory is measured
per side):

- ``trl``: ``GRPOTrainer`` (TRL 1.16) at its defaults (``use_vllm=False``: transformers
  ``generate`` samples; loss dapo, beta 0, one iteration, clipping at 1.0, AdamW) but for what
  the comparison fixes: ``num_generations``, ``max_completion_length``, the step's completions
  (``per_device_train_batch_size`` = prompts x ``num_generations``, so one generation batch
  per optimizer step), the learning rate (1e-6), the reward function, ``use_cpu``, fp32
  (``bf16=False``; TRL turns bf16 on by default) and activation checkpointing off (TRL's
  GRPO default is on; llmflow's side does not recompute either, as in ``bench.dpo``).
  ``trainer.train()`` runs the steps; a callback times each (``on_step_begin`` to
  ``on_step_end``: the rollout, the loss, backward, clipping and the optimizer step);
- ``llmflow``: what ``llmflow train`` runs on one worker, ``setup`` then ``train_step``, with
  ``method: grpo`` and the same settings (the rollout is llmflow's KV-cache sampler, the
  rewards run in its reward worker processes). ``time/rollout_s`` and ``time/update_s`` of
  ``run.metrics`` split each step.

Equal work: the tokenizer's eos id is one past the model's vocabulary, so neither side ever
samples it and every completion is ``max_completion_length`` tokens long (checked: each
side's mean completion length). The prompts are chat conversations of random words rendered
by the tokenizer's chat template on both sides (checked: TRL generates from ids llmflow
renders); the reward (``reward`` below, ``bench.grpo:reward`` to llmflow's reward workers) is
the fraction of even token ids.

A round runs both sides once (the order reversed every other round), each side timing
``--steps`` steps after ``--warmup`` warm-up steps; the ratio per round is TRL's median step
time / llmflow's (> 1: llmflow faster). Before each run the benchmark waits (``--max-wait``
seconds in all) until the rest of the machine is idle, and measures the CPU other jobs take
during it (``bench.process.CpuMeter``, less llmflow's reward workers' own CPU): the medians and
spreads (min-max) are over the rounds in which both runs had the CPUs to themselves (all rounds
where none did), with each side's peak RSS (largest over those rounds) and the sampling and
rollout times' ratios.

    python -m bench.grpo [--rounds 5] [--steps 2] [--warmup 1] [--prompts 2] [--generations 8] [--completion 128] [--max-wait 600] [--record]
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

from bench.dpo import count_params, trl_heading, words
from bench.gpu_train import join_one_rank_group, llmflow_run
from bench.machine import own_memory_mib
from bench.process import QUIET_CORES, CpuMeter, wait_quiet
from bench.results import update_results
from bench.train_step import spread

REPO = Path(__file__).resolve().parent.parent
SIDES = ("trl", "llmflow")
CONFIG = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
          "tie_word_embeddings": True}
"""A Qwen2 of realistic small size (Qwen2's GQA and q/k/v biases, tied embeddings)."""
PAD, IM_START, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = ("{% for message in messages %}" + IM_START + " {{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}" + IM_START + "{% endif %}")
"""Each message's words after <|im_start|>, then <|im_start|> for the answer: no eos in a prompt."""
LR = 1e-6
TRL_BETAS = (0.9, 0.999)
"""TRL's AdamW betas (its TrainingArguments' defaults), given to llmflow's side too."""
PROMPT_WORDS = 30
"""Words of each prompt's message (its rendered prompt is 2 tokens more)."""
DATASET_PROMPTS = 64
REWARD = "bench.grpo:reward"
"""``reward`` as llmflow's reward workers import it (from the repository root)."""


def reward(prompts: list, completions: list, completion_ids: list[list[int]], **columns: list) -> list[float]:
    """The fraction of a completion's token ids that are even (TRL's reward signature)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def word_tokenizer(vocab_size: int):
    """``bench.dpo``'s word tokenizer (one token per whitespace-separated word "w<id>", ids 2
    up; pad 0, <|im_start|> 1) with eos moved to ``vocab_size``, an id the model's output
    layer does not have: never sampled; and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, IM_START: 1, **{f"w{i}": i for i in range(2, vocab_size)}, EOS: vocab_size}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([PAD, IM_START, EOS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_assets(directory: Path) -> tuple[Path, Path]:
    """The random model with its tokenizer, and the prompts file (seeded), under ``directory``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = CONFIG["vocab_size"]
    torch.manual_seed(1234)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG, eos_token_id=vocab, pad_token_id=0, bos_token_id=None))
    model_dir = directory / "model"
    model.save_pretrained(model_dir)
    word_tokenizer(vocab).save_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    lines = [json.dumps({"prompt": [{"role": "user", "content": words(torch.randint(2, vocab, (PROMPT_WORDS,),
                                                                                   generator=g).tolist())}]})
             for _ in range(DATASET_PROMPTS)]
    prompts = directory / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    return model_dir, prompts


def completions_per_step(args: argparse.Namespace) -> int:
    return args.prompts * args.generations


def time_calls(owner: object, name: str, seconds: list[float]) -> None:
    """Make ``owner.name(...)`` append the seconds of each call to ``seconds``."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        result = method(*args, **kwargs)
        seconds.append(time.perf_counter() - started)
        return result

    setattr(owner, name, timed)


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict:
    group = optimizer.param_groups[0]
    return {k: list(group[k]) if isinstance(group[k], tuple) else group[k]
            for k in ("betas", "eps", "weight_decay", "fused")}


def trl_side(model_dir: str, prompts: str, out: str, args: argparse.Namespace) -> dict:
    """``trainer.train()`` of TRL's GRPOTrainer over the warm-up and timed steps: each step's
    seconds, its rollout's (``_generate_and_score_completions``) and sampling's
    (``_generate_single_turn``: transformers ``generate``), its mean completion length, and
    the last rollout's prompt ids."""
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    timings: dict[str, list] = {"times": [], "rollout_s": [], "sampling_s": [], "lengths": []}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            timings["times"].append(time.perf_counter() - self.started)

    config = GRPOConfig(output_dir=out, report_to="none", use_cpu=True, bf16=False, activation_checkpointing=False,
                        learning_rate=LR, num_generations=args.generations, max_completion_length=args.completion,
                        per_device_train_batch_size=completions_per_step(args), max_steps=args.warmup + args.steps,
                        save_strategy="no", disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config,
                          train_dataset=load_dataset("json", data_files=prompts, split="train"),
                          callbacks=[StepTimes()])
    time_calls(trainer, "_generate_single_turn", timings["sampling_s"])
    score = trainer._generate_and_score_completions

    def rollout(inputs):
        started = time.perf_counter()
        batch = score(inputs)
        timings["rollout_s"].append(time.perf_counter() - started)
        timings["lengths"].append(batch["completion_mask"].sum(1).float().mean().item())
        timings["prompt_ids"] = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
        return batch

    trainer._generate_and_score_completions = rollout
    trainer.train()
    return {**timings, "optim": optimizer_settings(trainer.optimizer)}


def llmflow_config(model_dir: str, prompts: str, out: str, args: argparse.Namespace):
    """The training config of the llmflow side (the settings TRL's side runs with)."""
    from llmflow.train.config import TrainConfig

    return TrainConfig.model_validate({
        "model": model_dir, "out": out, "method": "grpo", "dtype": "fp32",
        "data": {"kind": "prompts", "paths": [prompts]}, "steps": args.warmup + args.steps,
        "micro_batch_size": completions_per_step(args), "global_batch_size": completions_per_step(args),
        "optim": {"lr": LR, "decay": "linear", "betas": TRL_BETAS},
        "rl": {"num_generations": args.generations, "max_completion_length": args.completion,
               "rewards": [{"function": REWARD}], "template": "tokenizer"},
    })


def workers_usage() -> tuple[float, float]:
    """This process's descendants (llmflow's reward workers and their forkserver): their
    summed high-water RSS (VmHWM, shared pages counted in each) in MiB and their CPU seconds
    (not this process's, nor reaped as its children: the meter of other jobs' CPU would
    count them)."""
    import psutil

    peak = cpu = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
            times = child.cpu_times()
        except (OSError, psutil.Error):
            continue
        peak += next((int(x.split()[1]) / 1024 for x in status.splitlines() if x.startswith("VmHWM:")), 0.0)
        cpu += times.user + times.system
    return peak, cpu


def llmflow_side(model_dir: str, prompts: str, out: str, args: argparse.Namespace) -> dict:
    """llmflow's ``setup`` and ``train_step`` over the warm-up and timed steps: each step's
    seconds, its rollout's and update's (``time/rollout_s``, ``time/update_s``), its
    sampling's (``sample_rows``: the KV-cache sampler) and its mean completion length."""
    from llmflow.train.loop import train_step

    join_one_rank_group(torch.device("cpu"))
    run = llmflow_run(llmflow_config(model_dir, prompts, out, args))
    timings: dict[str, list[float]] = {"times": [], "rollout_s": [], "update_s": [], "sampling_s": [], "lengths": []}
    time_calls(run.objective, "sample_rows", timings["sampling_s"])
    try:
        for step in range(1, args.warmup + args.steps + 1):
            started = time.perf_counter()
            train_step(run, step)
            timings["times"].append(time.perf_counter() - started)
            for key, metric in (("rollout_s", "time/rollout_s"), ("update_s", "time/update_s"),
                                ("lengths", "completions/mean_length")):
                timings[key].append(run.metrics[metric])
        workers_peak, workers_cpu = workers_usage()
    finally:
        run.objective.close()
    return {**timings, "workers_peak_mib": workers_peak, "workers_cpu_s": workers_cpu,
            "optim": optimizer_settings(run.optimizers[0])}


def run_side(side: str, model_dir: str, prompts: str, args: argparse.Namespace) -> dict:
    """Runs in a child process: one side's steps, reported with its peak memory."""
    # The same imports on every side: equal baseline memory.
    import datasets  # noqa: F401
    import trl  # noqa: F401

    import llmflow.train.loop  # noqa: F401

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = (trl_side if side == "trl" else llmflow_side)(model_dir, prompts, out, args)
        total = time.perf_counter() - started
    medians = {f"{key}_median": statistics.median(result[key][args.warmup:])
               for key in ("times", "rollout_s", "sampling_s", "update_s") if key in result}
    return {"side": side, **result, **medians, "step_s": medians["times_median"], "first_step_s": result["times"][0],
            "setup_s": total - sum(result["times"]), "peak_rss_mib": own_memory_mib(),
            "threads": torch.get_num_threads()}


def side_args(args: argparse.Namespace) -> list[str]:
    return [f"--{flag}={getattr(args, flag)}" for flag in ("steps", "warmup", "prompts", "generations", "completion")]


def run_child(side: str, model_dir: Path, prompts: Path, args: argparse.Namespace) -> dict:
    """One side in a fresh process (this module's ``--child`` mode); its JSON result and the
    cores other jobs used meanwhile."""
    cmd = [sys.executable, "-m", "bench.grpo", "--child", side, str(model_dir), str(prompts), *side_args(args)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", "HF_DATASETS_CACHE": str(model_dir.parent)}
    meter, started = CpuMeter(), time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=REPO)
    other, wall = meter.other_cores(), time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"bench.grpo: the {side} side failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "other_cores": max(0.0, other - result.get("workers_cpu_s", 0.0) / wall)}


def rendered_prompts(model_dir: Path, prompts: Path) -> set[tuple[int, ...]]:
    """The ids of every prompt as llmflow's ``PromptSet`` renders them (the tokenizer's template)."""
    from llmflow.train.grpo.prompts import read_prompt_rows, render_prompts

    return {tuple(ids) for ids in render_prompts(read_prompt_rows(prompts), model_dir, "tokenizer")}


def check_prompts(result: dict, ours: set[tuple[int, ...]]) -> None:
    """Exit unless TRL's side generated from prompt ids llmflow's side renders too."""
    if not all(tuple(ids) in ours for ids in result["prompt_ids"]):
        sys.exit("bench.grpo: TRL rendered the prompts into other ids than llmflow's chat template did")


def check_lengths(result: dict, args: argparse.Namespace) -> None:
    """Exit unless every step of the side sampled ``--completion`` tokens per completion."""
    if any(length != args.completion for length in result["lengths"]):
        sys.exit(f"bench.grpo: the {result['side']} side's mean completion lengths are {result['lengths']}, "
                 f"not {args.completion}: the sides did not sample the same number of tokens")


def bench(args: argparse.Namespace, loads: list[float]) -> dict:
    """Every round of both sides, alternating (each run after waiting for the other jobs to
    leave the CPUs idle); the per-round TRL / llmflow ratios over the quiet rounds (every
    round where none was quiet)."""
    every: list[dict[str, dict]] = []
    wait = [float(args.max_wait)]
    with tempfile.TemporaryDirectory() as work:
        model_dir, prompts = make_assets(Path(work))
        params = count_params(str(model_dir))
        ours = rendered_prompts(model_dir, prompts)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            pair = {}
            for side in SIDES if r % 2 == 0 else tuple(reversed(SIDES)):
                wait_quiet(wait)
                result = run_child(side, model_dir, prompts, args)
                check_lengths(result, args)
                if side == "trl":
                    check_prompts(result, ours)
                pair[side] = result
                print(f"round {r + 1}/{args.rounds} {side}: step {result['step_s']:.2f} s (rollout "
                      f"{result['rollout_s_median']:.2f} s, sampling {result['sampling_s_median']:.2f} s; first "
                      f"{result['first_step_s']:.2f} s, setup {result['setup_s']:.1f} s), completion length "
                      f"{statistics.mean(result['lengths']):.1f}, peak RSS {result['peak_rss_mib']:.0f} MiB, other jobs "
                      f"{result['other_cores']:.2f} cores", flush=True)
            every.append(pair)
    if every[0]["trl"]["optim"] != every[0]["llmflow"]["optim"]:
        sys.exit(f"bench.grpo: the optimizers differ: {every[0]['trl']['optim']} against {every[0]['llmflow']['optim']}")
    quiet = [pair for pair in every if all(run["other_cores"] <= QUIET_CORES for run in pair.values())]
    used = quiet or every

    def ratios(key: str) -> dict:
        return spread([pair["trl"][key] / pair["llmflow"][key] for pair in used])

    runs = {side: [pair[side] for pair in used] for side in SIDES}
    return {"params": params, "runs": runs, "every": every, "quiet": bool(quiet), "ratio": ratios("step_s"),
            "rollout_ratio": ratios("rollout_s_median"), "sampling_ratio": ratios("sampling_s_median"),
            "memory": max(r["peak_rss_mib"] for r in runs["llmflow"]) / max(r["peak_rss_mib"] for r in runs["trl"])}


def rounds_used(row: dict) -> str:
    """Which rounds the figures are over, as a phrase."""
    used, rounds = len(row["runs"]["trl"]), len(row["every"])
    return f"the {used} quiet rounds of {rounds}" if row["quiet"] else f"{rounds} rounds, none quiet"


def describe(row: dict, args: argparse.Namespace) -> str:
    """The model and the step's work, as one phrase."""
    return (f"Qwen2 ({row['params'] / 1e6:.1f}M parameters: vocabulary {CONFIG['vocab_size']}, hidden "
            f"{CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, {CONFIG['num_attention_heads']} heads / "
            f"{CONFIG['num_key_value_heads']} KV, tied embeddings), {args.prompts} prompts of {PROMPT_WORDS + 2} tokens "
            f"x {args.generations} generations x {args.completion} tokens = {completions_per_step(args)} completions "
            f"a step, temperature 1, no top-k/top-p")


def side_line(side: str, runs: list[dict]) -> str:
    """A side's row of the History table: medians over the rounds (step time with its spread)."""
    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    step = spread([r["step_s"] for r in runs])
    update = f"{median('update_s_median'):.2f}" if "update_s_median" in runs[0] else "-"
    workers = f" (+ {max(r['workers_peak_mib'] for r in runs):.0f} reward workers)" if "workers_peak_mib" in runs[0] else ""
    lengths = statistics.mean(x for r in runs for x in r["lengths"])
    return (f"| {side} | {step['median']:.2f} ({step['min']:.2f}-{step['max']:.2f}) | {median('rollout_s_median'):.2f} "
            f"| {median('sampling_s_median'):.2f} | {median('step_s') - median('rollout_s_median'):.2f} | {update} "
            f"| {median('first_step_s'):.2f} | {median('setup_s'):.1f} | {lengths:.1f} "
            f"| {max(r['peak_rss_mib'] for r in runs):.0f}{workers} | {median('other_cores'):.2f} |")


def report(row: dict, args: argparse.Namespace, loads: list[float], load_after: float) -> list[str]:
    """The History entry (markdown lines)."""

    runs = row["runs"]
    lines = [
        trl_heading("grpo", runs['llmflow'][0]['threads'], loads, load_after),
        "",
        (f"`python -m bench.grpo --rounds {args.rounds} --steps {args.steps} --warmup {args.warmup} --prompts "
         f"{args.prompts} --generations {args.generations} --completion {args.completion}`: one GRPO step (TRL's "
         f"defaults: loss dapo, beta 0, one iteration, one generation batch per step), rollout + update (forward, "
         f"backward, clipping at 1.0, fused AdamW, lr {LR:g}), fp32; TRL `GRPOTrainer` with transformers `generate` "
         f"(`use_vllm=False`), its activation checkpointing off, against llmflow `method: grpo` (`setup` + "
         f"`train_step`, the KV-cache sampler, rewards in 2 worker processes); {describe(row, args)}. The eos id is "
         f"outside the model's vocabulary, so every completion on both sides is {args.completion} tokens (mean "
         f"completion length per step checked on both). Each side in its own process, {args.rounds} rounds, sides "
         f"alternating, each run after waiting for the other jobs to leave the CPUs idle; figures over "
         f"{rounds_used(row)} (other jobs under {QUIET_CORES} cores during both runs of a round); step time = "
         f"median of {args.steps} steps after {args.warmup} warm-up. Rollout: TRL's "
         f"`_generate_and_score_completions`, llmflow's `time/rollout_s` (sampling, rewards; on-policy, "
         f"as here, neither side runs a scoring forward for the old log-probs); sampling: TRL's "
         f"`_generate_single_turn`, llmflow's `sample_rows`; update: llmflow's `time/update_s` (forward, with the "
         f"entropy from the loss's chunks, + backward)."),
        "",
        ("| side | step s median (min-max) | rollout s | of which sampling s | rest of the step s | update s "
         "| first step s | setup s | completion length | peak RSS MiB | other jobs, cores |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(side_line(side, runs[side]) for side in SIDES),
        "",
    ]
    for name, key in (("step time", "ratio"), ("rollout time", "rollout_ratio"), ("sampling time", "sampling_ratio")):
        lines.append(f"- TRL / llmflow {name}, per round: median {row[key]['median']:.2f}x, min {row[key]['min']:.2f}x, "
                     f"max {row[key]['max']:.2f}x")
    lines += [f"- memory (llmflow peak RSS / TRL's, main processes): {row['memory']:.2f}x",
              "- every round (step-time ratio; other jobs' cores during the TRL, llmflow runs): " + "; ".join(
                  f"{pair['trl']['step_s'] / pair['llmflow']['step_s']:.2f}x ({pair['trl']['other_cores']:.2f}, "
                  f"{pair['llmflow']['other_cores']:.2f})" for pair in row["every"]), ""]
    return lines


def record(row: dict, args: argparse.Namespace, entry: list[str], loads: list[float]) -> None:
    """Append ``entry`` to History and replace this benchmark's row of the Current table."""
    ratio = row["ratio"]
    current = [
        (f"| `bench.grpo` | TRL `GRPOTrainer` step, transformers `generate` rollouts (fp32, ~{row['params'] / 1e6:.0f}M "
         f"Qwen2, {args.prompts} prompts x {args.generations} generations x {args.completion} tokens, same completion "
         f"lengths) | {ratio['median']:.2f}x speed (rollout {row['rollout_ratio']['median']:.2f}x, sampling "
         f"{row['sampling_ratio']['median']:.2f}x); {row['memory']:.2f}x memory | {ratio['min']:.2f}x-{ratio['max']:.2f}x "
         f"over {rounds_used(row)} | {row['runs']['llmflow'][0]['threads']} | {', '.join(f'{x:.1f}' for x in loads)} "
         f"at the rounds' starts | {time.strftime('%Y-%m-%d')} |")
    ]
    update_results(current, entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both sides, alternating")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per side and round")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (num_generations)")
    parser.add_argument("--completion", type=int, default=128, help="tokens per completion (max_completion_length)")
    parser.add_argument("--max-wait", type=float, default=600.0,
                        help="seconds in all to wait, before rounds, for other jobs to leave the CPUs idle")
    parser.add_argument("--record", action="store_true", help="record the result in bench/RESULTS.md")
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "MODEL_DIR", "PROMPTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag in ("rounds", "steps", "warmup", "prompts", "completion"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.generations < 2:
        parser.error(f"--generations must be at least 2, got {args.generations}")
    if args.child:
        print(json.dumps(run_side(*args.child, args)))
        return

    loads: list[float] = []
    row = bench(args, loads)
    entry = report(row, args, loads, os.getloadavg()[0])
    print("\n".join(entry))
    if args.record:
        record(row, args, entry, loads)


if __name__ == "__main__":
    main()
