"""MMLU, whole process: ``llmflow eval mmlu`` against the real lm-evaluation-harness
(``lm_eval --model hf``), same model, data, shots and batch size, each a command of its own
timed by the wall clock from start to exit.

The data is a local cais/mmlu-layout copy (the sample set, ``--questions`` test questions per
subject). lm-evaluation-harness reads it through one task per subject (``--include_path``):
its own ``mmlu`` default template (prompt, first-n dev shots, choices, metric) included
unchanged, the dataset pointed at the local parquet files, the description worded as its
``_generate_configs.py`` words it; no network (HF_*_OFFLINE). Both must agree: lm-eval's
logged contexts equal llmflow's prompts character for character, and every question's
prediction is the same (the run fails otherwise); the largest difference of the four
log-likelihoods is printed.

Two models: the sample model (tiny, vocabulary 896) and a random Qwen2-style model with
Qwen2's 151,936-token vocabulary (hidden 256, 4 layers, untied), both saved by transformers,
with the sample tokenizer. One untimed run of each side first (lm-eval converts the parquet
files into its datasets cache then, as on any first run); then ``--rounds`` rounds, the order
of the two sides alternating. Prints each round and the median and spread (min-max) of the
questions/s ratio, llmflow / lm-eval; ``--record`` appends the result to bench/RESULTS.md and
replaces the ``bench.mmlu`` rows of its Current table.

    python -m bench.mmlu [--questions 97] [--rounds 5] [--threads 1] [--models sample large-vocab] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from bench.process import (
    BIN,
    alternate_rounds,
    bench_env,
    current_row,
    harness_task,
    lm_eval_command,
    lm_eval_tasks,
    side_imports,
)
from bench.results import update_results
from llmflow.evaluate.benchmarks import MMLU
from llmflow.evaluate.engine import prompts_for, select_questions
from llmflow.evaluate.mmlu_data import load_mmlu
from llmflow.evaluate.questions import LETTERS
from llmflow.sample.assets import SampleConfig, write_sample

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LARGE_VOCAB = {"vocab_size": 151936, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
               "tie_word_embeddings": False}


def write_tasks(data: Path, tasks: Path) -> list[str]:
    """One lm-eval task per subject of the cais/mmlu-layout ``data``; their names."""
    template = lm_eval_tasks() / "mmlu" / "default" / "_default_template_yaml"  # lm-eval's own mmlu default
    return [harness_task(tasks, f"llmflow_mmlu_{subject}", template,
                         {split: next((data / subject).glob(f"{split}-*.parquet")) for split in ("dev", "test")},
                         description=f"The following are multiple choice questions (with answers) about "
                                     f"{' '.join(subject.split('_'))}.\n\n")
            for subject in sorted(p.name for p in data.iterdir() if p.is_dir())]


def make_large_vocab(sample_model: Path, out: Path) -> Path:
    """A random Qwen2-style model with Qwen2's vocabulary, saved by transformers, with the sample tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    special = json.loads((sample_model / "config.json").read_text())
    config = Qwen2Config(**LARGE_VOCAB, bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"])
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(sample_model / name, out / name)
    return out


def lm_eval_side(model: Path, tasks: list[str], tasks_dir: Path, out: Path, args) -> list[str]:
    return lm_eval_command(model, tasks, tasks_dir, out, args.batch_size, "--num_fewshot", str(args.shots))


def llmflow_side(model: Path, data: Path, out: Path, args) -> list[str]:
    return [str(BIN / "llmflow"), "eval", "mmlu", "--model", str(model), "--data", str(data), "--shots", str(args.shots),
            "--batch-size", str(args.batch_size), "--out", str(out)]


def lm_eval_answers(out: Path, tasks: list[str]) -> dict[tuple[str, int], tuple[str, list[float]]]:
    """(subject, index) -> (context, the four log-likelihoods) from lm-eval's logged samples."""
    answers = {}
    for task in tasks:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            context = sample["arguments"]["gen_args_0"]["arg_0"]
            scores = [float(resp[0]) for resp in sample["filtered_resps"]]
            answers[(task.removeprefix("llmflow_mmlu_"), sample["doc_id"])] = (context, scores)
    return answers


def check_agreement(ours: Path, theirs: Path, tasks: list[str], prompts: dict[tuple[str, int], str]) -> float:
    """Fail unless both saw the same prompts and predicted the same letters; the largest score difference."""
    answers = lm_eval_answers(theirs, tasks)
    rows = [json.loads(line) for line in (ours / "predictions.jsonl").read_text().splitlines()]
    if len(rows) != len(answers) or set(prompts) != set(answers):
        raise SystemExit(f"question sets differ: llmflow {len(rows)} questions, lm-eval {len(answers)}")
    largest = 0.0
    for row in rows:
        key = (row["subject"], row["index"])
        context, scores = answers[key]
        if context != prompts[key]:
            raise SystemExit(f"prompt of {key} differs:\nlm-eval: {context!r}\nllmflow: {prompts[key]!r}")
        theirs_letter = LETTERS[max(range(len(scores)), key=scores.__getitem__)]
        if theirs_letter != row["prediction"]:
            raise SystemExit(f"prediction of {key} differs: llmflow {row['prediction']} {row['scores']}, "
                             f"lm-eval {theirs_letter} {scores}")
        largest = max(largest, *(abs(a - b) for a, b in zip(row["scores"], scores)))
    return largest


def bench_model(name: str, model: Path, data: Path, work: Path, tasks: list[str], prompts: dict, env: dict, args) -> dict:
    sides = {
        "lm-eval": lambda out: lm_eval_side(model, tasks, work / "tasks", out, args),
        "llmflow": lambda out: llmflow_side(model, data, out, args),
    }
    row = alternate_rounds(name, sides, work, env, args.rounds,
                           lambda outs: {"max_score_diff": check_agreement(outs["llmflow"], outs["lm-eval"], tasks, prompts)})
    return {"name": name, "questions": len(prompts), **row}


def report_lines(rows: list[dict], imports: dict[str, float], args) -> list[str]:
    lines = [("| model | questions | lm-eval s | llmflow s | lm-eval q/s | llmflow q/s | q/s ratio, median | min-max "
             "| CPU-time ratio | lm-eval: in its timer / peak RSS MiB | llmflow: scoring / peak RSS MiB | max score diff |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        t, o, n = row["median"]["lm-eval"], row["median"]["llmflow"], row["questions"]
        lines.append(
            f"| {row['name']} | {n} | {t['wall']:.1f} | {o['wall']:.1f} | {n / t['wall']:.1f} | {n / o['wall']:.1f} | "
            f"{row['ratio']:.2f}x | {min(row['ratios']):.2f}x-{max(row['ratios']):.2f}x | {row['cpu_ratio']:.2f}x | "
            f"{t['in_tool']:.1f} s / {t['rss_mib']:.0f} | {o['in_tool']:.1f} s / {o['rss_mib']:.0f} | {row['max_score_diff']:.1e} |")
    lines.append(f"\nImports alone (one process each, wall): lm-eval CLI + hf backend {imports['lm-eval']:.1f} s, "
                 f"llmflow CLI {imports['llmflow']:.1f} s.")
    return lines


def record(rows: list[dict], lines: list[str], imports: dict[str, float], args, load_after: float) -> None:
    day = time.strftime("%Y-%m-%d")
    loads = ", ".join(f"{x:.1f}" for row in rows for x in row["loads"])
    current = [
        current_row("bench.mmlu", row["name"], f"real `lm_eval --model hf` (0.4.13), whole process, {args.shots}-shot, "
                    f"batch {args.batch_size}, fp32, {row['questions']} questions, same prompts and predictions", "q/s",
                    row, args.threads, day)
        for row in rows
    ]
    entry = [
        (f"### mmlu against the real lm-evaluation-harness, whole process ({day}, {cpu_model()}, {os.cpu_count()} cores, "
         f"torch {torch.__version__}, {args.threads} thread(s) per process, load average {loads} at the rounds' "
         f"starts, {load_after:.1f} after; other people's tests and benchmarks ran on the machine meanwhile)"),
        "",
        (f"`python -m bench.mmlu --questions {args.questions} --rounds {args.rounds} --threads {args.threads}`: "
         f"`lm_eval --model hf --model_args pretrained=DIR,dtype=float32 --tasks <one local task per subject> "
         f"--num_fewshot {args.shots} --batch_size {args.batch_size} --device cpu --log_samples` against `llmflow eval "
         f"mmlu --shots {args.shots} --batch-size {args.batch_size}`, sample MMLU set (3 subjects), medians over "
         f"{args.rounds} rounds after one untimed run of each, order alternating; lm-eval's contexts equal llmflow's "
         "prompts and every prediction is the same. 'in its timer': lm-eval's total_evaluation_time_seconds "
         "(everything after its imports); 'scoring': llmflow's tokenization and forward passes."),
        "",
        *lines,
    ]
    # This run's models replace their rows (and the row of the earlier, in-process benchmark).
    update_results(current, entry, stale=lambda row: row.startswith("| `bench.mmlu` |"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=97, help="test questions per subject (3 subjects)")
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of both sides (on a shared 2-core machine two threads spin-wait on each other)")
    parser.add_argument("--models", nargs="+", choices=["sample", "large-vocab"], default=["sample", "large-vocab"])
    parser.add_argument("--work", type=Path, help="working directory (default: a temporary one)")
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        work = (args.work or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        sample = write_sample(SampleConfig(out=work / "sample", test_questions=args.questions))
        data = sample / "mmlu" / "hf"
        tasks = write_tasks(data, work / "tasks")
        models = {"sample": sample / "model"}
        if "large-vocab" in args.models:
            models["large-vocab"] = make_large_vocab(sample / "model", work / "large-vocab")
        mmlu = load_mmlu(data)
        questions = select_questions(MMLU, mmlu, None)
        index: dict[str, int] = {}
        keys = []
        for q in questions:
            index[q.subject] = index.get(q.subject, -1) + 1
            keys.append((q.subject, index[q.subject]))
        prompts = dict(zip(keys, prompts_for(MMLU, questions, mmlu, args.shots)))
        env = bench_env(work, args.threads)
        imports = side_imports(env)
        rows = [bench_model(name, models[name], data, work, tasks, prompts, env, args) for name in args.models]
    lines = report_lines(rows, imports, args)
    print("\n".join(lines))
    if args.record:
        record(rows, lines, imports, args, os.getloadavg()[0])


if __name__ == "__main__":
    main()
