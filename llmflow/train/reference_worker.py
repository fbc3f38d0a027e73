"""``torchrun ... -m llmflow.train.reference_worker CONFIG.json``: the reference log-probs
stage alone (``llmflow.train.reference``): a worker sets the run up, which computes (or
finds cached) the log-probs of the config's model on its pairs, and stops before training."""

from __future__ import annotations

import sys
from pathlib import Path

from llmflow import runtime
from llmflow.train.config import TrainConfig
from llmflow.train.loop import setup
from llmflow.train.reference import reference_dir


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: torchrun ... -m llmflow.train.reference_worker CONFIG.json")
    run = setup(TrainConfig.model_validate_json(Path(args[0]).read_text(encoding="utf-8")))
    if run.env.is_main:
        print(f"reference log-probs of {run.objective.reference.shape[0]} rows in {reference_dir(run.config)}", flush=True)
    runtime.destroy_distributed()


if __name__ == "__main__":
    main()
