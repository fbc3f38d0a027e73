"""Pretraining tokenization benchmark: ``llmflow tokenize pretrain`` against Megatron-LM's
``tools/preprocess_data.py``, the tool users run for the same job.

The corpus is the sample corpus (``llmflow sample``: articles in the Wikipedia-dump layout,
here with 200 countries and as many articles as make ``--mb`` MB of text), exported to JSON
lines, the input Megatron's script reads; both sides read that same file. Tokenizer: the
sample model directory (a byte-level BPE with Qwen2's pre-tokenizer, ``model_type`` qwen2),
which both sides load through transformers' ``AutoTokenizer``.

The peer is the real script at the tag of the pinned megatron-core (``core_v0.16.1``). The
megatron-core sdist on PyPI ships only ``megatron/core``, not ``tools/`` nor the
``megatron/training`` package the script imports, so the benchmark clones the Megatron-LM
repository at that tag (``--megatron-lm``: its URL or a local clone) into a cache directory
once, and runs ``tools/preprocess_data.py`` from there with the installed megatron-core (the
script appends the checkout to ``sys.path``, after site-packages). The script's import of
``megatron.training`` reaches ``triton``; where this environment lacks it (CPU torch), the
benchmark installs it with pip into the cache and puts it on the peer's ``PYTHONPATH`` only.
Megatron's command: ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --json-keys
text --append-eod --workers N`` (no ``--split-sentences``, so no nltk; with transformers 5
``AutoTokenizer`` gives the fast tokenizer whatever ``--tokenizer-hf-use-fast`` says).
llmflow's: ``llmflow tokenize pretrain --input FILE --tokenizer DIR --append-eod --workers N``.

Every run's ``.bin`` and ``.idx`` must be byte-identical to the first Megatron run's; the
benchmark stops otherwise. Both run as whole processes (imports and start-up included:
that is what a user waits for), with the Rust tokenizer's own thread pool off
(``TOKENIZERS_PARALLELISM=false``) so each side uses ``--workers`` processes and no more.
A round runs both sides at every worker count, Megatron first in even rounds and llmflow
first in odd ones. Speed is MB of input text (UTF-8 bytes of the ``text`` fields) per
second. The ceiling is the encoder's single-core rate (the same tokenizer's batch encoder,
``encode_batch_fast``, on the first ``CEILING_MB`` MB, one process, no I/O, the fastest of
a few batch sizes; measured every round) times the worker count: no side built on this
encoder can beat it, and with more workers than cores no side can reach it.

    python -m bench.tokenize [--mb 50] [--workers 1 2 4] [--rounds 5] [--megatron-lm URL|DIR] [--record]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import cpu_model
from bench.results import update_results

REPO = Path(__file__).resolve().parent.parent
MEGATRON_LM = "https://github.com/NVIDIA/Megatron-LM.git"
TRITON = "triton==3.7.1"
ARTICLE_BYTES = 720  # mean text bytes of a sample article with 200 countries
CEILING_MB = 2.0
CEILING_BATCHES = (64, 256, 1024)
ROW = "| `bench.tokenize`"


# --- corpus ------------------------------------------------------------------------------------


def make_corpus(work: Path, mb: float) -> tuple[Path, Path, float, int]:
    """The sample assets with enough articles for ~``mb`` MB of text (reused when ``work``
    already holds them) and their corpus as JSON lines. Returns (jsonl, tokenizer dir,
    MB of text, documents)."""
    from llmflow.artifacts import read_manifest
    from llmflow.sample.assets import SampleConfig, write_sample

    documents = max(1, round(mb * 1e6 / ARTICLE_BYTES))
    sample = work / "sample"
    manifest = read_manifest(sample) if sample.is_dir() else None
    if (manifest or {}).get("counts", {}).get("documents") != documents:
        print(f"writing the sample assets with {documents} articles ...", flush=True)
        write_sample(SampleConfig(out=sample, countries=200, documents=documents, tokenizer_vocab=8192))
    jsonl = work / "corpus.jsonl"
    import pyarrow.parquet as pq

    size = 0
    with open(jsonl, "w", encoding="utf-8") as f:
        for row in pq.read_table(sample / "pretrain" / "corpus.parquet").to_pylist():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            size += len(row["text"].encode())
    return jsonl, sample / "model", size / 1e6, documents


# --- the peer ----------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmflow-bench"


def megatron_checkout(source: str, cache: Path) -> tuple[Path, dict[str, str]]:
    """Megatron-LM at the pinned megatron-core's tag (cloned into ``cache`` once) and the
    environment its script needs. ``source`` is the repository's URL or a local clone."""
    version = importlib.metadata.version("megatron-core")
    tag = f"core_v{version}"
    checkout = cache / f"megatron-lm-{tag}"
    script = checkout / "tools" / "preprocess_data.py"
    if not script.is_file():
        url = Path(source).resolve().as_uri() if Path(source).is_dir() else source
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{checkout.name}.", dir=cache))
        print(f"cloning Megatron-LM {tag} from {source} ...", flush=True)
        proc = subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", tag, url, str(tmp)],
                              capture_output=True, text=True, check=False)
        if proc.returncode or not (tmp / "tools" / "preprocess_data.py").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            sys.exit(f"--megatron-lm {source}: cannot clone tag {tag} with tools/preprocess_data.py: {proc.stderr.strip()}")
        tmp.rename(checkout)
    installed = Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0])
    ours = (installed / "datasets" / "indexed_dataset.py").read_bytes()
    if (checkout / "megatron" / "core" / "datasets" / "indexed_dataset.py").read_bytes() != ours:
        sys.exit(f"{checkout}: megatron/core/datasets/indexed_dataset.py differs from the installed megatron-core {version}'s")
    env = {}
    if importlib.util.find_spec("triton") is None:
        deps = cache / "megatron-deps"
        if not (deps / "triton").is_dir():
            print(f"installing {TRITON} into {deps} (imported by megatron.training) ...", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-c", str(REPO / "constraints.txt"),
                            "--target", str(deps), TRITON], check=True)
        env["PYTHONPATH"] = str(deps)
    return checkout, env


# --- one run of each side ----------------------------------------------------------------------


def run_megatron(checkout: Path, env: dict, corpus: Path, tokenizer: Path, out: Path, workers: int) -> float:
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(out),
           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--json-keys", "text",
           "--append-eod", "--workers", str(workers)]
    return timed(cmd, checkout, env, "Megatron-LM preprocess_data.py")


def run_llmflow(corpus: Path, tokenizer: Path, out: Path, workers: int) -> float:
    cmd = [sys.executable, "-m", "llmflow.cli", "tokenize", "pretrain", "--input", str(corpus), "--tokenizer", str(tokenizer),
           "--out", str(out), "--append-eod", "--workers", str(workers)]
    return timed(cmd, REPO, {}, "llmflow tokenize pretrain")


def timed(cmd: list[str], cwd: Path, extra_env: dict, name: str) -> float:
    """Wall-clock seconds of ``cmd`` as a whole process."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra_env)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return seconds


def digests(prefix: Path) -> dict[str, str]:
    return {ext: hashlib.sha256(Path(f"{prefix}_text_document.{ext}").read_bytes()).hexdigest() for ext in ("bin", "idx")}


def check_same(megatron: Path, ours: Path, want: dict[str, str]) -> None:
    """Stop unless both sides' .bin/.idx of this round are ``want`` (the first Megatron run's)."""
    if digests(megatron) != want:
        sys.exit(f"{megatron}_text_document: Megatron's output changed between runs")
    for ext, digest in digests(ours).items():
        if digest != want[ext]:
            a = Path(f"{megatron}_text_document.{ext}").read_bytes()
            b = Path(f"{ours}_text_document.{ext}").read_bytes()
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            sys.exit(f"{ours}_text_document.{ext} differs from Megatron's {megatron}_text_document.{ext}: "
                     f"{len(b)} and {len(a)} bytes, first difference at byte {first}")


def encoder_rate(texts: list[str], tokenizer) -> float:
    """MB/s of the batch encoder on one core: the fastest of ``CEILING_BATCHES``."""
    mb = sum(len(t.encode()) for t in texts) / 1e6
    best = float("inf")
    for size in CEILING_BATCHES:
        start = time.perf_counter()
        for i in range(0, len(texts), size):
            tokenizer.encode_batch_fast(texts[i:i + size], add_special_tokens=False)
        best = min(best, time.perf_counter() - start)
    return mb / best


def ceiling_texts(corpus: Path) -> list[str]:
    texts, size = [], 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= CEILING_MB * 1e6:
                break
    return texts


# --- report ------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[int, dict[str, list[float]]], mb: float) -> list[dict]:
    rows = []
    for workers, r in runs.items():
        ratio = [m / ours for m, ours in zip(r["megatron"], r["llmflow"], strict=True)]
        ceiling = [rate * workers for rate in r["encoder"]]
        rows.append({
            "workers": workers,
            "megatron": spread([mb / s for s in r["megatron"]]),
            "llmflow": spread([mb / s for s in r["llmflow"]]),
            "ceiling": spread(ceiling),
            "llmflow_of_ceiling": spread([mb / s / c for s, c in zip(r["llmflow"], ceiling, strict=True)]),
            "megatron_of_ceiling": spread([mb / s / c for s, c in zip(r["megatron"], ceiling, strict=True)]),
            "ratio": spread(ratio),
        })
    return rows


def fmt(s: dict[str, float], unit: str = "", digits: int = 2) -> str:
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def table(rows: list[dict]) -> list[str]:
    lines = [
        ("| workers | Megatron MB/s | llmflow MB/s | ceiling MB/s | Megatron / ceiling | llmflow / ceiling "
        "| llmflow / Megatron |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {fmt(r['megatron'])} | {fmt(r['llmflow'])} | {fmt(r['ceiling'])} "
            f"| {r['megatron_of_ceiling']['median']:.0%} | {r['llmflow_of_ceiling']['median']:.0%} "
            f"| {fmt(r['ratio'], 'x')} |")
    return lines


def row_key(mb: float, workers: int) -> str:
    return f"{ROW} {mb:.0f} MB, {workers} worker{'s' if workers > 1 else ''} |"


def record(rows: list[dict], entry: list[str], args: argparse.Namespace, mb: float, load: str) -> None:
    """Append ``entry`` to History and put this run's rows in the Current table, in place of
    the rows of the same corpus size and worker count and of any row of an earlier peer."""
    day = time.strftime("%Y-%m-%d")
    peer = "Megatron-LM `tools/preprocess_data.py`"
    current = {
        row_key(mb, r["workers"]): (
            f"{row_key(mb, r['workers'])} {peer} ({importlib.metadata.version('megatron-core')}), text as JSONL, "
            f"byte-identical .bin/.idx | {r['ratio']['median']:.2f}x MB/s, whole process; llmflow at "
            f"{r['llmflow_of_ceiling']['median']:.0%} of the encoder ceiling | {r['ratio']['min']:.2f}x-"
            f"{r['ratio']['max']:.2f}x over {args.rounds} rounds | {r['workers']} worker "
            f"process{'es' if r['workers'] > 1 else ''} | {load} | {day} |")
        for r in rows
    }
    # Rows of other corpus sizes stay; rows measured against an earlier peer go.
    update_results(list(current.values()), entry, stale=lambda row: row.startswith(ROW) and peer not in row)


# --- driver ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50.0, help="MB of text in the corpus (default 50)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts to sweep (default 1 2 4)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per worker count (default 5)")
    parser.add_argument("--megatron-lm", default=MEGATRON_LM, help="Megatron-LM repository: URL or local clone")
    parser.add_argument("--workdir", type=Path, help="keep the corpus and outputs here (default: a temp dir)")
    parser.add_argument("--record", action="store_true", help="record the result in bench/RESULTS.md")
    args = parser.parse_args()
    if args.rounds < 1 or min(args.workers) < 1:
        sys.exit("--rounds and --workers must be at least 1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    checkout, megatron_env = megatron_checkout(args.megatron_lm, cache_dir())
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus, tokenizer_dir, mb, documents = make_corpus(work, args.mb)
        from llmflow.data.tokenizer import load_tokenizer

        encoder, texts = load_tokenizer(tokenizer_dir), ceiling_texts(corpus)
        load_before = os.getloadavg()
        print(f"corpus: {documents} documents, {mb:.1f} MB of text ({corpus.stat().st_size / 1e6:.1f} MB JSONL); "
              f"Megatron-LM at {checkout}; load average {load_before[0]:.1f}", flush=True)
        megatron_out, ours_out = work / "megatron", work / "llmflow"
        want = None
        runs = {w: {"megatron": [], "llmflow": [], "encoder": []} for w in args.workers}
        for rnd in range(args.rounds):
            for workers in args.workers:
                r = runs[workers]
                r["encoder"].append(encoder_rate(texts, encoder))
                for side in (("megatron", "llmflow") if rnd % 2 == 0 else ("llmflow", "megatron")):
                    if side == "megatron":
                        r["megatron"].append(run_megatron(checkout, megatron_env, corpus, tokenizer_dir, megatron_out, workers))
                    else:
                        r["llmflow"].append(run_llmflow(corpus, tokenizer_dir, ours_out, workers))
                want = want or digests(megatron_out)
                check_same(megatron_out, ours_out, want)
                print(f"round {rnd + 1} workers {workers}: Megatron {r['megatron'][-1]:.1f} s, llmflow "
                      f"{r['llmflow'][-1]:.1f} s, encoder {r['encoder'][-1]:.2f} MB/s per core, load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
        load_after = os.getloadavg()
    rows = summarize(runs, mb)
    load = ", ".join(f"{x:.1f}" for x in load_before)
    import tokenizers
    import transformers

    entry = [
        f"### Pretraining tokenization against Megatron-LM preprocess_data.py ({time.strftime('%Y-%m-%d')})",
        "",
        (f"{cpu_model()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, megatron-core "
        f"{importlib.metadata.version('megatron-core')} (Megatron-LM tag core_v{importlib.metadata.version('megatron-core')}), "
        f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}; load average {load} before, "
        f"{load_after[0]:.1f} after. `python -m bench.tokenize --mb {args.mb:g} --workers "
        f"{' '.join(map(str, args.workers))} --rounds {args.rounds}`: {documents} sample articles, {mb:.1f} MB of text; "
        "whole-process wall clock, median (min-max) over the rounds; ceiling = the batch encoder's one-core "
        "MB/s x workers. Every run's .bin and .idx byte-identical to Megatron's."),
        "",
        *table(rows),
    ]
    print("\n".join(entry[2:]), flush=True)
    if args.record:
        record(rows, entry, args, mb, load)


if __name__ == "__main__":
    main()
