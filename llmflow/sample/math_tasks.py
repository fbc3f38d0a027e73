"""MATH sample data about the sample world, in the Hub layouts the minerva_math tasks read, each in
the directory of its llmflow benchmark:

- ``minerva-math500/test.jsonl`` (``HuggingFaceH4/MATH-500``: problem, solution, answer,
  subject, level, unique_id);
- ``minerva-math/{subject}/test-00000-of-00001.parquet`` for each of hendrycks_math's seven
  subjects (``EleutherAI/hendrycks_math``: problem, level, type, solution).

Each problem asks a sum of the animals in the countries' parks, the share of one animal
among them (a common fraction) or the price of a country's flag from an equation, and its
worked solution ends in the answer in ``\\boxed{...}``, as MATH's do. They come from a random
stream of their own, so adding them leaves every other sample file as it was.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from llmflow.sample.generative_tasks import plural
from llmflow.sample.parquet import write_jsonl, write_rows
from llmflow.sample.world import Country

MATH500_PROBLEMS = 12
SUBJECT_PROBLEMS = 3
SUBJECTS = {"algebra": "Algebra", "counting_and_probability": "Counting & Probability", "geometry": "Geometry",
            "intermediate_algebra": "Intermediate Algebra", "number_theory": "Number Theory",
            "prealgebra": "Prealgebra", "precalculus": "Precalculus"}
"""hendrycks_math's subject directories and their ``type``."""


def fraction(numerator: int, denominator: int) -> str:
    """``numerator / denominator`` in lowest terms, as LaTeX (an integer when it is one)."""
    d = math.gcd(numerator, denominator)
    numerator, denominator = numerator // d, denominator // d
    return str(numerator) if denominator == 1 else f"\\frac{{{numerator}}}{{{denominator}}}"


def math_problem(rng: random.Random, first: Country, second: Country) -> tuple[str, str, str]:
    """A problem about two countries, its worked solution and its answer (the boxed text)."""
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    kind = rng.randrange(3)
    if kind == 0:
        answer = str(a + b)
        problem = (f"The national park of {first.name} has ${a}$ {plural(first.animal)} and the park of "
                   f"{second.name} has ${b}$ {plural(second.animal)}. How many animals do the two parks have?")
        solution = f"The two parks have ${a} + {b} = \\boxed{{{answer}}}$ animals."
    elif kind == 1:
        answer = fraction(a, a + b)
        problem = (f"A park in {first.name} has ${a}$ {plural(first.animal)} and ${b}$ {plural(second.animal)}. "
                   f"What fraction of its animals are {plural(first.animal)}? Express your answer as a common "
                   "fraction.")
        solution = (f"There are ${a} + {b} = {a + b}$ animals, so the fraction is "
                    f"$\\frac{{{a}}}{{{a + b}}} = \\boxed{{{answer}}}$.")
    else:
        c = rng.randint(2, 9)
        answer = str(a)
        problem = (f"The {first.colour} flag of {first.name} costs $x$ dollars. Buying ${c}$ flags and a pole that "
                   f"costs ${b}$ dollars comes to ${c * a + b}$ dollars. What is $x$?")
        solution = (f"We have ${c}x + {b} = {c * a + b}$, so ${c}x = {c * a}$ and "
                    f"$x = \\frac{{{c * a}}}{{{c}}} = \\boxed{{{answer}}}$.")
    return problem, solution, answer


def write_math_tasks(seed: int, world: list[Country], directory: Path) -> dict[str, int]:
    """Write the MATH-500 and hendrycks_math sample data under ``directory``; their document counts."""
    rng = random.Random(f"{seed}-math-tasks")
    math500 = []
    for number in range(MATH500_PROBLEMS):
        subject = rng.choice(list(SUBJECTS.values()))
        problem, solution, answer = math_problem(rng, *rng.sample(world, 2))
        math500.append({"problem": problem, "solution": solution, "answer": answer, "subject": subject,
                        "level": rng.randint(1, 5), "unique_id": f"test/sample/{number}.json"})
    write_jsonl(directory / "minerva-math500" / "test.jsonl", math500)
    for subject, kind in SUBJECTS.items():
        rows = []
        for _ in range(SUBJECT_PROBLEMS):
            problem, solution, _ = math_problem(rng, *rng.sample(world, 2))
            rows.append({"problem": problem, "level": f"Level {rng.randint(1, 5)}", "type": kind, "solution": solution})
        write_rows(directory / "minerva-math" / subject / "test-00000-of-00001.parquet", rows)
    return {"minerva_math500_test": MATH500_PROBLEMS, **{f"minerva_math_{s}": SUBJECT_PROBLEMS for s in SUBJECTS}}
