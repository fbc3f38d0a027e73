"""BoolQ, AGIEval, GSM8K, BBH and MATH-500, whole process: ``llmflow eval
boolq|agieval|gsm8k|bbh|minerva-math500``
against the real lm-evaluation-harness (``lm_eval --model hf``), same model, data, shots,
batch size and ``--limit``, each a command of its own timed by the wall clock from start to
exit.

The data and model are the sample assets (``llmflow.sample.assets.write_sample``): BoolQ in
aps/super_glue's layout, two AGIEval tasks in hails/agieval-*'s, GSM8K in openai/gsm8k's and
two BBH subtasks in SaylorTwift/bbh's, MATH-500 problems in HuggingFaceH4/MATH-500's; ``--limit`` takes the first N documents of each task
(both sides). lm-evaluation-harness reads them through its own task yamls, included
unchanged with the dataset pointed at the local parquet files (``--include_path``), and for
AGIEval and BBH a group of those tasks aggregated as its agieval_en and bbh_cot_fewshot
groups aggregate; no network (HF_*_OFFLINE). Shots are both tools' defaults, the harness's
(0 for BoolQ and AGIEval, 8 chain-of-thought exemplars for GSM8K, 3 for BBH, 4 for MATH-500); the
generative groups generate greedily at most ``--max-new-tokens`` tokens on both sides
(lm-eval ``--gen_kwargs max_gen_toks=N``). ``--apply-chat-template`` renders every prompt with the
model's chat template on both sides (lm-eval's ``--apply_chat_template``, few-shot examples as
turns by default on both).

Both must agree, every round (the run fails otherwise): lm-eval's logged contexts hash to
llmflow's prompts_sha256; for BoolQ and AGIEval every document's choice log-likelihoods
within 1e-5 (or 1.2e-7 relative, one float32 step of a sum past 100), the same prediction
and the same acc (and acc_norm); for GSM8K and BBH the same generated text and, filter by
filter, the same extracted answer and exact match. The largest log-likelihood difference is
printed.

One untimed run of each side first (lm-eval converts the parquet files into its datasets
cache then, as on any first run); then ``--rounds`` rounds, the order of the two sides
alternating. Prints each round and the median and spread (min-max) of the documents/s ratio,
llmflow / lm-eval; ``--record`` appends the result to bench/RESULTS.md and replaces the
``bench.eval`` rows of its Current table.

    python -m bench.eval [--groups boolq agieval gsm8k bbh] [--limit N] [--max-new-tokens 64]
                         [--batch-size 8] [--apply-chat-template] [--rounds 5] [--threads 1] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch
import yaml

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
from llmflow.evaluate.provenance import prompts_sha256
from llmflow.sample.assets import SampleConfig, write_sample
from llmflow.sample.choice_tasks import AGIEVAL_TASKS
from llmflow.sample.generative_tasks import BBH_SUBTASKS

PREFIX = "llmflow_"  # lm-eval's name of a local task: the prefix and the harness's own name


@dataclass(frozen=True)
class Group:
    name: str
    """``llmflow eval NAME`` and the sample's data directory."""
    generative: bool
    tasks: dict[str, tuple[str, str]]
    """The harness's task name -> (its yaml under lm_eval/tasks, its directory under the group's data)."""
    harness_group: str | None = None
    """The harness's group yaml (under lm_eval/tasks) whose aggregation a group of the local tasks copies."""
    files: str = "parquet"
    """The data files' format (their suffix): parquet or json (JSON lines)."""


GROUPS = {group.name: group for group in (
    Group("boolq", False, {"boolq": ("super_glue/boolq/default.yaml", "boolq")}),
    Group("agieval", False, {f"agieval_{t.replace('-', '_')}": (f"agieval/{t}.yaml", f"agieval-{t}") for t in AGIEVAL_TASKS},
          "agieval/agieval_en.yaml"),
    Group("gsm8k", True, {"gsm8k_cot": ("gsm8k/gsm8k-cot.yaml", "main")}),
    Group("bbh", True, {f"bbh_cot_fewshot_{t}": (f"bbh/cot_fewshot/{t}.yaml", t) for t in BBH_SUBTASKS},
          "bbh/cot_fewshot/_bbh_cot_fewshot.yaml"),
    Group("minerva-math500", True, {"minerva_math500": ("minerva_math/minerva_math500.yaml", "")}, files="json"),
)}


def write_tasks(group: Group, data: Path, tasks_dir: Path) -> str:
    """The group's lm-eval tasks reading ``data`` (and their group); what ``--tasks`` names."""
    names = []
    for task, (config, directory) in group.tasks.items():
        suffix = ".jsonl" if group.files == "json" else f".{group.files}"
        files = {path.name.split("-")[0].removesuffix(suffix): path for path in sorted((data / directory).rglob(f"*{suffix}"))}
        names.append(harness_task(tasks_dir, PREFIX + task, lm_eval_tasks() / config, files, group.files))
    if group.harness_group is None:
        (name,) = names
        return name
    # The harness's own group yaml, its task list cut to these tasks (JSON is YAML).
    config = yaml.safe_load((lm_eval_tasks() / group.harness_group).read_text())
    config.update(group=PREFIX + group.name, task=names)
    (tasks_dir / f"{PREFIX}{group.name}.yaml").write_text(json.dumps(config, indent=1) + "\n")
    return PREFIX + group.name


def lm_eval_side(group: Group, model: Path, harness: str, tasks_dir: Path, out: Path, args) -> list[str]:
    extra = ["--limit", str(args.limit)] if args.limit else []
    extra += ["--gen_kwargs", f"max_gen_toks={args.max_new_tokens}"] if group.generative else []
    extra += ["--apply_chat_template"] if args.apply_chat_template else []
    return lm_eval_command(model, [harness], tasks_dir, out, args.batch_size, *extra)


def llmflow_side(group: Group, model: Path, data: Path, out: Path, args) -> list[str]:
    command = [str(BIN / "llmflow"), "eval", group.name, "--model", str(model), "--data", str(data), "--out", str(out),
               "--batch-size", str(args.batch_size), "--device", "cpu", "--dtype", "fp32"]
    command += ["--tasks", json.dumps(list(group.tasks))] if len(group.tasks) > 1 else []
    command += ["--limit", str(args.limit)] if args.limit else []
    command += ["--max-new-tokens", str(args.max_new_tokens)] if group.generative else []
    command += ["--apply-chat-template"] if args.apply_chat_template else []
    return command


def lm_eval_samples(out: Path, task: str) -> list[dict]:
    """lm-eval's logged samples of ``task`` (one per document and filter)."""
    (path,) = out.rglob(f"samples_{PREFIX}{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_prompts(task: str, samples: list[dict], ours: dict, stops: list[str] | None = None) -> None:
    """Fail unless lm-eval's logged contexts, with their logged continuations (or the generative
    task's ``stops``), hash to llmflow's prompts_sha256."""
    first = sorted({s["doc_id"]: s for s in samples}.values(), key=lambda s: s["doc_id"])
    continuations = [stops or [arg["arg_1"] for arg in s["arguments"].values()] for s in first]
    theirs = prompts_sha256([s["arguments"]["gen_args_0"]["arg_0"] for s in first], continuations)
    if theirs != ours["tasks"][task]["prompts_sha256"]:
        raise SystemExit(f"{task}: lm-eval's logged prompts differ from llmflow's (prompts_sha256)")


def close(a: float, b: float) -> bool:
    """Summed fp32 log-probabilities: within 1e-5, or one float32 step (~1e-7 relative) of sums past 100."""
    return abs(a - b) <= max(1e-5, 1.2e-7 * abs(b))


def check_choices(group: Group, outs: dict[str, Path]) -> dict:
    """Fail unless every document's choice log-likelihoods, prediction and accuracies agree."""
    ours = json.loads((outs["llmflow"] / "results.json").read_text())
    rows = {(r["task"], r["index"]): r for r in map(json.loads, (outs["llmflow"] / "predictions.jsonl").open())}
    largest, documents = 0.0, 0
    for task in group.tasks:
        samples = lm_eval_samples(outs["lm-eval"], task)
        check_prompts(task, samples, ours)
        if {s["doc_id"] for s in samples} != {i for t, i in rows if t == task}:
            raise SystemExit(f"{task}: lm-eval scored {len(samples)} documents, llmflow "
                             f"{sum(t == task for t, _ in rows)}")
        for sample in samples:
            row, lls = rows[(task, sample["doc_id"])], [float(r[0]) for r in sample["filtered_resps"]]
            prediction = max(range(len(lls)), key=lls.__getitem__)
            if (len(lls) != len(row["scores"]) or not all(map(close, row["scores"], lls)) or prediction != row["prediction"]
                    or any(float(sample[m]) != row[m] for m in ("acc", "acc_norm") if m in sample)):
                raise SystemExit(f"{task} document {sample['doc_id']} differs: llmflow {row['scores']} -> "
                                 f"{row['prediction']}, lm-eval {lls} -> {prediction}")
            largest = max(largest, *(abs(a - b) for a, b in zip(row["scores"], lls)))
        documents += len(samples)
    return {"documents": documents, "max_ll_diff": largest}


def same_scores(sample: dict, row: dict) -> bool:
    """Whether llmflow's record of a document scores as lm-eval's sample does: the extracted
    answer and exact match of the sample's filter, or (a task scored by its own functions, such
    as minerva_math's) each metric the sample logs."""
    if "extracted" in row:
        name = sample["filter"]
        return (sample["filtered_resps"][0] == row["extracted"][name]
                and float(sample["exact_match"]) == float(row["correct"][name]))
    metrics = [m for m in ("exact_match", "math_verify") if m in sample]
    return bool(metrics) and all(float(sample[m]) == float(row[m]) for m in metrics)


def check_generations(group: Group, outs: dict[str, Path]) -> dict:
    """Fail unless every document's generated text and, filter by filter, its extracted answer
    and score (or the task's own scores) agree."""
    ours = json.loads((outs["llmflow"] / "results.json").read_text())
    rows = {(r["task"], r["index"]): r for r in map(json.loads, (outs["llmflow"] / "predictions.jsonl").open())}
    documents = 0
    for task in group.tasks:
        samples = lm_eval_samples(outs["lm-eval"], task)
        check_prompts(task, samples, ours, ours["tasks"][task]["generation"]["until"])
        filters = {s["filter"] for s in samples}
        first = next(r for (t, _), r in rows.items() if t == task)
        if {s["doc_id"] for s in samples} != {i for t, i in rows if t == task} or filters != set(
                first.get("extracted", {"none": None})):
            raise SystemExit(f"{task}: lm-eval logged {len(samples)} samples (filters {sorted(filters)}), llmflow "
                             f"{sum(t == task for t, _ in rows)} documents")
        for sample in samples:
            row = rows[(task, sample["doc_id"])]
            if sample["resps"][0][0] != row["generated"] or not same_scores(sample, row):
                raise SystemExit(f"{task} document {sample['doc_id']} ({sample['filter']}) differs:\n"
                                 f"llmflow: {row['generated']!r} -> {row.get('extracted', row.get('answer'))!r}\n"
                                 f"lm-eval: {sample['resps'][0][0]!r} -> {sample['filtered_resps'][0]!r}")
        documents += len(samples) // len(filters)
    return {"documents": documents, "same_texts_and_answers": "yes"}


def bench_group(group: Group, sample: Path, work: Path, env: dict, args) -> dict:
    data, tasks_dir = sample / group.name, work / f"tasks-{group.name}"
    harness = write_tasks(group, data, tasks_dir)
    model = sample / "model"
    sides = {
        "lm-eval": lambda out: lm_eval_side(group, model, harness, tasks_dir, out, args),
        "llmflow": lambda out: llmflow_side(group, model, data, out, args),
    }
    check = check_generations if group.generative else check_choices
    row = alternate_rounds(group.name, sides, work, env, args.rounds, lambda outs: check(group, outs))
    shots = json.loads((work / f"{group.name}-llmflow" / "results.json").read_text())["settings"]["shots"]
    return {"group": group, "shots": shots, **row}


def report_lines(rows: list[dict], imports: dict[str, float]) -> list[str]:
    lines = [("| group | shots | documents | lm-eval s | llmflow s | lm-eval docs/s | llmflow docs/s | docs/s ratio, median "
              "| min-max | CPU-time ratio | lm-eval: in its timer / peak RSS MiB | llmflow: evaluating / peak RSS MiB "
              "| max log-likelihood diff |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        t, o, n = row["median"]["lm-eval"], row["median"]["llmflow"], row["documents"]
        diff = "same texts" if row["group"].generative else f"{row['max_ll_diff']:.1e}"
        lines.append(
            f"| {row['group'].name} | {row['shots']} | {n} | {t['wall']:.1f} | {o['wall']:.1f} | {n / t['wall']:.2f} | "
            f"{n / o['wall']:.2f} | {row['ratio']:.2f}x | {min(row['ratios']):.2f}x-{max(row['ratios']):.2f}x | "
            f"{row['cpu_ratio']:.2f}x | {t['in_tool']:.1f} s / {t['rss_mib']:.0f} | {o['in_tool']:.1f} s / "
            f"{o['rss_mib']:.0f} | {diff} |")
    lines.append(f"\nImports alone (one process each, wall): lm-eval CLI + hf backend {imports['lm-eval']:.1f} s, "
                 f"llmflow CLI {imports['llmflow']:.1f} s.")
    return lines


def agreement(row: dict, args) -> str:
    if row["group"].generative:
        chat = ", under the chat template (few-shot as turns)" if args.apply_chat_template else ""
        return (f"{row['shots']}-shot CoT{chat}, greedy, at most {args.max_new_tokens} new tokens, {row['documents']} "
                "documents, same generated texts and scores")
    return (f"{row['shots']}-shot, {row['documents']} documents, same predictions, log-likelihoods within "
            f"{row['max_ll_diff']:.1e}")


def record(rows: list[dict], lines: list[str], args, load_after: float) -> None:
    day, harness = time.strftime("%Y-%m-%d"), version("lm_eval")
    loads = ", ".join(f"{x:.1f}" for row in rows for x in row["loads"])
    current = [
        current_row("bench.eval", row["group"].name, f"real `lm_eval --model hf` ({harness}), whole process, batch "
                    f"{args.batch_size}, fp32, {agreement(row, args)}", "docs/s", row, args.threads, day)
        for row in rows
    ]
    limit = f" --limit {args.limit}" if args.limit else ""
    chat = " --apply-chat-template" if args.apply_chat_template else ""
    harness_chat = " --apply_chat_template" if args.apply_chat_template else ""
    entry = [
        (f"### {', '.join(args.groups)} against the real lm-evaluation-harness, whole process ({day}, {cpu_model()}, "
         f"{os.cpu_count()} cores, torch {torch.__version__}, lm_eval {harness}, {args.threads} thread(s) per process, "
         f"load average {loads} at the rounds' starts, {load_after:.1f} after)"),
        "",
        (f"`python -m bench.eval --groups {' '.join(args.groups)}{limit}{chat} --max-new-tokens {args.max_new_tokens} "
         f"--batch-size {args.batch_size} --rounds {args.rounds} --threads {args.threads}`: `lm_eval --model hf "
         f"--model_args pretrained=DIR,dtype=float32 --tasks <local copies of the harness's tasks and groups>{limit} "
         f"--batch_size {args.batch_size} --device cpu --log_samples{harness_chat}` (generative groups: `--gen_kwargs "
         f"max_gen_toks={args.max_new_tokens}`) against `llmflow eval GROUP{limit}{chat} --batch-size {args.batch_size}` "
         f"(`--max-new-tokens {args.max_new_tokens}`), the sample model and data (BoolQ, 2 AGIEval tasks, GSM8K, "
         f"2 BBH subtasks, MATH-500), the harness's default shots, medians over {args.rounds} rounds after one untimed run of "
         "each, order alternating; every round the same prompts (hash), log-likelihoods and predictions, or "
         "generated texts and extracted answers. 'in its timer': lm-eval's total_evaluation_time_seconds "
         "(everything after its imports); 'evaluating': llmflow's tokenization and forward passes or generation."),
        "",
        *lines,
    ]
    update_results(current, entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    parser.add_argument("--limit", type=int, help="the first N documents of each task (default: all of the sample's)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per document (gsm8k, bbh)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--apply-chat-template", action="store_true",
                        help="both sides render the prompts with the model's chat template (few-shot as turns)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of both sides (on a shared 2-core machine two threads spin-wait on each other)")
    parser.add_argument("--work", type=Path, help="working directory (default: a temporary one)")
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        work = (args.work or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        sample = write_sample(SampleConfig(out=work / "sample"))
        env = bench_env(work, args.threads)
        imports = side_imports(env)
        rows = [bench_group(GROUPS[name], sample, work, env, args) for name in args.groups]
    lines = report_lines(rows, imports)
    print("\n".join(lines))
    if args.record:
        record(rows, lines, args, os.getloadavg()[0])


if __name__ == "__main__":
    main()
