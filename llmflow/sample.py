"""``llmflow sample``: built-in sample assets, generated offline from a seed.

Everything the demo and the tests need, in the formats the real assets come in:

- ``tokenizer/``: a byte-level BPE trained on the generated text, with Qwen2.5-Instruct's
  special tokens, ``tokenizer_config.json`` and chat template;
- ``model/``: a tiny Qwen2-style model with random weights (config.json, model.safetensors,
  generation_config.json and the tokenizer files);
- ``pretrain/corpus.parquet``: articles in the layout of the Wikipedia dumps on the Hub
  (id, url, title, text);
- ``instruct/alpaca.parquet`` and ``.jsonl``: an Alpaca-layout instruction set
  (instruction, input, output);
- ``mmlu/hf/{subject}/{dev,test}-00000-of-00001.parquet`` (the ``cais/mmlu`` layout) and
  ``mmlu/csv/data/{dev,test}/{subject}_{split}.csv`` (the original MMLU CSV layout).

All the text describes one generated world of made-up countries (capitals, national
animals, flag colours) plus small sums, so the assets fit together: pretraining on the
corpus or finetuning on the instruction set teaches the facts the MMLU questions ask
about. The instruction set holds plain questions and multiple-choice practice questions in
the MMLU prompt format, with other distractors and orderings than the test split. The
same seed gives byte-identical files.
"""

from __future__ import annotations

import csv
import json
import random
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.data.templates import QWEN
from llmflow.models import CausalLM, ModelConfig, save_hf_model

STAGE = "sample"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
LETTERS = "ABCD"
SUBJECTS = ("geography", "national_symbols", "elementary_arithmetic")
DEV_PER_SUBJECT = 5
MAX_POSITIONS = 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

ANIMALS = ("fox", "bear", "owl", "wolf", "deer", "hawk", "seal", "crane", "otter", "horse", "lion", "tiger")
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple", "grey", "brown")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s", "m")
_COUNTRY_ENDINGS = ("ia", "land", "ora", "stan", "mark")


class SampleConfig(BaseModel):
    """Write the built-in sample assets (tokenizer, tiny model, corpus, instruction set, MMLU)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    out: Path
    """Output directory (replaced as a whole; manifest.json is written last)."""
    seed: int = 0
    """Seed of the generated world, the texts and the model weights: the same seed gives
    byte-identical files."""
    countries: int = Field(default=30, ge=8, le=200)
    """Made-up countries in the world; each subject asks twice as many facts."""
    instruct_rows: int = Field(default=2000, ge=1)
    """Rows of the instruction set: one plain question per fact, then multiple-choice
    practice questions."""
    test_questions: int = Field(default=50, ge=1)
    """MMLU test questions per subject (5 dev questions per subject come on top)."""
    documents: int = Field(default=240, ge=1)
    """Articles in the pretraining corpus."""
    tokenizer_vocab: int = Field(default=1536, ge=300)
    """Target vocabulary of the BPE tokenizer, special tokens not counted."""


# --- the world ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    animal: str
    colour: str


@dataclass(frozen=True)
class Fact:
    """One question with its answer, the candidates its distractors come from, and the
    sentence that states it."""

    subject: str
    question: str
    answer: str
    pool: tuple[str, ...]
    statement: str


def _names(rng: random.Random, count: int, taken: set[str], endings: tuple[str, ...] = ("",)) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        syllables = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(2)]
        name = ("".join(syllables) + rng.choice(endings)).capitalize()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def make_world(rng: random.Random, countries: int) -> list[Country]:
    """Made-up countries, each with its own capital, an animal and a flag colour."""
    taken: set[str] = set()
    names = _names(rng, countries, taken, _COUNTRY_ENDINGS)
    capitals = _names(rng, countries, taken)
    return [
        Country(name, capital, rng.choice(ANIMALS), rng.choice(COLOURS)) for name, capital in zip(names, capitals)
    ]


def make_facts(rng: random.Random, world: list[Country]) -> dict[str, list[Fact]]:
    """The facts of each subject (2 per country)."""
    names = tuple(c.name for c in world)
    capitals = tuple(c.capital for c in world)
    geography, symbols = [], []
    for c in world:
        geography.append(
            Fact("geography", f"What is the capital of {c.name}?", c.capital, capitals,
                 f"The capital of {c.name} is {c.capital}.")
        )
        geography.append(
            Fact("geography", f"{c.capital} is the capital of which country?", c.name, names,
                 f"{c.capital} is the capital of {c.name}.")
        )
        symbols.append(
            Fact("national_symbols", f"What is the national animal of {c.name}?", c.animal, ANIMALS,
                 f"The national animal of {c.name} is the {c.animal}.")
        )
        symbols.append(
            Fact("national_symbols", f"What colour is the flag of {c.name}?", c.colour, COLOURS,
                 f"The flag of {c.name} is {c.colour}.")
        )
    pairs = rng.sample([(a, b) for a in range(1, 21) for b in range(1, 21)], 2 * len(world))
    arithmetic = [
        Fact("elementary_arithmetic", f"What is {a} + {b}?", str(a + b),
             tuple(str(n) for n in range(max(0, a + b - 6), a + b + 7)), f"{a} + {b} = {a + b}.")
        for a, b in pairs
    ]
    return {"geography": geography, "national_symbols": symbols, "elementary_arithmetic": arithmetic}


# --- multiple-choice questions ------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    """A multiple-choice question in the cais/mmlu layout."""

    question: str
    subject: str
    choices: tuple[str, str, str, str]
    answer: int


def make_question(fact: Fact, rng: random.Random, answer: int) -> Question:
    """``fact`` as a multiple-choice question whose correct choice is at index ``answer``."""
    distractors = rng.sample([x for x in fact.pool if x != fact.answer], 3)
    choices = distractors[:answer] + [fact.answer] + distractors[answer:]
    return Question(fact.question, fact.subject, tuple(choices), answer)


def balanced_letters(rng: random.Random, count: int) -> list[int]:
    """``count`` answer indices, each of the four as often as possible, in random order."""
    letters = [i % 4 for i in range(count)]
    rng.shuffle(letters)
    return letters


def format_question(q: Question, with_answer: bool = False) -> str:
    """The question as lm-evaluation-harness writes it, ending in "Answer:" (plus " X" and a
    blank line for a solved few-shot example)."""
    lines = [q.question.strip(), *(f"{letter}. {c}" for letter, c in zip(LETTERS, q.choices)), "Answer:"]
    text = "\n".join(lines)
    return f"{text} {LETTERS[q.answer]}\n\n" if with_answer else text


def mmlu_header(subject: str) -> str:
    """The first line of an MMLU prompt, as lm-evaluation-harness writes it."""
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def make_mmlu(
    rng: random.Random, facts: dict[str, list[Fact]], test_questions: int
) -> dict[str, dict[str, list[Question]]]:
    """{subject: {"dev": 5 questions, "test": ``test_questions``}}; dev and test ask
    different facts, so a few-shot example never gives a test answer away."""
    splits = {}
    for subject, subject_facts in facts.items():
        order = rng.sample(subject_facts, len(subject_facts))
        dev_facts, test_facts = order[:DEV_PER_SUBJECT], order[DEV_PER_SUBJECT:]
        test_cycle = [test_facts[i % len(test_facts)] for i in range(test_questions)]
        splits[subject] = {
            "dev": [make_question(f, rng, a) for f, a in zip(dev_facts, balanced_letters(rng, len(dev_facts)))],
            "test": [make_question(f, rng, a) for f, a in zip(test_cycle, balanced_letters(rng, test_questions))],
        }
    return splits


# --- instruction set ----------------------------------------------------------------------------

_MC_INSTRUCTIONS = (
    "Answer the following multiple choice question with the letter of the correct choice.",
    "Choose the correct answer.",
)


def plain_row(fact: Fact, rng: random.Random) -> dict[str, str]:
    """A question about ``fact`` answered with the sentence that states it."""
    if rng.random() < 0.5:
        return {"instruction": fact.question, "input": "", "output": fact.statement}
    return {"instruction": "Answer the question in one sentence.", "input": fact.question, "output": fact.statement}


def practice_row(q: Question, rng: random.Random) -> dict[str, str]:
    """A multiple-choice question in the MMLU prompt format, answered with its letter."""
    block = format_question(q)
    if rng.random() < 0.5:
        return {"instruction": block, "input": "", "output": LETTERS[q.answer]}
    return {"instruction": rng.choice(_MC_INSTRUCTIONS), "input": block, "output": LETTERS[q.answer]}


def make_instructions(
    rng: random.Random, facts: dict[str, list[Fact]], mmlu: dict[str, dict[str, list[Question]]], rows: int
) -> list[dict[str, str]]:
    """One plain question per fact, then practice questions cycling over the facts; no
    practice question repeats an MMLU question (same choices in the same order)."""
    all_facts = [f for subject_facts in facts.values() for f in subject_facts]
    seen = {format_question(q) for splits in mmlu.values() for split in splits.values() for q in split}
    out = [plain_row(f, rng) for f in rng.sample(all_facts, len(all_facts))][:rows]
    letters: list[int] = []
    while len(out) < rows:
        for fact in rng.sample(all_facts, len(all_facts)):
            if len(out) == rows:
                break
            if not letters:
                letters = balanced_letters(rng, 4 * len(all_facts))
            q = make_question(fact, rng, letters.pop())
            while format_question(q) in seen:
                q = make_question(fact, rng, q.answer)
            seen.add(format_question(q))
            out.append(practice_row(q, rng))
    return out


# --- pretraining corpus -------------------------------------------------------------------------


def _country_article(c: Country, kind: int, rng: random.Random) -> tuple[str, str]:
    sentences = [
        f"{c.name} is a country.",
        f"The capital of {c.name} is {c.capital}, its largest city.",
        f"The national animal of {c.name} is the {c.animal}.",
        f"The flag of {c.name} is {c.colour}.",
        f"{c.capital} is the capital of {c.name}.",
        f"People in {c.name} often see the {c.animal} near {c.capital}.",
        f"On national day the streets of {c.capital} are {c.colour}, the colour of the flag.",
    ]
    titles = (c.name, f"Geography of {c.name}", f"Culture of {c.name}", f"History of {c.name}")
    body = [sentences[0]] + rng.sample(sentences[1:], len(sentences) - 1)
    return titles[kind % len(titles)], " ".join(body)


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


# --- tokenizer ----------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (no prefix space, every byte in the alphabet) with the three
    special tokens appended after the merges, as in Qwen2's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _token_entry(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def write_tokenizer(tokenizer, directory: Path) -> None:
    """tokenizer.json plus the tokenizer_config.json and special_tokens_map.json of a
    Qwen2.5-Instruct tokenizer (eos <|im_end|>, pad <|endoftext|>, no bos)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {**_token_entry(t), "special": True} for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": QWEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": _token_entry(IM_END),
        "pad_token": _token_entry(ENDOFTEXT),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def check_tokenizer(tokenizer) -> None:
    """The MMLU answer tokens must be single tokens, or scoring compares the wrong things."""
    for letter in LETTERS:
        if len(tokenizer.encode(f" {letter}", add_special_tokens=False).ids) != 1:
            raise RuntimeError(f"sample tokenizer splits {' ' + letter!r}; raise tokenizer_vocab")


# --- model --------------------------------------------------------------------------------------


def model_hf_config(tokenizer) -> dict[str, Any]:
    """config.json of the tiny model: Qwen2 with GQA and tied embeddings, its vocabulary the
    tokenizer's rounded up to a multiple of 64."""
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": -(-tokenizer.get_vocab_size() // 64) * 64,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": 4,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": tokenizer.token_to_id(IM_END),
    }


def write_model(tokenizer, directory: Path, seed: int) -> Path:
    """The tiny model with seeded random weights, its generation config and tokenizer files."""
    model = CausalLM(ModelConfig.from_hf(model_hf_config(tokenizer)))
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    save_hf_model(model, directory)
    generation = {
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)],
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory


# --- writers ------------------------------------------------------------------------------------


def _write_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def write_mmlu(mmlu: dict[str, dict[str, list[Question]]], directory: Path) -> None:
    """Both MMLU layouts: cais/mmlu parquet per subject and split, and the original CSVs."""
    schema = pa.schema(
        [("question", pa.string()), ("subject", pa.string()), ("choices", pa.list_(pa.string())), ("answer", pa.int64())]
    )
    for subject, splits in mmlu.items():
        for split, questions in splits.items():
            columns = {
                "question": [q.question for q in questions],
                "subject": [q.subject for q in questions],
                "choices": [list(q.choices) for q in questions],
                "answer": [q.answer for q in questions],
            }
            _write_parquet(directory / "hf" / subject / f"{split}-00000-of-00001.parquet",
                           pa.table(columns, schema=schema))
            csv_path = directory / "csv" / "data" / split / f"{subject}_{split}.csv"
            csv_path.parent.mkdir(parents=True, exist_ok=True)
            with open(csv_path, "w", newline="", encoding="utf-8") as f:
                csv.writer(f).writerows([q.question, *q.choices, LETTERS[q.answer]] for q in questions)


def write_instructions(rows: list[dict[str, str]], directory: Path) -> None:
    """The instruction set as parquet and as JSON lines."""
    columns = {key: [r[key] for r in rows] for key in ("instruction", "input", "output")}
    _write_parquet(directory / "alpaca.parquet", pa.table(columns, schema=pa.schema([(k, pa.string()) for k in columns])))
    with open(directory / "alpaca.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write_corpus(rows: list[dict[str, str]], path: Path) -> None:
    columns = {key: [r[key] for r in rows] for key in ("id", "url", "title", "text")}
    _write_parquet(path, pa.table(columns, schema=pa.schema([(k, pa.string()) for k in columns])))


def tokenizer_texts(
    corpus: list[dict[str, str]], instructions: list[dict[str, str]], mmlu: dict[str, dict[str, list[Question]]]
) -> list[str]:
    """The text the tokenizer learns from: everything the other assets hold, MMLU as the
    evaluation prompts spell it."""
    texts = [r["text"] for r in corpus]
    texts += [f"{r['instruction']}\n\n{r['input']}\n{r['output']}" for r in instructions]
    for subject, splits in mmlu.items():
        texts += [mmlu_header(subject) + format_question(q, with_answer=True) for q in splits["dev"] + splits["test"]]
    return texts


def write_sample(config: SampleConfig) -> Path:
    """Write the sample assets into ``config.out`` (replacing it whole); returns it."""
    rng = random.Random(config.seed)
    world = make_world(rng, config.countries)
    facts = make_facts(rng, world)
    mmlu = make_mmlu(rng, facts, config.test_questions)
    instructions = make_instructions(rng, facts, mmlu, config.instruct_rows)
    corpus = make_corpus(rng, world, config.documents)
    tokenizer = train_tokenizer(tokenizer_texts(corpus, instructions, mmlu), config.tokenizer_vocab)
    check_tokenizer(tokenizer)

    out = Path(config.out).expanduser().resolve()
    with atomic_directory(out) as work:
        write_tokenizer(tokenizer, work / "tokenizer")
        write_model(tokenizer, work / "model", config.seed)
        for name in TOKENIZER_FILES:
            shutil.copyfile(work / "tokenizer" / name, work / "model" / name)
        write_corpus(corpus, work / "pretrain" / "corpus.parquet")
        write_instructions(instructions, work / "instruct")
        write_mmlu(mmlu, work / "mmlu")
        files = [file_record(p, work) for p in sorted(work.rglob("*")) if p.is_file()]
        counts = {
            "countries": len(world),
            "facts": sum(len(f) for f in facts.values()),
            "documents": len(corpus),
            "instruct_rows": len(instructions),
            "mmlu": {s: {split: len(qs) for split, qs in splits.items()} for s, splits in mmlu.items()},
            "tokenizer_length": tokenizer.get_vocab_size(),
        }
        params = config.model_dump(mode="json", exclude={"out"})
        write_json_atomic(work / MANIFEST, manifest_payload(STAGE, params, files, seed=config.seed, counts=counts))
    return out


class SampleCommand(SampleConfig):
    """Write the built-in sample assets (tokenizer, tiny model, corpus, instruction set, MMLU)
    into a directory, offline and deterministically from a seed."""

    def cli_cmd(self) -> None:
        start = time.monotonic()
        out = write_sample(SampleConfig(**self.model_dump()))
        print(f"wrote sample assets to {out} in {time.monotonic() - start:.1f}s")
