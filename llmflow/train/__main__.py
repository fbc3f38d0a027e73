"""``torchrun ... -m llmflow.train CONFIG.json``: one training worker."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from llmflow.train.config import TrainConfig
from llmflow.train.loop import train
from llmflow.weights import NonFiniteError


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: torchrun ... -m llmflow.train CONFIG.json")
    try:
        train(TrainConfig.model_validate_json(Path(args[0]).read_text(encoding="utf-8")))
    except NonFiniteError as error:
        # Every rank stops with the same message: rank 0 prints it, in one line, no traceback.
        raise SystemExit(f"{type(error).__name__}: {error}" if os.environ.get("RANK", "0") == "0" else 1) from None


if __name__ == "__main__":
    main()
