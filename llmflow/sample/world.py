"""The sample's made-up world: countries with a capital, a national animal and a flag colour,
and the facts about them (plus small sums) that every sample asset states or asks."""

from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = ("geography", "national_symbols", "elementary_arithmetic")
ANIMALS = ("fox", "bear", "owl", "wolf", "deer", "hawk", "seal", "crane")
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s", "m")
_COUNTRY_ENDINGS = ("ia", "land", "ora", "stan", "mark")


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    animal: str
    colour: str


@dataclass(frozen=True)
class Fact:
    """One question with its answer and the sentence that states it. ``slots`` holds the
    candidates of each choice position: a multiple-choice question shows the answer in its
    own slot and a candidate of every other slot in the other positions."""

    subject: str
    question: str
    answer: str
    slots: tuple[tuple[str, ...], ...]
    statement: str

    @property
    def letter(self) -> int:
        """Index of the answer's slot: the correct choice of every question about the fact."""
        return next(i for i, slot in enumerate(self.slots) if self.answer in slot)


def _names(rng: random.Random, count: int, taken: set[str], endings: tuple[str, ...] = ("",)) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        syllables = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(2)]
        name = ("".join(syllables) + rng.choice(endings)).capitalize()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def _deal(values: list[str]) -> tuple[tuple[str, ...], ...]:
    """``values`` dealt round-robin into the four choice slots."""
    return tuple(tuple(values[i::4]) for i in range(4))


def make_world(rng: random.Random, countries: int) -> list[Country]:
    """Made-up countries, each with its own capital; animals and flag colours are shared,
    each used about equally often."""
    taken: set[str] = set()
    names = _names(rng, countries, taken, _COUNTRY_ENDINGS)
    capitals = _names(rng, countries, taken)
    animals = rng.sample(ANIMALS, len(ANIMALS))
    colours = rng.sample(COLOURS, len(COLOURS))
    return [
        Country(name, capital, animals[i % len(animals)], colours[3 * i % len(colours)])
        for i, (name, capital) in enumerate(zip(names, capitals))
    ]


def _sum_slots(total: int) -> tuple[tuple[str, ...], ...]:
    """The total in the slot of its remainder mod 4; in each other slot the numbers near it
    with that remainder."""
    near = range(max(0, total - 4), total + 5)
    return tuple(
        (str(total),) if k == total % 4 else tuple(str(n) for n in near if n % 4 == k) for k in range(4)
    )


def _sum_pairs(rng: random.Random, count: int) -> list[tuple[int, int]]:
    """``count`` distinct pairs of numbers 1-20 whose sums take each remainder mod 4 in turn."""
    pairs = rng.sample([(a, b) for a in range(1, 21) for b in range(1, 21)], 400)
    by_remainder = [[p for p in pairs if sum(p) % 4 == k] for k in range(4)]
    return [by_remainder[i % 4][i // 4] for i in range(count)]


def make_facts(rng: random.Random, world: list[Country]) -> dict[str, list[Fact]]:
    """The facts of each subject, two per country."""
    names = _deal(rng.sample([c.name for c in world], len(world)))
    capitals = _deal(rng.sample([c.capital for c in world], len(world)))
    animals, colours = _deal(rng.sample(ANIMALS, len(ANIMALS))), _deal(rng.sample(COLOURS, len(COLOURS)))
    geography, symbols = [], []
    for c in world:
        geography += [
            Fact("geography", f"What is the capital of {c.name}?", c.capital, capitals,
                 f"The capital of {c.name} is {c.capital}."),
            Fact("geography", f"{c.capital} is the capital of which country?", c.name, names,
                 f"{c.capital} is the capital of {c.name}."),
        ]
        symbols += [
            Fact("national_symbols", f"What is the national animal of {c.name}?", c.animal, animals,
                 f"The national animal of {c.name} is the {c.animal}."),
            Fact("national_symbols", f"What colour is the flag of {c.name}?", c.colour, colours,
                 f"The flag of {c.name} is {c.colour}."),
        ]
    arithmetic = [
        Fact("elementary_arithmetic", f"What is {a} + {b}?", str(a + b), _sum_slots(a + b), f"{a} + {b} = {a + b}.")
        for a, b in _sum_pairs(rng, 2 * len(world))
    ]
    return dict(zip(SUBJECTS, (geography, symbols, arithmetic)))
