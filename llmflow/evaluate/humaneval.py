"""HumanEval as lm-evaluation-harness 0.4.13's ``humaneval`` task (version 1.0) defines it:
zero-shot, the prompt alone ("{{prompt}}"), greedy generation until "\\nclass", "\\ndef",
"\\n#", "\\nif" or "\\nprint" (1024 tokens at most); each program (the prompt, the completion,
the problem's tests and ``check(entry_point)``: the ``create_test`` filter's prediction and
the task's target, as HF evaluate's code_eval joins them) runs in llmflow's sandbox with
human-eval's timeout of 3 seconds; pass@1 of the one greedy sample per problem.

The reader takes a local directory in ``openai/openai_humaneval``'s Hub layout
(``openai_humaneval/test-*.parquet``) or the ``HumanEval.jsonl`` of openai/human-eval
(uncompressed). Sampling several completions per problem (pass@k for k > 1) is not offered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmflow.evaluate.generative_tasks import Doc, GenerativeGroup, GenerativeTask, Scored
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.sandbox import SandboxLimits, humaneval_program, pass_at_k, run_programs
from llmflow.evaluate.task_files import excerpt, read_split

FIELDS = ("task_id", "prompt", "test", "entry_point")
LAYOUTS = (("openai_humaneval/{split}-*.parquet", "{split}-*.parquet"), ("HumanEval.jsonl",))
EXPECTED = ("openai/openai_humaneval (openai_humaneval/test-*.parquet with columns "
            f"{', '.join(FIELDS)}) or openai/human-eval's HumanEval.jsonl")


@dataclass(frozen=True)
class Problem(Doc):
    """One HumanEval problem: its prompt is the text, its tests and ``check`` call the target
    (the harness's doc_to_target)."""

    task_id: str
    test: str
    entry_point: str


def humaneval_problem(row: dict[str, Any], where: str) -> Problem:
    """A problem from one row of either layout."""
    values = {name: row.get(name) for name in FIELDS}
    bad = [name for name, value in values.items() if not isinstance(value, str) or not value]
    if bad:
        raise BenchmarkDataError(f"{where}: expected {bad} as non-empty text, got {excerpt(row)}")
    return Problem(text=values["prompt"], target=f"{values['test']}\ncheck({values['entry_point']})",
                   task_id=values["task_id"], test=values["test"], entry_point=values["entry_point"])


def read_humaneval(root: Path) -> list[Doc]:
    """The HumanEval problems under ``root`` in either layout."""
    return read_split("HumanEval", root, "test", LAYOUTS, FIELDS, EXPECTED, humaneval_problem)


@dataclass(frozen=True)
class PassAtOne:
    """Each completion's program run in the sandbox; pass@1 of one sample per problem."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    metric: str = "pass_at_1"

    def __call__(self, docs: Sequence[Doc], texts: list[str], workers: int) -> list[Scored]:
        problems = [doc for doc in docs if isinstance(doc, Problem)]
        if len(problems) != len(docs) or len(texts) != len(docs):
            raise TypeError("pass@1 scores HumanEval problems, one completion each")
        programs = [humaneval_program(p.text, text, p.test, p.entry_point) for p, text in zip(problems, texts)]
        outcomes = run_programs(programs, self.limits, workers)
        return [Scored({"task_id": p.task_id, "result": o.result, "passed": o.passed},
                       {self.metric: pass_at_k(1, int(o.passed), 1)}) for p, o in zip(problems, outcomes)]


HUMANEVAL_TASK = GenerativeTask(
    name="humaneval", version="1.0", description="", exemplars=(), target_delimiter="",
    until=("\nclass", "\ndef", "\n#", "\nif", "\nprint"), max_gen_toks=1024,
    subdir="", hub_include=("openai_humaneval/test-*",), read=read_humaneval, scorer=PassAtOne(),
)
HUMANEVAL = GenerativeGroup(name="humaneval", title="HumanEval", harness_name="humaneval",
                            tasks=(HUMANEVAL_TASK,), headline_filter="create_test")
