"""Orchestration overhead: ``finetune_eval`` through Prefect against the same stages called
directly as functions, and the cost of rerunning after a failure in the last stage.

- ``direct``: the stage functions in the flow's order (sample, convert, tokenize, MMLU of the
  base model, training on torchrun workers, export, answers to the prompts, MMLU of the
  finetuned model), each
  writing where the flow would, no Prefect and no MLflow;
- ``flow``: ``finetune_eval`` with the same parameters on Prefect's embedded server, which is
  started (and timed apart) before, so its one-time start is excluded;
- ``retry``: the flow again with its last evaluation forced to run (``refresh``): the work a
  retry after that stage failed does (every other stage from cache).

Overhead per stage = (flow - direct) / stages; target <= 2 s. Retry / flow: target <= 10%.
Defaults are the demo's (500 training steps); ``--steps`` shortens training.

    python -m bench.flow_overhead [--steps 500] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_direct(workspace: Path, params) -> float:
    """The flow's stages as plain function calls; seconds."""
    from llmflow.data.tokenize_instruction import InstructionTokenizeConfig, tokenize_instruction
    from llmflow.evaluate.benchmarks import MMLU
    from llmflow.evaluate.engine import EvalConfig, evaluate
    from llmflow.flows.stages import write_prompts
    from llmflow.infer.batch import InferConfig, run_inference
    from llmflow.sample.assets import SampleConfig, write_sample
    from llmflow.train.command import launch_training
    from llmflow.train.config import DataConfig
    from llmflow.weights.convert import ConvertConfig, convert
    from llmflow.weights.export import ExportConfig, export

    start = time.perf_counter()
    sample = write_sample(SampleConfig(out=workspace / "sample"))
    model, mmlu = sample / "model", sample / "mmlu" / "hf"
    checkpoint = convert(ConvertConfig(hf=model, out=workspace / "checkpoint"))
    data = tokenize_instruction(InstructionTokenizeConfig(
        input=[sample / "instruct" / "alpaca.parquet"], tokenizer=model, out=workspace / "data" / "sft",
        format="alpaca", seq_length=params.seq_length))
    evaluation = params.evaluation.model_dump(exclude={"data"})
    evaluate(MMLU, EvalConfig(model=model, data=mmlu, out=workspace / "eval-base", **evaluation))
    run = launch_training(params.train.train_config(Path(checkpoint), workspace / "run",
                                                   DataConfig(kind="sft", paths=[str(data)])),
                          params.train.nproc, on_line=lambda line: None)
    exported = export(ExportConfig(ckpt=run, out=workspace / "model"))
    run_inference(InferConfig(model=exported, prompts=write_prompts(workspace, params.prompts), out=workspace / "answers",
                              template="tokenizer", max_new_tokens=params.max_new_tokens))
    evaluate(MMLU, EvalConfig(model=exported, data=mmlu, out=workspace / "eval", **evaluation))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="training steps (default: the demo's 500)")
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        from llmflow.workspace import use_workspace

        root = use_workspace(Path(tmp) / "flow")
        os.environ.setdefault("LLMFLOW_DEVICE", "cpu")
        from prefect.testing.utilities import prefect_test_harness

        from llmflow.flows.finetune_eval import FinetuneEvalParams, finetune_eval

        params = FinetuneEvalParams.model_validate(
            {"workspace": str(root), "version": "bench", "train": {"steps": args.steps}})
        direct = run_direct(Path(tmp) / "direct", params)
        server_start = time.perf_counter()
        with prefect_test_harness(server_startup_timeout=180):
            server_seconds = time.perf_counter() - server_start
            start = time.perf_counter()
            result = finetune_eval(**dict(params))
            flow = time.perf_counter() - start
            start = time.perf_counter()
            finetune_eval(**dict(params.model_copy(update={"refresh": ["evaluate"]})))
            retry = time.perf_counter() - start
    stages = 8
    per_stage = (flow - direct) / stages
    lines = [
        "| side | seconds |", "|---|---|",
        f"| stages called directly | {direct:.1f} |",
        f"| finetune_eval through Prefect | {flow:.1f} |",
        f"| rerun with the last evaluation to redo | {retry:.1f} |",
        "",
        (f"Overhead per stage: {per_stage:.2f} s over {stages} stages (target <= 2 s); rerun / full run: "
        f"{retry / flow:.1%} (target <= 10%). Prefect server start, excluded: {server_seconds:.1f} s. "
        f"MMLU before {result['mmlu_before']:.3f}, after {result['mmlu_after']:.3f}."),
    ]
    print("\n".join(lines))
    if args.record:
        with (REPO / "bench" / "RESULTS.md").open("a") as f:
            f.write(f"\n## Flow overhead ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores)\n\n"
                    f"`python -m bench.flow_overhead --steps {args.steps}`: finetune_eval on the sample assets, "
                    f"{args.steps} training steps, one CPU worker.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
