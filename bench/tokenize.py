"""Pretraining tokenization benchmark: llmflow's stage against a Megatron-LM-style baseline.

The baseline works the way Megatron-LM's ``tools/preprocess_data.py`` does: a
multiprocessing Pool whose workers each load the HF tokenizer (AutoTokenizer) and call
``tokenizer.encode(text)`` per document, fed by ``pool.imap(encode, docs, chunksize=32)``,
with the main process appending every document to an indexed-dataset builder (here our
``IndexedDatasetWriter.add_document``, so both sides write the same format). llmflow's
stage batches documents through the Rust tokenizer's batch encoder and writes a batch at
a time, with a bounded number of batches in flight.

Same tokenizer, same generated parquet corpus, same worker count; the Rust tokenizer's
own thread pool is switched off on both sides (TOKENIZERS_PARALLELISM=false) so both use
exactly ``--workers`` cores. Each side runs in its own subprocess; peak RSS is reported
for its main process and for its largest worker (ru_maxrss). The two outputs must hold
identical tokens. Prints tokens/s, peak RSS and the ratio; ``--record`` appends a table
to bench/RESULTS.md.

    python -m bench.tokenize [--mb 50] [--workers N] [--tokenizer DIR] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

ROWS_PER_GROUP = 512


# --- corpus and tokenizer -------------------------------------------------------------------


def make_corpus(path: Path, mb: float, seed: int = 0) -> int:
    """A deterministic parquet corpus of ~``mb`` MB of text: Zipf-distributed words from a
    synthetic lexicon, documents of 20-600 words. Returns the document count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    lengths = rng.integers(2, 10, size=20000)
    lexicon = np.array(["".join(rng.choice(letters, n)) for n in lengths])
    target = int(mb * 1e6)
    written, docs = 0, 0
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as w:
        while written < target:
            batch = []
            for _ in range(ROWS_PER_GROUP):
                n = int(rng.integers(20, 600))
                words = lexicon[np.minimum(rng.zipf(1.3, n) - 1, len(lexicon) - 1)]
                text = " ".join(words) + "."
                batch.append(text)
                written += len(text)
                if written >= target:
                    break
            w.write_table(pa.table({"text": batch}))
            docs += len(batch)
    return docs


def make_tokenizer(corpus: Path, out: Path, vocab: int = 8192) -> Path:
    """A byte-level BPE trained on the first ~1 MB of the corpus, saved as a HF tokenizer."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts, size = [], 0
    for batch in pq.ParquetFile(corpus).iter_batches(batch_size=256):
        for t in batch.column(0).to_pylist():
            texts.append(t)
            size += len(t)
        if size > 1e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return out


# --- the two sides (each runs in its own subprocess) ------------------------------------------


class MegatronEncoder:
    """Megatron-LM preprocess_data.py's Encoder: a tokenizer per worker, one document per call."""

    def initializer(self, tokenizer_dir: str) -> None:
        from transformers import AutoTokenizer

        MegatronEncoder.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def encode(self, text: str):
        ids = MegatronEncoder.tokenizer.encode(text, add_special_tokens=False)
        return ids, len(text)


def run_baseline(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    import multiprocessing

    from transformers import AutoTokenizer

    from llmflow.data.indexed import IndexedDatasetWriter, optimal_token_dtype
    from llmflow.data.readers import iter_texts

    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    start = time.perf_counter()
    encoder = MegatronEncoder()
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initializer, initargs=(tokenizer,))
    docs = (text for _, text in iter_texts(corpus, "text"))
    encoded = pool.imap(encoder.encode, docs, 32)
    writer = IndexedDatasetWriter(f"{out}_text_document", optimal_token_dtype(vocab))
    for ids, _ in encoded:
        writer.add_document(ids)
    writer.finalize()
    pool.close()
    pool.join()
    return {"seconds": time.perf_counter() - start, "tokens": writer.num_tokens, "documents": writer.num_documents}


def run_ours(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    from llmflow.artifacts import read_manifest
    from llmflow.data.tokenize_pretrain import PretrainTokenizeConfig, tokenize_pretrain

    start = time.perf_counter()
    tokenize_pretrain(PretrainTokenizeConfig(input=[corpus], tokenizer=tokenizer, out=out, workers=workers))
    seconds = time.perf_counter() - start
    m = read_manifest(out)
    return {"seconds": seconds, "tokens": m["tokens"], "documents": m["documents"]}


def side_main(args) -> None:
    fn = run_ours if args.side == "ours" else run_baseline
    result = fn(args.corpus, args.tokenizer, args.out, args.workers)
    result["rss_main_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["rss_worker_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def run_side(side: str, corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "bench.tokenize", "--side", side, "--corpus", str(corpus), "--tokenizer", str(tokenizer),
           "--out", str(out), "--workers", str(workers)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode:
        sys.exit(f"{side} failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    return result


def encoder_ceiling(corpus: Path, tokenizer: Path, mb: float = 5.0) -> dict:
    """Single-core seconds for the first ``mb`` MB of documents: the baseline's per-document
    ``tokenizer.encode`` against the Rust batch encoder alone, in one process with no IPC and
    no writing. Their ratio bounds what any stage built on this encoder can gain."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    docs, size = [], 0
    for batch in pq.ParquetFile(corpus).iter_batches(batch_size=256, columns=["text"]):
        for text in batch.column(0).to_pylist():
            docs.append(text)
            size += len(text)
        if size >= mb * 1e6:
            break
    tok = AutoTokenizer.from_pretrained(tokenizer)
    start = time.perf_counter()
    for text in docs:
        tok.encode(text, add_special_tokens=False)
    per_doc = time.perf_counter() - start
    start = time.perf_counter()
    tok.backend_tokenizer.encode_batch_fast(docs, add_special_tokens=False)
    batch = time.perf_counter() - start
    return {"mb": size / 1e6, "per_doc_s": per_doc, "batch_s": batch, "ratio": per_doc / batch}


# --- driver ------------------------------------------------------------------------------------


def machine() -> dict:
    import tokenizers
    import transformers

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "-"
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50.0, help="MB of generated text (default 50)")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="worker processes, both sides")
    parser.add_argument("--tokenizer", type=Path, help="HF tokenizer dir (default: a BPE trained on the corpus)")
    parser.add_argument("--workdir", type=Path, help="keep corpus and outputs here (default: a temp dir)")
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    parser.add_argument("--side", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side_main(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / f"corpus_{args.mb:g}mb.parquet"
        docs = make_corpus(corpus, args.mb)
        tokenizer = args.tokenizer or make_tokenizer(corpus, work / "tokenizer")
        print(f"corpus: {corpus.stat().st_size / 1e6:.1f} MB parquet, {docs} documents, ~{args.mb:g} MB text; "
              f"workers {args.workers}")
        results = {
            "baseline": run_side("baseline", corpus, tokenizer, work / "baseline", args.workers),
            "ours": run_side("ours", corpus, tokenizer, work / "ours", args.workers),
        }
        same = all(
            Path(f"{work / 'baseline'}_text_document.{ext}").read_bytes()
            == Path(f"{work / 'ours'}_text_document.{ext}").read_bytes()
            for ext in ("bin", "idx")
        )
        if not same:
            sys.exit("outputs differ: the two sides did not produce identical tokens")
        ratio = results["ours"]["tokens_per_s"] / results["baseline"]["tokens_per_s"]
        rows = [
            f"| {name} | {r['documents']} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} "
            f"| {r['rss_main_mb']:.0f} | {r['rss_worker_mb']:.0f} |"
            for name, r in (("Megatron-style baseline", results["baseline"]), ("llmflow", results["ours"]))
        ]
        table = "\n".join([
            "| side | documents | tokens | s | tokens/s | peak RSS main MB | peak RSS worker MB |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ])
        print(table)
        print(f"identical tokens: yes; llmflow / baseline tokens/s: {ratio:.2f}x")
        ceiling = encoder_ceiling(corpus, tokenizer)
        ceiling_line = (
            f"Encoder-only ceiling, one core, first {ceiling['mb']:.1f} MB in one process: per-document "
            f"`tokenizer.encode` {ceiling['per_doc_s']:.2f} s, `encode_batch_fast` {ceiling['batch_s']:.2f} s "
            f"({ceiling['ratio']:.2f}x)."
        )
        print(ceiling_line)
        if args.record:
            m = machine()
            results_md = Path(__file__).with_name("RESULTS.md")
            with open(results_md, "a") as f:
                f.write(
                    f"\n## Pretraining tokenization, {args.mb:g} MB text, {args.workers} workers ({m['date']})\n\n"
                    f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, "
                    f"tokenizers {m['tokenizers']}, transformers {m['transformers']}. "
                    "`python -m bench.tokenize --mb "
                    f"{args.mb:g} --workers {args.workers}`\n\n{table}\n\nllmflow / baseline: {ratio:.2f}x tokens/s, "
                    "identical tokens.\n"
                    f"{ceiling_line}\n"
                )
            print(f"recorded in {results_md}")


if __name__ == "__main__":
    main()
