"""Evaluation progress: the engines report (done, total) from the start to the end of their
forward passes and generations, and ``llmflow eval`` shows it on stderr, a tqdm bar on a
terminal and a line each 10% elsewhere (the Prefect task's progress artifact: tests/test_tasks.py)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from llmflow.cli import main
from llmflow.evaluate.benchmarks import MMLU
from llmflow.evaluate.engine import EvalConfig, evaluate
from llmflow.evaluate.generative_engine import GenerativeEvalConfig, evaluate_generative
from llmflow.evaluate.generative_tasks import GSM8K
from llmflow.progress import TerminalProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def sample(sample_assets) -> Path:
    return sample_assets()


def assert_runs_from_start_to_end(calls: list[tuple[int, int]], total: int) -> None:
    assert calls[0] == (0, total) and calls[-1] == (total, total) and len(calls) > 2
    assert all(t == total for _, t in calls) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_a_log_gets_a_line_at_the_start_and_each_tenth():
    stream = io.StringIO()
    progress = TerminalProgress("eval mmlu", "questions", stream)
    for done in range(41):
        progress(done, 40)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines == [f"eval mmlu: {p}% ({p * 40 // 100}/40 questions)" for p in range(0, 101, 10)]


def test_a_detail_follows_the_count():
    stream = io.StringIO()
    progress = TerminalProgress("eval gsm8k", "texts", stream)
    progress(0, 4)
    progress(4, 4, "31.2 tokens/s")
    assert stream.getvalue().splitlines() == ["eval gsm8k: 0% (0/4 texts)", "eval gsm8k: 100% (4/4 texts, 31.2 tokens/s)"]
    bar = Terminal()
    progress = TerminalProgress("eval gsm8k", "texts", bar)
    progress(4, 4, "31.2 tokens/s")
    progress.close()
    assert "31.2 tokens/s" in bar.getvalue()


def test_a_terminal_gets_a_bar():
    stream = Terminal()
    progress = TerminalProgress("eval mmlu", "questions", stream)
    for done in range(41):
        progress(done, 40)
    progress.close()
    shown = stream.getvalue()
    assert "eval mmlu: 100%" in shown and "40/40" in shown and "questions" in shown and "\r" in shown


def test_scoring_reports_each_batch_and_the_command_line_shows_it(sample, tmp_path, capsys):
    calls: list[tuple[int, int]] = []
    config = EvalConfig(model=sample / "model", data=sample / "mmlu" / "hf", out=tmp_path / "a", shots=1, limit=2,
                        batch_size=1)
    evaluate(MMLU, config, lambda done, total: calls.append((done, total)))
    assert_runs_from_start_to_end(calls, 6)
    main(["eval", "mmlu", "--model", str(sample / "model"), "--data", str(sample / "mmlu" / "hf"), "--shots", "1",
          "--limit", "2", "--batch-size", "1", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "eval mmlu: 0% (0/6 questions)" and err[-1] == "eval mmlu: 100% (6/6 questions)"


def test_generation_reports_each_batch(sample, tmp_path):
    calls: list[tuple[int, int]] = []
    details: list[str] = []
    config = GenerativeEvalConfig(model=sample / "model", data=sample / "gsm8k", out=tmp_path / "out", limit=3,
                                  batch_size=1, max_new_tokens=2, shots=0)

    def progress(done: int, total: int, detail: str = "") -> None:
        calls.append((done, total))
        details.append(detail)

    evaluate_generative(GSM8K, config, progress)
    assert_runs_from_start_to_end(calls, 3)
    # After the first call (nothing generated yet), the tokens generated per second so far.
    assert details[0] == "" and all(re.fullmatch(r"\d+\.\d tokens/s", d) for d in details[1:])
