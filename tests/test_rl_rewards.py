"""GRPO's rewards: each built-in on hand-written completions (math_verify and think_format
against TRL's own), loading a user's reward by name and the problems that keep one from
loading, and the scorer's worker pool: results, weights, and every way a reward can fail,
after which the scorer still works."""

from __future__ import annotations

import sys
import textwrap
import time

import numpy as np
import pytest
from trl.rewards import accuracy_reward, think_format_reward

from llmflow.train.grpo.rewards import (
    BUILTINS,
    RewardConfig,
    RewardError,
    RewardScorer,
    code,
    code_program,
    final_answer_format,
    gsm8k_flexible,
    gsm8k_reference,
    gsm8k_strict,
    load_reward,
    math_answer,
    normalize_answer,
    qa_match,
    reward_problems,
    think_format,
    weighted,
)

JUDGE = '''
import os
import time


def judge(prompts, completions, completion_ids, *, behaviour, **columns):
    """Whatever the row's ``behaviour`` asks for."""
    what = behaviour[0]
    if what == "ids":
        return [float(len(completion_ids[0]))]
    if what == "prompt":
        return [1.0 if prompts[0] == "Q?" and columns["extra"] == [7] else 0.0]
    if what == "raise":
        raise ValueError("judge refused")
    if what == "sleep":
        time.sleep(30)
    if what == "exit":
        os._exit(3)
    return {"none": [None], "nan": [float("nan")], "two": [1.0, 2.0], "text": ["1"]}[what]


not_a_function = 3
'''


def rewards_of(function, completions: list[str], **columns: list) -> list[float | None]:
    """A reward function called as the scorer calls it: prompts and ids beside the columns."""
    return function(["Q?"] * len(completions), completions, [[1, 2]] * len(completions), **columns)


def test_gsm8k_reference():
    assert gsm8k_reference("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert gsm8k_reference("1,000 + 234 = 1,234\n#### 1,234") == "1234"
    assert gsm8k_reference("#### $18.") == "18"
    assert gsm8k_reference(" -5 ") == "-5"
    assert gsm8k_reference(12) == "12"


@pytest.mark.parametrize(("completion", "answer", "strict", "flexible"), [
    ("48 + 24 = 72 clips.\n#### 72", "Natalia sold 72 clips.\n#### 72", 1.0, 1.0),
    ("So the answer is 72.", "#### 72", 0.0, 1.0),  # no "#### N": only the flexible one finds it
    ("#### 72\nOr rather 73 clips.", "#### 72", 1.0, 0.0),  # the strict one reads "#### N" alone
    ("#### 71\nwait, #### 72", "#### 72", 1.0, 1.0),  # the last "#### N"
    ("The total is #### 1,234", "#### 1234", 1.0, 1.0),
    ("It drops by 3 degrees, to #### -3", "-3", 1.0, 1.0),
    ("####72", "#### 72", 0.0, 1.0),  # verl's strict regex wants the space
    ("#### 72.0", "#### 72", 0.0, 0.0),  # compared as strings
    ("#### 5, friend,", "#### 5", 1.0, 1.0),  # a lone "," is no number
    ("No idea, sorry.", "#### 5", 0.0, 0.0),
])
def test_gsm8k_strict_and_flexible(completion, answer, strict, flexible):
    assert rewards_of(gsm8k_strict, [completion], answer=[answer]) == [strict]
    assert rewards_of(gsm8k_flexible, [completion], answer=[answer]) == [flexible]


def test_math_verify_is_trls_accuracy_reward():
    cases = [
        (r"So the answer is $\boxed{\frac{1}{3}}$.", r"\frac{1}{3}"),
        (r"So the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{3}"),
        (r"We get $x = 0.5$, that is $\boxed{\frac{1}{2}}$", "$0.5$"),
        (r"The roots are $\boxed{2, 3}$", r"$\{2, 3\}$"),
        ("The answer is 72", "72"),  # no LaTeX anchor in the completion
        (r"$\boxed{72}$", "Natalia sold 72 clips.\n#### 72"),
        (r"$\boxed{3}$", "no number here"),  # an unparsable reference: None
    ]
    completions = [completion for completion, _ in cases]
    solutions = [solution for _, solution in cases]
    trl = accuracy_reward([[{"role": "assistant", "content": text}] for text in completions], solutions)
    assert rewards_of(math_answer, completions, solution=solutions) == trl
    assert rewards_of(math_answer, completions, answer=solutions) == trl
    assert trl[:2] == [1.0, 0.0] and trl[-1] is None
    with pytest.raises(TypeError, match="solution or an answer"):
        rewards_of(math_answer, completions)


def test_formats():
    completions = ["Reasoning.\n#### 72\n", "#### 72 apples", "#### -1,000.5", "Answer: 72",
                   "<think>\nThis is my reasoning.\n</think>\nThis is my answer.", "<think>\nno end",
                   "<think>a</think><think>b</think>", "Answer first <think>b</think>"]
    assert rewards_of(final_answer_format, completions) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    trl = think_format_reward([[{"content": text}] for text in completions])
    assert rewards_of(think_format, completions) == trl
    assert trl[4:] == [1.0, 0.0, 0.0, 0.0]


def test_qa_match_is_search_r1s_sub_exact_match():
    completions = ["The capital of Fobia is Trazun.", "Trazunia is the capital.", "It is THE bear!", "12 + 2 = 14.",
                   "A red flag", "Trazun"]
    answers = ["Trazun", "Trazun", "the bear", "14", "red", "Fobia Trazun"]
    assert rewards_of(qa_match, completions, answer=answers) == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert normalize_answer("  The Capital, of an Owl!") == "capital of owl"


HEADER = 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def test_code_programs():
    body = "    return a + b\n"
    assert code_program(HEADER, body, TEST, "add") == HEADER + body + "\n" + TEST + "\n" + "check(add)"
    fenced = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert code_program(HEADER, fenced, TEST, "add") == "def add(a, b):\n    return a + b\n\n" + TEST + "\ncheck(add)"
    whole = "def add(a, b):\n    return a + b\n"
    assert code_program("Write add(a, b).", whole, TEST, "add") == whole + "\n" + TEST + "\ncheck(add)"
    completions = [body, "    return a - b\n", fenced, "```python\ndef add(a, b):\n    return a * b\n```"]
    assert code([HEADER] * 4, completions, [[1]] * 4, test=[TEST] * 4, entry_point=["add"] * 4) == [1.0, 0.0, 1.0, 0.0]


def test_weighted():
    matrix = np.array([[1.0, 0.0], [np.nan, 1.0], [np.nan, np.nan], [1.0, 1.0]])
    np.testing.assert_array_equal(weighted(matrix, [1.0, 0.5]), [1.0, 0.5, np.nan, 1.5])


@pytest.fixture(scope="module")
def judge_module(tmp_path_factory) -> str:
    """A user's reward module in a directory put on ``sys.path``: its name."""
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "rl_judge.py").write_text(textwrap.dedent(JUDGE), encoding="utf-8")
    sys.path.insert(0, str(folder))
    yield "rl_judge"
    sys.path.remove(str(folder))
    sys.modules.pop("rl_judge", None)


def test_loading(judge_module):
    assert load_reward("gsm8k_strict") is gsm8k_strict
    assert load_reward(f"{judge_module}:judge").__name__ == "judge"
    names = ", ".join(BUILTINS)
    assert names == "gsm8k_strict, gsm8k_flexible, math_verify, code, format, think_format, qa_match"
    wanted = ["gsm8k_flexible", "mypkg.mod:fn", "foo", f"{judge_module}:missing", f"{judge_module}:not_a_function",
              f"{judge_module}:judge", ":fn"]
    assert reward_problems([RewardConfig(function=function) for function in wanted]) == [
        "reward mypkg.mod:fn: cannot import mypkg.mod (ModuleNotFoundError: No module named 'mypkg')",
        f"reward foo: not a built-in reward ({names}) nor module:function",
        f"reward {judge_module}:missing: {judge_module} has no function missing",
        f"reward {judge_module}:not_a_function: {judge_module}.not_a_function is not callable but int",
        f"reward :fn: not a built-in reward ({names}) nor module:function",
    ]
    with pytest.raises(ValueError, match="weight"):
        RewardConfig(function="code", weight=float("inf"))


@pytest.fixture(scope="module")
def scorer(judge_module):
    rewards = [RewardConfig(function="gsm8k_strict"), RewardConfig(function=f"{judge_module}:judge", weight=0.5)]
    with RewardScorer(rewards, timeout_s=1.0) as scorer:
        yield scorer


def score(scorer: RewardScorer, behaviours: list[str]) -> np.ndarray:
    count = len(behaviours)
    columns = [{"answer": "#### 5", "behaviour": behaviour, "extra": 7} for behaviour in behaviours]
    return scorer.score(["Q?"] * count, ["#### 5", "#### 6"] * (count // 2) + ["#### 5"] * (count % 2),
                        [[1] * (i + 1) for i in range(count)], columns, [f"data/rl.jsonl row {12 + i}" for i in range(count)])


def test_scorer(scorer):
    matrix = score(scorer, ["ids", "prompt", "none", "ids", "ids"])
    np.testing.assert_array_equal(matrix, [[1.0, 1.0], [0.0, 1.0], [1.0, np.nan], [0.0, 4.0], [1.0, 5.0]])
    assert matrix.dtype == np.float64
    np.testing.assert_array_equal(weighted(matrix, scorer.weights), [1.5, 0.5, 1.0, 2.0, 3.5])
    assert scorer.score([], [], [], [], []).shape == (0, 2)


@pytest.mark.parametrize(("behaviour", "message"), [
    ("raise", "ValueError: judge refused"),
    ("nan", "returned nan"),
    ("two", r"returned \[1.0, 2.0\], not a list of one number or None"),
    ("text", r"returned \['1'\], not a list of one number or None"),
    ("sleep", "no result within 1.0 s"),
    ("exit", r"the worker process ended \(exit code 3\)"),
])
def test_a_failing_reward_names_function_and_row(scorer, behaviour, message):
    with pytest.raises(RewardError, match=rf"^reward rl_judge:judge on data/rl.jsonl row 13 \(completion 1\): {message}$"):
        score(scorer, ["ids", behaviour, "ids"])
    started = time.monotonic()
    np.testing.assert_array_equal(score(scorer, ["ids"]), [[1.0, 1.0]])  # new workers: none hung or busy
    assert time.monotonic() - started < 1.0


def test_a_reward_the_workers_cannot_load():
    with (RewardScorer([RewardConfig(function="nowhere_at_all:f")], workers=1) as scorer,
          pytest.raises(RewardError, match=r"^reward nowhere_at_all:f: cannot import nowhere_at_all \(Module")):
        scorer.score(["Q?"], ["#### 5"], [[1]], [{}], ["data/rl.jsonl row 0"])
