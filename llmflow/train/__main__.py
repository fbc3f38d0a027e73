"""``torchrun ... -m llmflow.train CONFIG.json``: one training worker."""

from __future__ import annotations

import sys
from pathlib import Path

from llmflow.train.config import TrainConfig
from llmflow.train.loop import train


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: torchrun ... -m llmflow.train CONFIG.json")
    train(TrainConfig.model_validate_json(Path(args[0]).read_text(encoding="utf-8")))


if __name__ == "__main__":
    main()
