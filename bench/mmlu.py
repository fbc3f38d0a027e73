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
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.machine import cpu_model
from bench.results import update_results
from llmflow.evaluate.benchmarks import MMLU
from llmflow.evaluate.engine import prompts_for, select_questions
from llmflow.evaluate.mmlu_data import load_mmlu
from llmflow.evaluate.questions import LETTERS
from llmflow.sample import SampleConfig, write_sample

BIN = Path(sys.executable).parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
LARGE_VOCAB = {"vocab_size": 151936, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
               "tie_word_embeddings": False}


def lm_eval_template() -> Path:
    """lm-evaluation-harness's own mmlu default template, in the installed package."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise SystemExit("lm_eval is not installed: pip install -e '.[bench]' -c constraints.txt")
    return Path(spec.origin).parent / "tasks" / "mmlu" / "default" / "_default_template_yaml"


def write_tasks(data: Path, tasks: Path) -> list[str]:
    """One lm-eval task per subject of the cais/mmlu-layout ``data``; their names."""
    tasks.mkdir(parents=True, exist_ok=True)
    names = []
    for subject in sorted(p.name for p in data.iterdir() if p.is_dir()):
        files = {split: str(next((data / subject).glob(f"{split}-*.parquet"))) for split in ("dev", "test")}
        name = f"llmflow_mmlu_{subject}"
        description = f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"
        # JSON strings are YAML strings: paths and the description need no quoting rules of their own.
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ninclude: {json.dumps(str(lm_eval_template()))}\ndataset_path: parquet\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    dev: {json.dumps(files['dev'])}\n    test: {json.dumps(files['test'])}\n"
            f"description: {json.dumps(description)}\n"
        )
        names.append(name)
    return names


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


def peak_rss_mib(pid: int, peak: list[float]) -> None:
    """Keep ``peak[0]`` at the process's high-water RSS (VmHWM) until it exits (polled: the
    rusage of a child started by fork + exec starts from this process's own peak)."""
    status = Path(f"/proc/{pid}/status")
    while True:
        try:
            line = next(x for x in status.read_text().splitlines() if x.startswith("VmHWM:"))
        except (OSError, StopIteration):
            return
        peak[0] = max(peak[0], int(line.split()[1]) / 1024)
        time.sleep(0.05)


def run_command(command: list[str], env: dict[str, str], log: Path) -> dict:
    """Run ``command`` to its exit; its wall seconds, CPU seconds and peak RSS (MiB)."""
    peak = [0.0]
    with open(log, "w") as out:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        watcher = threading.Thread(target=peak_rss_mib, args=(process.pid, peak), daemon=True)
        watcher.start()
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        watcher.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"{' '.join(command[:3])} ... failed ({process.returncode}); the end of {log}:\n{tail}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mib": peak[0]}


def lm_eval_side(model: Path, tasks: list[str], tasks_dir: Path, out: Path, args) -> list[str]:
    return [str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
            "--tasks", ",".join(tasks), "--include_path", str(tasks_dir), "--num_fewshot", str(args.shots),
            "--batch_size", str(args.batch_size), "--device", "cpu", "--log_samples", "--output_path", str(out)]


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


def import_seconds(code: str, env: dict[str, str]) -> float:
    """Wall seconds of a process that only runs ``code`` (the imports a side starts with)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - start


def bench_model(name: str, model: Path, data: Path, work: Path, tasks: list[str], prompts: dict, env: dict, args) -> dict:
    sides = {
        "lm-eval": lambda out: lm_eval_side(model, tasks, work / "tasks", out, args),
        "llmflow": lambda out: llmflow_side(model, data, out, args),
    }
    runs: dict[str, list[dict]] = {"lm-eval": [], "llmflow": []}
    loads = []
    for round_ in range(args.rounds + 1):  # round 0: the untimed first run of each side
        order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
        outs = {side: work / f"{name}-{side}" for side in sides}
        load = os.getloadavg()[0]
        timing = {}
        for side in order:
            shutil.rmtree(outs[side], ignore_errors=True)
            timing[side] = run_command(sides[side](outs[side]), env, work / f"{name}-{side}.log")
        timing["llmflow"]["in_tool"] = json.loads((outs["llmflow"] / "results.json").read_text())["seconds"]
        (lm_results,) = outs["lm-eval"].rglob("results_*.json")
        timing["lm-eval"]["in_tool"] = float(json.loads(lm_results.read_text())["total_evaluation_time_seconds"])
        diff = check_agreement(outs["llmflow"], outs["lm-eval"], tasks, prompts)
        ratio = timing["lm-eval"]["wall"] / timing["llmflow"]["wall"]
        label = "warm-up" if round_ == 0 else f"round {round_}"
        print(f"{name} {label} ({' then '.join(order)}, load {load:.1f}): lm-eval {timing['lm-eval']['wall']:.1f} s, "
              f"llmflow {timing['llmflow']['wall']:.1f} s, ratio {ratio:.2f}x, max score diff {diff:.1e}", flush=True)
        if round_:
            for side in sides:
                runs[side].append(timing[side])
            loads.append(load)
    ratios = [t["wall"] / o["wall"] for t, o in zip(runs["lm-eval"], runs["llmflow"])]
    cpu_ratios = [t["cpu"] / o["cpu"] for t, o in zip(runs["lm-eval"], runs["llmflow"])]
    med = {side: {key: statistics.median(r[key] for r in runs[side]) for key in runs[side][0]} for side in sides}
    return {"name": name, "questions": len(prompts), "ratios": ratios, "ratio": statistics.median(ratios),
            "cpu_ratio": statistics.median(cpu_ratios), "median": med, "loads": loads, "max_score_diff": diff}


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
        f"| `bench.mmlu` {row['name']} | real `lm_eval --model hf` (0.4.13), whole process, {args.shots}-shot, batch "
        f"{args.batch_size}, fp32, {row['questions']} questions, same prompts and predictions | {row['ratio']:.2f}x q/s "
        f"(CPU time {row['cpu_ratio']:.2f}x) | {min(row['ratios']):.2f}x-{max(row['ratios']):.2f}x over {len(row['ratios'])} "
        f"rounds | {args.threads} | {', '.join(f'{x:.1f}' for x in row['loads'])} | {day} |"
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
        env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": str(args.threads),
               "HF_DATASETS_CACHE": str(work / "hf-datasets"), "HF_HOME": str(work / "hf-home")}
        imports = {
            "lm-eval": import_seconds("import lm_eval.__main__, lm_eval.models.huggingface", env),
            "llmflow": import_seconds("import llmflow.cli", env),
        }
        rows = [bench_model(name, models[name], data, work, tasks, prompts, env, args) for name in args.models]
    lines = report_lines(rows, imports, args)
    print("\n".join(lines))
    if args.record:
        record(rows, lines, imports, args, os.getloadavg()[0])


if __name__ == "__main__":
    main()
