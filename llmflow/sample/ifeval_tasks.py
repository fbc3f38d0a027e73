"""IFEval sample data about the sample world, in its Hub layout:
``ifeval/ifeval_input_data.jsonl`` (``google/IFEval``: key, prompt, instruction_id_list,
kwargs). Each prompt asks for a text about one country and adds verifiable instructions
worded as IFEval's; together the prompts give every instruction of lm-evaluation-harness's
registry, none beside one it conflicts with. Every instruction's kwargs name all of the
dataset's arguments, None where it takes none, as the dataset writes them.

They come from a random stream of their own, so adding them leaves every other sample file
as it was.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmflow.sample.generative_tasks import counted
from llmflow.sample.parquet import write_jsonl
from llmflow.sample.world import Country

KWARGS = ("num_highlights", "relation", "num_words", "num_placeholders", "prompt_to_repeat", "num_bullets",
          "section_spliter", "num_sections", "capital_relation", "capital_frequency", "keywords", "num_paragraphs",
          "language", "let_relation", "letter", "let_frequency", "end_phrase", "forbidden_words", "keyword",
          "frequency", "num_sentences", "postscript_marker", "first_word", "nth_paragraph")
"""The arguments every instruction of google/IFEval lists, in its order."""
LANGUAGES = {"fr": "French", "de": "German", "it": "Italian"}

Instruction = tuple[str, str, dict[str, Any]]
"""An instruction's id, its wording in the prompt and its arguments."""
Maker = Callable[[random.Random, Country, str], Instruction]
"""An instruction for a request about a country."""


def _no_comma(rng: random.Random, country: Country, request: str) -> Instruction:
    return "punctuation:no_comma", "In your entire response, refrain from the use of any commas.", {}


def _number_words(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randrange(40, 90, 10)
    return ("length_constraints:number_words", f"Answer with less than {n} words.",
            {"relation": "less than", "num_words": n})


def _capital_keyword(rng: random.Random, country: Country, request: str) -> Instruction:
    return ("keywords:existence", f"Include the keywords {country.capital} and {country.name} in the response.",
            {"keywords": [country.capital, country.name]})


def _animal_keyword(rng: random.Random, country: Country, request: str) -> Instruction:
    return "keywords:existence", f"Include the keyword {country.animal} in the response.", {"keywords": [country.animal]}


def _lowercase(rng: random.Random, country: Country, request: str) -> Instruction:
    return ("change_case:english_lowercase", ("Your entire response should be in English, and in all lowercase "
            "letters. No capital letters are allowed."), {})


def _capitals(rng: random.Random, country: Country, request: str) -> Instruction:
    return "change_case:english_capital", "Your entire response should be in English, and in all capital letters.", {}


def _postscript(rng: random.Random, country: Country, request: str) -> Instruction:
    marker = rng.choice(("P.S.", "P.P.S"))
    return ("detectable_content:postscript", (f"At the end of your response, please explicitly add a postscript "
            f"starting with {marker}"), {"postscript_marker": marker})


def _end_phrase(rng: random.Random, country: Country, request: str) -> Instruction:
    phrase = rng.choice(("Any other questions?", "Is there anything else I can help with?"))
    return ("startend:end_checker", (f"Finish your response with this exact phrase {phrase} No other words should "
            "follow this phrase."), {"end_phrase": phrase})


def _highlights(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randint(2, 4)
    return ("detectable_format:number_highlighted_sections", (f"Highlight at least {n} sections in your answer with "
            "markdown, i.e. *highlighted section*."), {"num_highlights": n})


def _sentences(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randint(3, 6)
    return ("length_constraints:number_sentences", f"Your response should contain at least {n} sentences.",
            {"relation": "at least", "num_sentences": n})


def _bullets(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randint(2, 5)
    return ("detectable_format:number_bullet_lists", (f"Your answer must contain exactly {n} bullet points. Use the "
            "markdown bullet points such as:\n* This is point 1.\n* This is point 2."), {"num_bullets": n})


def _title(rng: random.Random, country: Country, request: str) -> Instruction:
    return ("detectable_format:title", ("Your answer must contain a title, wrapped in double angular brackets, such "
            f"as <<the {country.colour} flag>>."), {})


def _language(rng: random.Random, country: Country, request: str) -> Instruction:
    code = rng.choice(sorted(LANGUAGES))
    return ("language:response_language", (f"Your ENTIRE response should be in {LANGUAGES[code]} language, no other "
            "language is allowed."), {"language": code})


def _keyword_frequency(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randint(2, 4)
    return ("keywords:frequency", f"In your response, the word {country.animal} should appear at least {n} times.",
            {"relation": "at least", "keyword": country.animal, "frequency": n})


def _quotation(rng: random.Random, country: Country, request: str) -> Instruction:
    return "startend:quotation", "Wrap your entire response with double quotation marks.", {}


def _letter_frequency(rng: random.Random, country: Country, request: str) -> Instruction:
    letter, n = rng.choice("aeiou"), rng.randint(5, 12)
    return ("keywords:letter_frequency", f"In your response, the letter {letter} should appear less than {n} times.",
            {"let_relation": "less than", "letter": letter, "let_frequency": n})


def _json_format(rng: random.Random, country: Country, request: str) -> Instruction:
    return ("detectable_format:json_format", ("Entire output should be wrapped in JSON format. You can use markdown "
            "ticks such as ```."), {})


def _paragraphs(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randint(2, 4)
    return ("length_constraints:number_paragraphs", (f"There should be {n} paragraphs. Paragraphs are separated with "
            "the markdown divider: ***"), {"num_paragraphs": n})


def _capital_words(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randint(2, 5)
    return ("change_case:capital_word_frequency", (f"In your response, words with all capital letters should appear "
            f"at least {n} times."), {"capital_relation": "at least", "capital_frequency": n})


def _sections(rng: random.Random, country: Country, request: str) -> Instruction:
    splitter, n = rng.choice(("Section", "SECTION")), rng.randint(2, 3)
    return ("detectable_format:multiple_sections", (f"Your response must have {n} sections. Mark the beginning of each "
            f"section with {splitter} X, such as:\n{splitter} 1\n[content of section 1]\n{splitter} 2\n"
            "[content of section 2]"), {"section_spliter": splitter, "num_sections": n})


def _first_word(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randint(2, 3)
    nth = rng.randint(1, n)
    word = country.animal
    return ("length_constraints:nth_paragraph_first_word", (f"There should be {n} paragraphs. Paragraphs and only "
            "paragraphs are separated with each other by two new lines as if it was '\\n\\n' in python. Paragraph "
            f"{nth} must start with word {word}."), {"num_paragraphs": n, "nth_paragraph": nth, "first_word": word})


def _placeholders(rng: random.Random, country: Country, request: str) -> Instruction:
    n = rng.randint(1, 3)
    return ("detectable_content:number_placeholders", (f"The response must contain at least {n} placeholders "
            "represented by square brackets, such as [address]."), {"num_placeholders": n})


def _two_responses(rng: random.Random, country: Country, request: str) -> Instruction:
    return ("combination:two_responses", ("Give two different responses. Responses and only responses should be "
            "separated by 6 asterisk symbols: ******."), {})


def _forbidden_words(rng: random.Random, country: Country, request: str) -> Instruction:
    return ("keywords:forbidden_words", f"Do not include keywords {country.colour} in the response.",
            {"forbidden_words": [country.colour]})


def _repeat_request(rng: random.Random, country: Country, request: str) -> Instruction:
    return ("combination:repeat_prompt", ("First repeat the request word for word without change, then give your "
            "answer (1. do not say any words or characters before repeating the request; 2. the request you need to "
            "repeat does not include this sentence)"), {"prompt_to_repeat": request})


def _constrained(rng: random.Random, country: Country, request: str) -> Instruction:
    return ("detectable_format:constrained_response", ("Answer with one of the following options: ('My answer is "
            "yes.', 'My answer is no.', 'My answer is maybe.')"), {})


TOPICS: tuple[Callable[[Country], str], ...] = (
    lambda c: f"Write a short note for travellers about {c.capital}, the capital of {c.name}.",
    lambda c: f"Describe the {c.animal}, the national animal of {c.name}, for a children's book.",
    lambda c: f"Write a speech praising the {c.colour} flag of {c.name}.",
    lambda c: f"Write a poem about {counted(c.animal, 1)} that lives near {c.capital}.",
    lambda c: f"Write a blog post about a week in {c.name}.",
)
PROMPTS: tuple[tuple[Maker, ...], ...] = (
    (_no_comma, _number_words, _capital_keyword),
    (_lowercase, _postscript),
    (_capitals, _end_phrase),
    (_highlights, _sentences),
    (_bullets, _title, _language),
    (_keyword_frequency, _quotation),
    (_letter_frequency, _no_comma),
    (_json_format, _animal_keyword),
    (_paragraphs, _capital_words, _sections),
    (_first_word, _placeholders),
    (_two_responses, _forbidden_words),
    (_repeat_request, _title),
    (_constrained,),
)
"""Each prompt's instructions (the last one, which conflicts with every other, alone)."""


def ifeval_row(rng: random.Random, key: int, country: Country, makers: tuple[Maker, ...]) -> dict[str, Any]:
    """A request about ``country`` followed by the instructions of ``makers``."""
    request = rng.choice(TOPICS)(country)
    instructions = [make(rng, country, request) for make in makers]
    return {"key": key, "prompt": " ".join([request, *(text for _, text, _ in instructions)]),
            "instruction_id_list": [i for i, _, _ in instructions],
            "kwargs": [{name: arguments.get(name) for name in KWARGS} for _, _, arguments in instructions]}


def write_ifeval(seed: int, world: list[Country], directory: Path) -> dict[str, int]:
    """Write the IFEval sample prompts under ``directory``; their count."""
    rng = random.Random(f"{seed}-ifeval")
    rows = [ifeval_row(rng, 1000 + n, rng.choice(world), makers) for n, makers in enumerate(PROMPTS)]
    write_jsonl(directory / "ifeval" / "ifeval_input_data.jsonl", rows)
    return {"ifeval_train": len(rows)}
