"""MATH with the Minerva prompt, as lm-evaluation-harness 0.4.13 defines its tasks (version 3.1):

- ``minerva_math500``: the 500 problems of ``HuggingFaceH4/MATH-500`` (``test.jsonl``);
- the ``minerva_math`` group: ``minerva_math_algebra``, ``_counting_and_prob``, ``_geometry``,
  ``_intermediate_algebra``, ``_num_theory``, ``_prealgebra`` and ``_precalc``, the test
  problems of each subject of ``EleutherAI/hendrycks_math`` (``{subject}/test-*.parquet``),
  its group score the size-weighted mean of each metric (benchmarks/minerva_math.yaml).

Each task (minerva_math/utils.py and its yamls): "Problem:\\n{problem}\\n\\nSolution:", after
the 4 fixed Minerva exemplars each followed by " " and its worked solution (which ends in
"Final Answer: The final answer is $...$. I hope it is correct.") and "\\n\\n"; greedy
generation until "Problem:" (and the tokenizer's eos; 256 tokens at most, the hf backend's
default, as the yamls set none). The gold (process_docs) is the content of the solution's last
``\\boxed`` normalised as Minerva's appendix D does (``normalize_final_answer``); a MATH-500
row's own ``answer`` is replaced by it, as the harness replaces it. Two metrics
(process_results), means with the harness's standard errors:

- ``exact_match``: the answer after "Final Answer: The final answer is" (up to ". I hope it
  is correct.", which is appended to the text first; "[invalidanswer]" without it),
  normalised, equal to the gold or equal to it by sympy (``parse_latex`` of both, their
  difference simplified to 0, in 5 seconds at most): the headline;
- ``math_verify``: math-verify's ``verify`` of the parsed solution against the parsed
  generated text, each parsed with math-verify's default extraction.

The functions below are the harness's (utils.py) ported line for line; tests/test_minerva_math.py
holds them equal to it. sympy's LaTeX parser takes only version 4.11 of the antlr4 runtime
(lm-eval's ``math`` extra pins it; math-verify works with it too); the readers check that it
works, so a missing one is refused before the model loads. Both metrics time their comparisons
out with SIGALRM, which only the main thread can use: elsewhere they run without a time limit
(there the harness would score 0 every pair of answers that differ as text, and math-verify
would fail).

llmflow names them ``minerva-math500`` and ``minerva-math`` (``llmflow eval minerva-math500``, stage
``eval-minerva-math500``: command names are kebab-case, Prefect's artifact keys take no "_").

A solution without a ``\\boxed{...}`` answer (where the harness's process_docs fails) is refused
naming its file and row.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmflow.evaluate.generative_tasks import Doc, GenerativeGroup, GenerativeTask, Scored
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.task_files import excerpt, read_split

VERSION = "3.1"
"""The harness's version of every minerva_math task."""
FIELDS = ("problem", "solution")
"""What the harness reads of a row."""
MATH500_EXPECTED = "HuggingFaceH4/MATH-500 (test.jsonl with fields problem, solution)"
HENDRYCKS_EXPECTED = "EleutherAI/hendrycks_math ({subject}/test-*.parquet with columns problem, solution)"
SUBJECTS = {"algebra": "algebra", "counting_and_prob": "counting_and_probability", "geometry": "geometry",
            "intermediate_algebra": "intermediate_algebra", "num_theory": "number_theory",
            "prealgebra": "prealgebra", "precalc": "precalculus"}
"""Each minerva_math task's name suffix -> its hendrycks_math subject (dataset_name and directory)."""
UNTIL = ("Problem:",)
MAX_GEN_TOKS = 256
"""The hf backend's default max_gen_toks (the yamls set none)."""
TARGET_DELIMITER = " "
"""The harness's default target delimiter (the yamls set none)."""
ANTLR = "antlr4-python3-runtime==4.11.0"

FEWSHOT_SAMPLES: list[dict[str, str]] = [
    {
        "problem": "Find the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.",
        "solution": "The expressions inside each square root must be non-negative. Therefore, $x-2 \\ge 0$, so $x\\ge2$, and $5 - x \\ge 0$, so $x \\le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives $x<5$. Therefore, the domain of the expression is $\\boxed{[2,5)}$.\nFinal Answer: The final answer is $[2,5)$. I hope it is correct."
    },
    {
        "problem": "If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find $\\det (\\mathbf{A} \\mathbf{B}).$",
        "solution": "We have that $\\det (\\mathbf{A} \\mathbf{B}) = (\\det \\mathbf{A})(\\det \\mathbf{B}) = (2)(12) = \\boxed{24}.$\nFinal Answer: The final answer is $24$. I hope it is correct."
    },
    {
        "problem": "Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many times must Terrell lift them in order to lift the same total weight?",
        "solution": "If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ pounds of weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total of $2\\cdot15\\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for $n$:\n\\begin{align*}\n30n&=480\\\\\n\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}\nFinal Answer: The final answer is $16$. I hope it is correct."
    },
    {
        "problem": "If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\\\n6y-9x &=b.\n\\end{align*}has a solution $(x, y)$ where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is nonzero.",
        "solution": "If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$Since we also know that $6y-9x=b$, we have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$\nFinal Answer: The final answer is $-\\frac{2}{3}$. I hope it is correct."
    }
]
"""utils.list_fewshot_samples: the Minerva exemplars (problem, solution; the harness's also have
few_shot "1", which makes their doc_to_target the solution)."""


# --- the harness's answer extraction, normalisation and equivalence (utils.py) ------------------


def doc_to_text(problem: str) -> str:
    """utils.doc_to_text."""
    return "Problem:" + "\n" + problem + "\n\n" + "Solution:"


def last_boxed_only_string(string: str) -> str | None:
    """utils.last_boxed_only_string: the last ``\\boxed{...}`` (braces balanced) or ``\\fbox{...}``
    of ``string``; everything after its first "\\boxed " up to a "$" where it has one."""
    idx = string.rfind("\\boxed")
    if "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    i = idx
    right_brace_idx = None
    num_left_braces_open = 0
    while i < len(string):
        if string[i] == "{":
            num_left_braces_open += 1
        if string[i] == "}":
            num_left_braces_open -= 1
            if num_left_braces_open == 0:
                right_brace_idx = i
                break
        i += 1
    return None if right_brace_idx is None else string[idx : right_brace_idx + 1]


def remove_boxed(s: str) -> str:
    """utils.remove_boxed: the box's content; a ValueError where the harness's assertions fail
    (an ``\\fbox``, a ``\\boxed`` not followed by a brace)."""
    if "\\boxed " in s:
        left = "\\boxed "
        if not s.startswith(left):
            raise ValueError(f"{s[:40]!r} does not start with {left!r}")
        return s[len(left) :]
    left = "\\boxed{"
    if not s.startswith(left) or not s.endswith("}"):
        raise ValueError(f"{s[:40]!r} is not {left}...}}")
    return s[len(left) : -1]


def get_unnormalized_answer(text: str) -> str:
    """utils.get_unnormalized_answer: what follows "Final Answer: The final answer is" up to
    the character before ". I hope it is correct." (appended to ``text`` first), stripped."""
    text += "I hope it is correct."
    match = re.search(r"Final Answer: The final answer is(.*?). I hope it is correct.", text)
    return match.group(1).strip() if match else "[invalidanswer]"


SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]
REMOVED_EXPRESSIONS = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "ft",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
]


def normalize_final_answer(final_answer: str) -> str:
    """utils.normalize_final_answer (appendix D of Lewkowycz et al. 2022, with the harness's
    3.1 fixes): the text after the last "=", less units and LaTeX decoration, shorthand
    fractions and roots braced, thousands separators removed."""
    final_answer = final_answer.split("=")[-1]
    for expr in REMOVED_EXPRESSIONS:
        if expr.isalpha():
            final_answer = re.sub(rf"(?<!\\)\b{expr}\b", "", final_answer)
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        if expr.isalpha():
            segments = re.split(r"(\\[a-zA-Z]+)", final_answer)
            for i in range(0, len(segments), 2):
                segments[i] = segments[i].replace(expr, "")
            final_answer = "".join(segments)
        else:
            final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)(\[[^\]]*\])(\w)", "\\1\\2{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)(?!\[)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", final_answer):
        final_answer = final_answer.replace(",", "")
    return final_answer


def in_main_thread() -> bool:
    """Whether SIGALRM timeouts (the harness's and math-verify's) can be set here."""
    return threading.current_thread() is threading.main_thread()


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """utils.timeout: a TimeoutError once ``seconds`` have passed (SIGALRM), in the main
    thread; no limit elsewhere."""
    if not in_main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError("Timeout")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@functools.cache
def latex_parser() -> Any:
    """sympy's ``parse_latex``, once it has parsed a number (it takes antlr4's runtime 4.11
    only); an ImportError naming the runtime to install otherwise."""
    from sympy.parsing.latex import parse_latex

    try:
        parse_latex("1")
    except ImportError as e:
        raise ImportError(f"minerva_math's exact_match compares answers with sympy's LaTeX parser, which takes "
                          f"antlr4's Python runtime 4.11 only (lm-eval's math extra pins it): pip install '{ANTLR}'"
                          ) from e
    return parse_latex


def is_equiv(x1: str, x2: str) -> bool:
    """utils.is_equiv of two normalised answers: equal, or sympy's ``parse_latex`` of each
    differs by what simplifies to 0 (in 5 seconds at most); False where either does not
    parse, they cannot be subtracted or the comparison fails."""
    import sympy

    if x1 and x1 == x2:
        return True
    parse_latex = latex_parser()
    try:
        with time_limit(5):
            try:
                parsed_x1 = parse_latex(x1)
                parsed_x2 = parse_latex(x2)
            except (sympy.parsing.latex.errors.LaTeXParsingError, sympy.SympifyError, TypeError):
                return False
            try:
                diff = parsed_x1 - parsed_x2
            except TypeError:
                return False
            try:
                return sympy.simplify(diff) == 0
            except ValueError:
                return False
    except TimeoutError:
        return False
    except ImportError:
        raise
    except Exception:  # noqa: BLE001 (the harness's: any other failure is a mismatch)
        return False


def math_verified(solution: str, text: str) -> bool:
    """The harness's math_verify: math-verify's ``verify`` of the parsed solution (the gold)
    against the parsed generated text, its default extraction and timeouts (none outside the
    main thread, where math-verify's SIGALRM ones would fail)."""
    from math_verify import parse, verify

    limit = 5 if in_main_thread() else None  # parse's and verify's default timeouts
    return bool(verify(gold=parse(solution, parsing_timeout=limit), target=parse(text, parsing_timeout=limit),
                       timeout_seconds=limit))


# --- documents, scoring, tasks ----------------------------------------------------------------


@dataclass(frozen=True)
class MathProblem(Doc):
    """One problem: its prompt is the text, the normalised answer of its solution the target
    (the harness's doc_to_target)."""

    solution: str
    """The worked solution (math_verify's gold)."""


def math_problem(row: dict[str, Any], where: str) -> MathProblem:
    """A problem from one row, its gold taken from its solution as process_docs takes it."""
    bad = [name for name in FIELDS if not isinstance(row.get(name), str)]
    if bad:
        raise BenchmarkDataError(f"{where}: expected {' and '.join(bad)} as text, got {excerpt(row)}")
    problem, solution = row["problem"], row["solution"]
    boxed = last_boxed_only_string(solution)
    try:
        if boxed is None:
            raise ValueError("it has none")
        answer = remove_boxed(boxed)
    except ValueError as e:
        raise BenchmarkDataError(f"{where}: expected the solution's answer in \\boxed{{...}} ({e}), got "
                                 f"{excerpt(row)}") from None
    return MathProblem(text=doc_to_text(problem), target=normalize_final_answer(answer), solution=solution)


def read_math500(root: Path) -> list[Doc]:
    """The MATH-500 problems of ``root``'s test.jsonl."""
    latex_parser()
    return read_split("MATH-500", root, "test", (("{split}.jsonl",),), FIELDS, MATH500_EXPECTED, math_problem)


def read_hendrycks_math(directory: Path) -> list[Doc]:
    """The test problems of one hendrycks_math subject, from its directory."""
    latex_parser()
    return read_split("MATH", directory, "test", (("{split}-*.parquet",),), FIELDS, HENDRYCKS_EXPECTED,
                      math_problem)


@dataclass(frozen=True)
class MinervaMathScore:
    """process_results of the first generated text: its answer (unnormalised and normalised),
    the gold, and both metrics."""

    metric: str = "exact_match"

    def __call__(self, docs: Sequence[Doc], samples: list[list[str]], workers: int) -> list[Scored]:
        problems = [doc for doc in docs if isinstance(doc, MathProblem)]
        if len(problems) != len(docs) or len(samples) != len(docs):
            raise TypeError("minerva_math scores MATH problems, a generated text each")
        scored = []
        for problem, texts in zip(problems, samples):
            unnormalized = get_unnormalized_answer(texts[0])
            answer = normalize_final_answer(unnormalized)
            values = {"exact_match": is_equiv(answer, problem.target),
                      "math_verify": math_verified(problem.solution, texts[0])}
            scored.append(Scored({"unnormalized_answer": unnormalized, "answer": answer, "gold": problem.target,
                                  **values}, {name: float(value) for name, value in values.items()}))
        return scored


EXEMPLARS = tuple(Doc(doc_to_text(s["problem"]), s["solution"]) for s in FEWSHOT_SAMPLES)


def minerva_task(name: str, subdir: str, hub_include: tuple[str, ...], read: Callable[[Path], list[Doc]]
                 ) -> GenerativeTask:
    """A minerva_math task on the data of ``subdir``."""
    return GenerativeTask(name=name, version=VERSION, description="", exemplars=EXEMPLARS,
                          target_delimiter=TARGET_DELIMITER, until=UNTIL, max_gen_toks=MAX_GEN_TOKS, subdir=subdir,
                          hub_include=hub_include, read=read, scorer=MinervaMathScore())


MINERVA_MATH500_TASK = minerva_task("minerva_math500", "", ("test.jsonl",), read_math500)
MINERVA_MATH500 = GenerativeGroup(name="minerva-math500", title="MATH-500 (Minerva prompt)",
                                  harness_name="minerva_math500", tasks=(MINERVA_MATH500_TASK,),
                                  headline_filter="none")
MINERVA_MATH = GenerativeGroup(
    name="minerva-math", title="MATH (Minerva prompt)", harness_name="minerva_math",
    tasks=tuple(minerva_task(f"minerva_math_{name}", subject, (f"{subject}/test-*",), read_hendrycks_math)
                for name, subject in SUBJECTS.items()),
    headline_filter="none",
)
