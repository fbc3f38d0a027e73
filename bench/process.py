"""Whole-process benchmarks against the real lm-evaluation-harness (bench.mmlu, bench.eval):
each side a command of its own, timed by the wall clock from start to exit, with its CPU time
and peak RSS; lm-eval pointed at local parquet files through task yamls that include its own;
rounds whose order alternates after one untimed run of each side.

The benchmarks of the real training worker (bench.pipeline, bench.context_parallel) share the
rest: a random Llama-shaped model and the tokenized sample corpus, a training config per
launch, the worker's step lines read back, each torchrun rank's peak RSS, and the CPU time
other people's jobs take on a shared machine (waited out before each launch, measured
during it)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
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
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss (\S+) \|.* \| ([0-9.]+) tokens/s \|")
"""The training worker's line for each step: step, steps, loss, tokens/s."""
LOSS_TOLERANCE = 1e-5
"""Largest difference between two layouts' losses at a step: the loss does not depend on the layout."""
QUIET_CORES = 0.25
"""A round whose runs had other jobs using more cores than this (on average over a launch) is
left out of the medians, unless every round was."""
WORKER_ENV = {"OMP_NUM_THREADS": "1", "LLMFLOW_DEVICE": "cpu"}
"""The environment of a training worker: the CPU, one thread per rank."""


def lm_eval_tasks() -> Path:
    """The task configurations of the installed lm-evaluation-harness."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise SystemExit("lm_eval is not installed: pip install -e '.[bench]' -c constraints.txt")
    return Path(spec.origin).parent / "tasks"


def harness_task(tasks: Path, name: str, include: Path, files: dict[str, Path], dataset_path: str = "parquet",
                 **fields: str) -> str:
    """Write task ``name`` into ``tasks``: lm-eval's own configuration ``include`` reading the
    ``files`` (split -> path; parquet, or ``dataset_path`` json or csv) instead of the Hub, with
    ``fields`` on top; its name."""
    tasks.mkdir(parents=True, exist_ok=True)
    # JSON strings are YAML strings: paths and texts need no quoting rules of their own.
    data_files = "".join(f"    {split}: {json.dumps(str(path))}\n" for split, path in files.items())
    extra = "".join(f"{key}: {json.dumps(value)}\n" for key, value in fields.items())
    (tasks / f"{name}.yaml").write_text(f"task: {name}\ninclude: {json.dumps(str(include))}\ndataset_path: {dataset_path}\n"
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


def rank_peaks_mib(stop: threading.Event, ranks: int, peaks: dict[int, list[float]]) -> None:
    """Find this process's descendants that are ``llmflow.train`` workers (torchrun's, a RANK
    in their environment), until ``ranks`` of them or ``stop`` is set, and keep
    ``peaks[rank][0]`` at each one's high-water RSS in MiB (``peak_rss_mib``, a thread per
    worker, polling until it exits)."""
    import psutil

    watched: set[int] = set()
    while len(watched) < ranks and not stop.wait(0.1):
        for child in psutil.Process().children(recursive=True):
            if child.pid in watched:
                continue
            try:
                command, rank = child.cmdline(), child.environ().get("RANK")
            except psutil.Error:  # exited meanwhile
                continue
            if rank is None or "llmflow.train" not in command or "torch.distributed.run" in command:
                continue
            watched.add(child.pid)
            peak = peaks.setdefault(int(rank), [0.0])
            threading.Thread(target=peak_rss_mib, args=(child.pid, peak), daemon=True).start()


class CpuMeter:
    """CPU time the rest of the machine used while this benchmark ran something: the busy time
    of /proc/stat less this process's and its reaped descendants' CPU time, in cores (other
    people's jobs on a shared machine; 0 where /proc/stat is missing)."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        own = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for field in ("ru_utime", "ru_stime"))
        busy = 0.0
        stat = Path("/proc/stat")
        if stat.is_file():
            fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
        return time.perf_counter(), busy, own

    def other_cores(self) -> float:
        now, busy, own = self._sample()
        wall = now - self.start[0]
        return max(0.0, (busy - self.start[1]) - (own - self.start[2])) / wall if wall > 0 else 0.0


def wait_quiet(budget: list[float], threshold: float = QUIET_CORES) -> None:
    """Wait, in 2 s windows, until the rest of the machine uses under ``threshold`` cores, or
    until the shared waiting budget (seconds, ``budget[0]``) runs out."""
    while budget[0] > 0:
        meter = CpuMeter()
        time.sleep(2.0)
        budget[0] -= 2.0
        if meter.other_cores() < threshold:
            return
    budget[0] = 0.0


def training_assets(work: Path, layers: int, hidden: int, intermediate: int, heads: int,
                    positions: int) -> tuple[Path, Path, int]:
    """A random Llama-shaped model (untied embeddings, the sample tokenizer and its vocabulary,
    ``positions`` positions at least 1024) and the tokenized sample corpus, under ``work``;
    returns (model dir, data prefix, parameter count)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain
    from llmflow.sample.assets import SampleConfig, write_sample

    sample = write_sample(SampleConfig(out=work / "sample")) / "model"
    tokenize_pretrain(PretrainTokenizeConfig(input=[work / "sample" / "pretrain" / "corpus.parquet"], tokenizer=sample,
                                             out=work / "wiki", append_eod=True))
    vocab = json.loads((sample / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max(1024, positions), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (sample / name).is_file():
            shutil.copy(sample / name, model_dir / name)
    return model_dir, work / "wiki", params


def training_config(model: Path, data: Path, out: Path, steps: int, seq: int, micro_batch: int, samples: int,
                    lr: float, **layout: object) -> Path:
    """A pretraining config (fp32, constant learning rate ``lr``, a step line per step) of
    ``steps`` steps of ``samples`` samples of ``seq`` tokens in micro-batches of
    ``micro_batch``, with the ``layout`` settings (pp, cp, microbatches, ...), written beside
    its (emptied) run directory ``out``; returns its path."""
    from llmflow.train.config import TrainConfig

    config = TrainConfig.model_validate({
        "model": str(model),
        "out": str(out),
        "data": {"kind": "pretrain", "paths": [str(data)]},
        "steps": steps,
        "seq_length": seq,
        "micro_batch_size": micro_batch,
        "global_batch_size": samples,
        "optim": {"lr": lr, "warmup_steps": 0, "decay": "constant"},
        "dtype": "fp32",
        "log_interval": 1,
        **layout,
    })
    shutil.rmtree(out, ignore_errors=True)  # a run directory holding a checkpoint would resume
    path = out.with_suffix(".json")
    path.write_text(config.model_dump_json())
    return path


def parse_steps(lines: list[str], warmup: int, steps: int, tokens: int) -> dict:
    """Losses and step seconds from the training worker's step lines (``tokens`` per step);
    the mean step time and tokens/s over the ``steps`` after the first ``warmup``."""
    losses, seconds = {}, {}
    for line in lines:
        match = STEP_LINE.match(line)
        if match:
            losses[int(match[1])] = float(match[3])
            seconds[int(match[1])] = tokens / float(match[4])
    if sorted(losses) != list(range(1, warmup + steps + 1)):
        raise SystemExit("a training worker logged no step line for some steps; its output:\n" + "\n".join(lines[-30:]))
    timed = [seconds[s] for s in range(warmup + 1, warmup + steps + 1)]
    return {"losses": [losses[s] for s in sorted(losses)], "step_s": statistics.mean(timed),
            "tokens_per_s": tokens * len(timed) / sum(timed)}


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
