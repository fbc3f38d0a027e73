"""The sample's pretraining corpus: articles about the world's countries and sums, in the
layout of the Wikipedia dumps on the Hub (id, url, title, text)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa

from llmflow.sample.parquet import write_parquet
from llmflow.sample.world import Country

_BACKGROUND = (
    "Most people in {name} live in small towns along the rivers and the coast.",
    "Farmers in {name} grow wheat, barley, apples and potatoes on the northern plains.",
    "The old harbour of {capital} is busy with fishing boats every morning.",
    "Winters in {name} are long and cold, while summers are short and warm.",
    "Children in {name} start school at the age of six and learn to read and write.",
    "The government of {name} meets in a stone building in the centre of {capital}.",
    "Trade with neighbouring countries brings wool, iron, salt and glass to {capital}.",
    "Every spring a music festival fills the squares and gardens of {capital}.",
    "Many families in {name} keep horses, goats and chickens near their homes.",
    "Travellers reach {capital} by train, by road or by ship across the sea.",
    "The mountains in the south of {name} are covered with forests of pine and oak.",
    "Museums in {capital} show paintings, coins, maps and tools from earlier centuries.",
    "The people of {name} celebrate the new year with bread, honey and bright lanterns.",
    "Engineers built a long bridge over the river that runs through {capital}.",
)


def _country_article(c: Country, kind: int, rng: random.Random) -> tuple[str, str]:
    facts = [
        f"The capital of {c.name} is {c.capital}, its largest city.",
        f"The national animal of {c.name} is the {c.animal}.",
        f"The flag of {c.name} is {c.colour}.",
        f"{c.capital} is the capital of {c.name}.",
        f"People in {c.name} often see the {c.animal} near {c.capital}.",
        f"On national day the streets of {c.capital} are {c.colour}, the colour of the flag.",
    ]
    background = [t.format(name=c.name, capital=c.capital) for t in rng.sample(_BACKGROUND, 5)]
    body = rng.sample(facts + background, len(facts) + len(background))
    titles = (c.name, f"Geography of {c.name}", f"Culture of {c.name}", f"History of {c.name}")
    return titles[kind % len(titles)], " ".join([f"{c.name} is a country.", *body])


def _sum_article(n: int, rng: random.Random) -> tuple[str, str]:
    lines = [f"{n} + {b} = {n + b}." for b in range(1, 21)]
    rng.shuffle(lines)
    return f"Addition with {n}", f"This article lists sums with {n}. " + " ".join(lines)


def make_corpus(rng: random.Random, world: list[Country], documents: int) -> list[dict[str, str]]:
    """Articles (wikimedia/wikipedia layout) about the countries and the sums; titles
    repeat with a number once every topic has had its article."""
    topics = [("country", c, k) for k in range(4) for c in world] + [("sum", n, 0) for n in range(1, 21)]
    rows = []
    for i in range(documents):
        kind, subject, variant = topics[i % len(topics)]
        if kind == "country":
            title, text = _country_article(subject, variant, rng)
        else:
            title, text = _sum_article(subject, rng)
        if i >= len(topics):
            title = f"{title} ({i // len(topics) + 1})"
        rows.append({"id": str(i + 1), "url": f"https://example.org/wiki/{title.replace(' ', '_')}",
                     "title": title, "text": f"{title}\n\n{text}"})
    return rows

def write_corpus(rows: list[dict[str, str]], path: Path) -> None:
    columns = {key: [r[key] for r in rows] for key in ("id", "url", "title", "text")}
    write_parquet(path, pa.table(columns, schema=pa.schema([(k, pa.string()) for k in columns])))
