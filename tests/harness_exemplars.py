"""The chain-of-thought exemplars of the installed lm-evaluation-harness's gsm8k_cot and
bbh_cot_fewshot_* tasks, read from its task yamls, and the module llmflow carries them in.

``python tests/harness_exemplars.py`` writes ``llmflow/evaluate/cot_exemplars.py``;
tests/test_generative_tasks.py checks that the file is what this writes today.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

MODULE = Path(__file__).resolve().parents[1] / "llmflow" / "evaluate" / "cot_exemplars.py"
BBH_DOC_TO_TEXT = "Q: {{input}}\nA: Let's think step by step.\n"


def harness_tasks() -> Path:
    """The installed lm_eval's tasks directory."""
    return Path(importlib.util.find_spec("lm_eval").origin).parent / "tasks"


def harness_exemplars() -> dict[str, Any]:
    """gsm8k_cot's few-shot samples; each BBH subtask's description and few-shot samples."""
    from lm_eval import __version__
    from lm_eval.tasks._yaml_loader import load_yaml

    gsm8k = load_yaml(harness_tasks() / "gsm8k" / "gsm8k-cot.yaml")
    bbh = {}
    for path in sorted((harness_tasks() / "bbh" / "cot_fewshot").glob("[a-z]*.yaml")):
        config = load_yaml(path)
        assert config["doc_to_text"] == BBH_DOC_TO_TEXT and config["fewshot_config"]["sampler"] == "first_n", path
        bbh[config["dataset_name"]] = {"description": config["description"],
                                       "samples": config["fewshot_config"]["samples"]}
    return {"version": __version__, "gsm8k": gsm8k["fewshot_config"]["samples"], "bbh": bbh}


def render(exemplars: dict[str, Any]) -> str:
    """The Python module holding ``exemplars`` (JSON of strings is a Python literal)."""
    return (
        f'"""The chain-of-thought few-shot exemplars of lm-evaluation-harness {exemplars["version"]}, copied from\n'
        "its task yamls by tests/harness_exemplars.py (do not edit: run it again):\n\n"
        "- ``GSM8K_COT``: gsm8k/gsm8k-cot.yaml's fewshot_config samples (question, target);\n"
        "- ``BBH_COT_FEWSHOT``: per BBH subtask, bbh/cot_fewshot/{subtask}.yaml's description and\n"
        '  fewshot_config samples (input, target).\n"""\n\n'
        f"GSM8K_COT: list[dict[str, str]] = {json.dumps(exemplars['gsm8k'], indent=4, ensure_ascii=False)}\n\n"
        f"BBH_COT_FEWSHOT: dict[str, dict] = {json.dumps(exemplars['bbh'], indent=4, ensure_ascii=False)}\n"
    )


if __name__ == "__main__":
    MODULE.write_text(render(harness_exemplars()), encoding="utf-8")
    print(f"wrote {MODULE}")
