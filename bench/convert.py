"""Conversion benchmark: ``llmflow convert`` (HF safetensors -> DCP checkpoint) against a
plain copy of the same safetensors bytes, plus ``llmflow export`` back to safetensors, and the
Megatron round trip: ``llmflow export --megatron`` (DCP -> megatron-core torch_dist) and
``llmflow convert --megatron`` (torch_dist -> DCP).

The model is a randomly initialised, untied Llama-shaped checkpoint of ~480 MB fp32 in two
safetensors shards, written straight from random tensors (no model is built). Its
50,257-token vocabulary is padded to 50,304 rows by the conversion. Each side runs in its
own subprocess (all import the same libraries), so peak resident memory is measured per
side and compared with the largest tensor and the model size. The copy is
``shutil.copyfile`` of each file followed by fsync, as the DCP writer fsyncs every file.
Prints GB/s, peak RSS and the ratios, and with --record appends the result to bench/RESULTS.md.

    python -m bench.convert [--repeat 3] [--record]

(-P keeps bench/ off sys.path: bench/tokenize.py would shadow the standard library's tokenize.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import own_memory_mib

REPO = Path(__file__).resolve().parent.parent
CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 50257, "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 12,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
SIDES = ("copy", "convert", "export", "megatron-export", "megatron-import")


def _shapes() -> dict[str, tuple[int, ...]]:
    v, h, f = CONFIG["vocab_size"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
    }
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            **{p + f"self_attn.{n}.weight": (h, h) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        })
    return shapes


def make_model(directory: Path) -> dict[str, int]:
    """Two safetensors shards with an index, config.json; returns sizes for the report."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    shapes = _shapes()
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        fname = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: torch.randn(shapes[n], generator=g) * 0.02 for n in part}, str(directory / fname),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    nbytes = {n: 4 * torch.Size(s).numel() for n, s in shapes.items()}
    index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return {"model_bytes": sum(nbytes.values()), "largest_tensor_bytes": max(nbytes.values()),
            "file_bytes": sum(p.stat().st_size for p in directory.glob("*.safetensors"))}


def run_side(side: str, work: Path) -> dict:
    """Runs in a child process: one conversion (or copy, or export), timed, with peak memory."""
    from llmflow.weights.convert import ConvertConfig, convert
    from llmflow.weights.export import ExportConfig, export

    hf, out = work / "hf", work / side
    shutil.rmtree(out, ignore_errors=True)
    rss_before = own_memory_mib("VmRSS")
    t0 = time.perf_counter()
    if side == "copy":
        out.mkdir()
        for path in sorted(hf.glob("*.safetensors")):
            shutil.copyfile(path, out / path.name)
            with open(out / path.name, "rb") as f:
                os.fsync(f.fileno())
    elif side == "convert":
        convert(ConvertConfig(hf=hf, out=out))
    elif side == "export":
        export(ExportConfig(ckpt=work / "convert", out=out))
    elif side == "megatron-export":
        export(ExportConfig(ckpt=work / "convert", megatron=out))
    else:
        convert(ConvertConfig(hf=hf, megatron=work / "megatron-export", out=out))
    seconds = time.perf_counter() - t0
    return {"side": side, "seconds": seconds, "rss_before_mib": rss_before, "peak_rss_mib": own_memory_mib()}


def _child(side: str, work: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.convert", "--child", side, str(work)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per side; the median time is reported")
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "WORK_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_side(args.child[0], Path(args.child[1]))))
        return

    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as tmp:
        work = Path(tmp)
        (work / "hf").mkdir()
        sizes = make_model(work / "hf")
        runs = {side: [_child(side, work) for _ in range(args.repeat)] for side in SIDES}

    gb = sizes["file_bytes"] / 1e9
    rows = []
    for side in SIDES:
        seconds = statistics.median(r["seconds"] for r in runs[side])
        rows.append({"side": side, "seconds": seconds, "gb_s": gb / seconds,
                     "peak_rss_mib": max(r["peak_rss_mib"] for r in runs[side]),
                     "added_rss_mib": max(r["peak_rss_mib"] - r["rss_before_mib"] for r in runs[side])})
        print(json.dumps(rows[-1]))
    copy, conv, megatron = rows[0], rows[1], rows[3:]
    mib = 2**20
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}"
    names = {
        "copy": "shutil.copyfile + fsync",
        "convert": "llmflow convert (HF -> DCP)",
        "export": "llmflow export (DCP -> HF)",
        "megatron-export": "llmflow export --megatron (DCP -> megatron-core torch_dist)",
        "megatron-import": "llmflow convert --megatron (torch_dist -> DCP)",
    }
    lines = [
        f"### convert ({time.strftime('%Y-%m-%d')}, {machine})",
        (f"Llama-shaped, untied, fp32, {sizes['file_bytes'] / 1e6:.0f} MB in 2 safetensors shards; largest tensor "
         f"{sizes['largest_tensor_bytes'] / mib:.0f} MiB; vocabulary padded 50257 -> 50304; median of {args.repeat} "
         "runs, files in the page cache"),
        "",
        "| side | seconds | GB/s | peak RSS MiB | peak RSS above start MiB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {names[r['side']]} | {r['seconds']:.2f} | {r['gb_s']:.2f} | {r['peak_rss_mib']:.0f} "
            f"| {r['added_rss_mib']:.0f} |"
        )
    lines += [
        "",
        (f"convert / copy throughput: {conv['gb_s'] / copy['gb_s']:.2f}x; convert's memory above start: "
         f"{conv['added_rss_mib'] * mib / sizes['largest_tensor_bytes']:.2f}x the largest tensor, "
         f"{conv['added_rss_mib'] * mib / sizes['model_bytes']:.2f}x the model. Megatron export and import above "
         "start: " + ", ".join(f"{r['added_rss_mib'] * mib / sizes['largest_tensor_bytes']:.2f}x the largest tensor "
                               f"({r['added_rss_mib'] * mib / sizes['model_bytes']:.2f}x the model)" for r in megatron)
         + "."),
    ]
    print("\n".join(lines))
    if args.record:
        results = Path(__file__).with_name("RESULTS.md")
        with results.open("a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
