"""Whole-process benchmarks against the real lm-evaluation-harness (bench.mmlu, bench.eval):
each side a command of its own, timed by the wall clock from start to exit, with its CPU time
and peak RSS; lm-eval pointed at local parquet files through task yamls that include its own;
rounds whose order alternates after one untimed run of each side."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

BIN = Path(sys.executable).parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SIDES = ("lm-eval", "llmflow")


def lm_eval_tasks() -> Path:
    """The task configurations of the installed lm-evaluation-harness."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise SystemExit("lm_eval is not installed: pip install -e '.[bench]' -c constraints.txt")
    return Path(spec.origin).parent / "tasks"


def harness_task(tasks: Path, name: str, include: Path, files: dict[str, Path], **fields: str) -> str:
    """Write task ``name`` into ``tasks``: lm-eval's own configuration ``include`` reading the
    parquet ``files`` (split -> path) instead of the Hub, with ``fields`` on top; its name."""
    tasks.mkdir(parents=True, exist_ok=True)
    # JSON strings are YAML strings: paths and texts need no quoting rules of their own.
    data_files = "".join(f"    {split}: {json.dumps(str(path))}\n" for split, path in files.items())
    extra = "".join(f"{key}: {json.dumps(value)}\n" for key, value in fields.items())
    (tasks / f"{name}.yaml").write_text(f"task: {name}\ninclude: {json.dumps(str(include))}\ndataset_path: parquet\n"
                                        f"dataset_name: null\ndataset_kwargs:\n  data_files:\n{data_files}{extra}")
    return name


def bench_env(work: Path, threads: int) -> dict[str, str]:
    """The environment of both sides: offline, ``threads`` OpenMP threads, caches under ``work``."""
    return {**os.environ, **OFFLINE, "OMP_NUM_THREADS": str(threads),
            "HF_DATASETS_CACHE": str(work / "hf-datasets"), "HF_HOME": str(work / "hf-home")}


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


def import_seconds(code: str, env: dict[str, str]) -> float:
    """Wall seconds of a process that only runs ``code`` (the imports a side starts with)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - start


def side_imports(env: dict[str, str]) -> dict[str, float]:
    """Each side's start-up imports alone, wall seconds."""
    return {"lm-eval": import_seconds("import lm_eval.__main__, lm_eval.models.huggingface", env),
            "llmflow": import_seconds("import llmflow.cli", env)}


def lm_eval_command(model: Path, tasks: list[str], tasks_dir: Path, out: Path, batch_size: int, *extra: str) -> list[str]:
    """``lm_eval --model hf`` on the CPU in fp32, logging its samples into ``out``."""
    return [str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
            "--tasks", ",".join(tasks), "--include_path", str(tasks_dir), *extra, "--batch_size", str(batch_size),
            "--device", "cpu", "--log_samples", "--output_path", str(out)]


def describe(checked: dict) -> str:
    """A round's agreement figures as one phrase ("max score diff 3.8e-06")."""
    return ", ".join(f"{key.replace('_', ' ')} {value:.1e}" if isinstance(value, float) else
                     f"{key.replace('_', ' ')} {value}" for key, value in checked.items())


def alternate_rounds(name: str, sides: dict[str, Callable[[Path], list[str]]], work: Path, env: dict[str, str],
                     rounds: int, check: Callable[[dict[str, Path]], dict]) -> dict:
    """One untimed run of each side (lm-eval converts the parquet files into its datasets cache
    then, as on any first run), then ``rounds`` rounds, the order alternating; ``check`` fails
    unless the two outputs agree and returns its figures. The median and spread of the
    lm-eval / llmflow wall-time ratio, the CPU-time ratio, each side's medians (wall, cpu,
    rss_mib, in_tool: the seconds its own timer reports) and the last round's figures."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    loads = []
    for round_ in range(rounds + 1):
        order = list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]
        outs = {side: work / f"{name}-{side}" for side in SIDES}
        load = os.getloadavg()[0]
        timing = {}
        for side in order:
            shutil.rmtree(outs[side], ignore_errors=True)
            timing[side] = run_command(sides[side](outs[side]), env, work / f"{name}-{side}.log")
        timing["llmflow"]["in_tool"] = json.loads((outs["llmflow"] / "results.json").read_text())["seconds"]
        (lm_results,) = outs["lm-eval"].rglob("results_*.json")
        timing["lm-eval"]["in_tool"] = float(json.loads(lm_results.read_text())["total_evaluation_time_seconds"])
        checked = check(outs)
        ratio = timing["lm-eval"]["wall"] / timing["llmflow"]["wall"]
        label = "warm-up" if round_ == 0 else f"round {round_}"
        print(f"{name} {label} ({' then '.join(order)}, load {load:.1f}): lm-eval {timing['lm-eval']['wall']:.1f} s, "
              f"llmflow {timing['llmflow']['wall']:.1f} s, ratio {ratio:.2f}x, {describe(checked)}", flush=True)
        if round_:
            for side in SIDES:
                runs[side].append(timing[side])
            loads.append(load)
    ratios = [t["wall"] / o["wall"] for t, o in zip(runs["lm-eval"], runs["llmflow"])]
    cpu_ratios = [t["cpu"] / o["cpu"] for t, o in zip(runs["lm-eval"], runs["llmflow"])]
    med = {side: {key: statistics.median(r[key] for r in runs[side]) for key in runs[side][0]} for side in SIDES}
    return {"ratios": ratios, "ratio": statistics.median(ratios), "cpu_ratio": statistics.median(cpu_ratios),
            "median": med, "loads": loads, **checked}


def current_row(benchmark: str, name: str, peer: str, unit: str, row: dict, threads: int, day: str) -> str:
    """The Current-table line of bench/RESULTS.md for one ``alternate_rounds`` result: the median
    ratio (in ``unit``) with the CPU-time ratio, the spread over the rounds, threads and loads."""
    return (f"| `{benchmark}` {name} | {peer} | {row['ratio']:.2f}x {unit} (CPU time {row['cpu_ratio']:.2f}x) | "
            f"{min(row['ratios']):.2f}x-{max(row['ratios']):.2f}x over {len(row['ratios'])} rounds | {threads} | "
            f"{', '.join(f'{x:.1f}' for x in row['loads'])} | {day} |")
