"""GSM8K, BBH and HumanEval sample data about the sample world, in their Hub layouts:

- ``gsm8k/main/test-00000-of-00001.parquet`` (``openai/gsm8k``'s main config: question,
  answer): word problems about the countries' animals, capitals and flags, each answer a
  worked solution ending in "#### N" as GSM8K's do;
- ``bbh/boolean_expressions/`` and ``bbh/object_counting/``, each
  ``test-00000-of-00001.parquet`` (``SaylorTwift/bbh``: input, target): Boolean expressions
  worded as BBH's, and counts of the world's animals;
- ``humaneval/openai_humaneval/test-00000-of-00001.parquet`` (``openai/openai_humaneval``:
  task_id, prompt, canonical_solution, test, entry_point): a function per country that
  returns its capital, written and tested as HumanEval's problems are.

They come from a random stream of their own, so adding them leaves every other sample
file as it was.
"""

from __future__ import annotations

import random
from pathlib import Path

from llmflow.sample.parquet import write_rows
from llmflow.sample.world import Country

GSM8K_QUESTIONS = 12
BBH_QUESTIONS = 12
BBH_SUBTASKS = ("boolean_expressions", "object_counting")
HUMANEVAL_PROBLEMS = 4
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five")
_PLURALS = {"fox": "foxes", "wolf": "wolves", "deer": "deer"}


def plural(animal: str) -> str:
    """The animal's name in the plural."""
    return _PLURALS.get(animal, animal + "s")


def counted(animal: str, n: int) -> str:
    """"a fox", "an owl", "two foxes"."""
    if n > 1:
        return f"{_NUMBER_WORDS[n]} {plural(animal)}"
    return f"an {animal}" if animal[0] in "aeiou" else f"a {animal}"


def gsm8k_row(rng: random.Random, country: Country) -> dict[str, str]:
    """A two-step word problem about ``country`` with its worked answer."""
    a, b, c = rng.randint(2, 30), rng.randint(2, 9), rng.randint(2, 6)
    kind = rng.randrange(3)
    if kind == 0:
        total = a + b * c
        animals = plural(country.animal)
        question = (f"The national park of {country.name} has {a} {animals}. Every year {b} more {animals} "
                    f"arrive. How many {animals} does the park have after {c} years?")
        steps = (f"In {c} years {b} * {c} = <<{b}*{c}={b * c}>>{b * c} arrive, so there are "
                 f"{a} + {b * c} = <<{a}+{b * c}={total}>>{total}.")
    elif kind == 1:
        total = a * b - c
        question = (f"A bus leaves {country.capital}, the capital of {country.name}, {b} times a day with "
                    f"{a} people each time. On Monday {c} seats stayed empty in all. How many people rode "
                    "the bus on Monday?")
        steps = (f"Full buses carry {a} * {b} = <<{a}*{b}={a * b}>>{a * b} people; "
                 f"{a * b} - {c} = <<{a * b}-{c}={total}>>{total}.")
    else:
        total = (a + c) * b
        question = (f"The flag of {country.name}, {country.colour}, costs ${a} and its pole ${c}. "
                    f"How many dollars do {b} flags with poles cost?")
        steps = (f"One flag with a pole costs {a} + {c} = <<{a}+{c}={a + c}>>{a + c} dollars; "
                 f"{b} cost {a + c} * {b} = <<{a + c}*{b}={total}>>{total}.")
    return {"question": question, "answer": f"{steps}\n#### {total}"}


def boolean_expression(rng: random.Random, depth: int) -> str:
    """A Boolean expression as BBH spells them: words and brackets separated by spaces."""
    if depth == 0:
        return ("not " if rng.random() < 0.3 else "") + rng.choice(("True", "False"))
    left, right = boolean_expression(rng, depth - 1), boolean_expression(rng, 0)
    if rng.random() < 0.5:
        left = f"( {left} )"
    return f"{'not ' if rng.random() < 0.2 else ''}{left} {rng.choice(('and', 'or'))} {right}"


def boolean_row(rng: random.Random) -> dict[str, str]:
    """A Boolean expression and its value."""
    expression = boolean_expression(rng, rng.randint(1, 2))
    # BBH's spelling is Python's: the expression is only True, False, and, or, not and brackets.
    return {"input": f"{expression} is", "target": str(eval(expression))}


def counting_row(rng: random.Random, world: list[Country]) -> dict[str, str]:
    """How many animals of a list (some named with a count) there are."""
    animals = rng.sample(sorted({c.animal for c in world}), 4)
    counts = [rng.randint(1, 3) for _ in animals]
    items = [counted(animal, n) for animal, n in zip(animals, counts)]
    return {"input": f"I have {', '.join(items[:-1])}, and {items[-1]}. How many animals do I have?",
            "target": str(sum(counts))}


def humaneval_row(number: int, country: Country) -> dict[str, str]:
    """A HumanEval-layout problem: complete a function returning ``country``'s capital."""
    name = f"capital_of_{country.name.lower()}"
    prompt = (f'def {name}() -> str:\n    """Return the name of the capital of {country.name}.\n'
              f'    >>> {name}()\n    {country.capital!r}\n    """\n')
    test = (f"\n\nMETADATA = {{}}\n\n\ndef check(candidate):\n    assert candidate() == {country.capital!r}\n"
            f"    assert isinstance(candidate(), str)\n")
    return {"task_id": f"HumanEval/{number}", "prompt": prompt, "canonical_solution": f"    return {country.capital!r}\n",
            "test": test, "entry_point": name}


def write_generative_tasks(seed: int, world: list[Country], directory: Path) -> dict[str, int]:
    """Write the GSM8K and BBH sample data under ``directory``; their document counts."""
    rng = random.Random(f"{seed}-generative-tasks")
    write_rows(directory / "gsm8k" / "main" / "test-00000-of-00001.parquet",
           [gsm8k_row(rng, rng.choice(world)) for _ in range(GSM8K_QUESTIONS)])
    rows = dict(zip(BBH_SUBTASKS, ([boolean_row(rng) for _ in range(BBH_QUESTIONS)],
                                   [counting_row(rng, world) for _ in range(BBH_QUESTIONS)]), strict=True))
    for task, task_rows in rows.items():
        write_rows(directory / "bbh" / task / "test-00000-of-00001.parquet", task_rows)
    problems = [humaneval_row(n, country) for n, country in enumerate(rng.sample(world, HUMANEVAL_PROBLEMS))]
    write_rows(directory / "humaneval" / "openai_humaneval" / "test-00000-of-00001.parquet", problems)
    return {"gsm8k_test": GSM8K_QUESTIONS, **{f"bbh_{task}": len(r) for task, r in rows.items()},
            "humaneval_test": HUMANEVAL_PROBLEMS}
