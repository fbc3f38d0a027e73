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
  ``mmlu/csv/data/{dev,test}/{subject}_{split}.csv`` (the original MMLU CSV layout);
- ``boolq/`` and ``agieval/``: BoolQ and two AGIEval tasks in their Hub layouts
  (``sample_choice_tasks.py``);
- ``gsm8k/`` and ``bbh/``: GSM8K word problems and two BBH subtasks in their Hub layouts
  (``sample_generative_tasks.py``).

All the text describes one generated world of made-up countries (capitals, national
animals, flag colours) plus small sums, so the assets fit together: pretraining on the
corpus or finetuning on the instruction set teaches the facts the MMLU questions ask about.
The instruction set holds plain questions (answered in a sentence) and practice quizzes in
the MMLU prompt format; the test split asks about the same facts, each question with other
distractors than any practice question, and dev and test ask about different facts.

Every answer has a fixed choice position (its slot: capitals and countries are dealt into
four slots, animals and colours too, and a sum goes to the slot of its remainder mod 4),
while the other three choices vary. A model that knows a fact therefore knows its letter
without matching the answer's text against the choices, a skill that a model of a few
million parameters does not learn in the few hundred steps a CPU demo can afford; a model
that does not know the fact still scores chance (25%), the letters being balanced.

The same seed gives byte-identical files.
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
import tokenizers
import torch
from pydantic import BaseModel, ConfigDict, Field

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.data.templates import QWEN
from llmflow.evaluate.prompts import CONTINUATIONS, FEWSHOT_DELIMITER, MMLU_PROMPT
from llmflow.evaluate.questions import LETTERS, Question
from llmflow.models import CausalLM, ModelConfig
from llmflow.sample_choice_tasks import write_choice_tasks
from llmflow.sample_generative_tasks import write_generative_tasks
from llmflow.weights import save_hf_model

STAGE = "sample"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
SUBJECTS = ("geography", "national_symbols", "elementary_arithmetic")
DEV_PER_SUBJECT = 5
QUIZ_MAX = 5
MAX_POSITIONS = 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

ANIMALS = ("fox", "bear", "owl", "wolf", "deer", "hawk", "seal", "crane")
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s", "m")
_COUNTRY_ENDINGS = ("ia", "land", "ora", "stan", "mark")


class SampleConfig(BaseModel):
    """Write the built-in sample assets (tokenizer, tiny model, corpus, instruction set, MMLU,
    BoolQ, AGIEval, GSM8K, BBH)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    out: Path
    """Output directory (replaced as a whole; manifest.json is written last)."""
    seed: int = 0
    """Seed of the generated world, the texts and the model weights: the same seed gives
    byte-identical files."""
    countries: int = Field(default=8, ge=8, le=200)
    """Made-up countries in the world; each subject asks twice as many facts."""
    instruct_rows: int = Field(default=1000, ge=1)
    """Rows of the instruction set: one plain question per fact, then quizzes of
    multiple-choice practice questions."""
    test_questions: int = Field(default=50, ge=1)
    """MMLU test questions per subject (5 dev questions per subject come on top)."""
    documents: int = Field(default=240, ge=1)
    """Articles in the pretraining corpus."""
    tokenizer_vocab: int = Field(default=1536, ge=300)
    """Largest vocabulary of the BPE tokenizer, special tokens not counted (merging stops
    earlier once no pair of symbols occurs twice in the text)."""


# --- the world ----------------------------------------------------------------------------------


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


# --- multiple-choice questions ------------------------------------------------------------------


def make_question(fact: Fact, rng: random.Random) -> Question:
    """``fact`` as a multiple-choice question: the answer in its slot, a random candidate of
    each other slot around it."""
    choices = tuple(fact.answer if i == fact.letter else rng.choice(slot) for i, slot in enumerate(fact.slots))
    return Question(subject=fact.subject, question=fact.question, choices=choices, answer=fact.letter)


def _new_question(fact: Fact, rng: random.Random, taken: set[Question]) -> Question:
    """A question about ``fact`` not in ``taken``, unless the fact's choices run out."""
    q = make_question(fact, rng)
    for _ in range(64):
        if q not in taken:
            break
        q = make_question(fact, rng)
    return q


def _by_letter(facts: list[Fact]) -> list[Fact]:
    """``facts`` reordered so that consecutive facts cycle through the answer letters."""
    groups = [[f for f in facts if f.letter == k] for k in range(4)]
    out = []
    while any(groups):
        out += [g.pop() for g in groups if g]
    return out


def make_mmlu(
    rng: random.Random, facts: dict[str, list[Fact]], test_questions: int
) -> dict[str, dict[str, list[Question]]]:
    """{subject: {"dev": 5 questions, "test": ``test_questions``}}; dev and test ask about
    different facts, so a few-shot example never gives a test answer away. Test answers
    take each letter equally often (give or take one), and no test question repeats another
    while the facts' choices allow."""
    splits = {}
    for subject, subject_facts in facts.items():
        order = _by_letter(rng.sample(subject_facts, len(subject_facts)))
        dev_facts, test_facts = order[:DEV_PER_SUBJECT], order[DEV_PER_SUBJECT:]
        by_letter = [[f for f in test_facts if f.letter == k] for k in range(4)]
        test: list[Question] = []
        for i in range(test_questions):
            group = by_letter[i % 4]
            test.append(_new_question(group[i // 4 % len(group)], rng, set(test)))
        rng.shuffle(test)
        splits[subject] = {"dev": [make_question(f, rng) for f in dev_facts], "test": test}
    return splits


# --- instruction set ----------------------------------------------------------------------------


def plain_row(fact: Fact, rng: random.Random) -> dict[str, str]:
    """A question about ``fact`` answered with the sentence that states it."""
    if rng.random() < 0.5:
        return {"instruction": fact.question, "input": "", "output": fact.statement}
    return {"instruction": "Answer the question in one sentence.", "input": fact.question, "output": fact.statement}


def quiz_row(questions: list[Question]) -> dict[str, str]:
    """Practice questions of one subject answered in the MMLU prompt format: the
    instruction is the prompt's first line, the output the solved questions."""
    return {
        "instruction": MMLU_PROMPT.describe(questions[0].subject).strip(),
        "input": "",
        "output": FEWSHOT_DELIMITER.join(MMLU_PROMPT.solved_example(q) for q in questions),
    }


def make_instructions(
    rng: random.Random, facts: dict[str, list[Fact]], mmlu: dict[str, dict[str, list[Question]]], rows: int
) -> list[dict[str, str]]:
    """One plain question per fact, then practice quizzes of one to five questions of one
    subject, in random order; practice questions avoid the MMLU questions."""
    all_facts = [f for subject_facts in facts.values() for f in subject_facts]
    taken = {q for splits in mmlu.values() for split in splits.values() for q in split}
    out = [plain_row(f, rng) for f in rng.sample(all_facts, len(all_facts))][:rows]
    subjects = sorted(facts)
    while len(out) < rows:
        subject_facts = facts[rng.choice(subjects)]
        chosen = rng.sample(subject_facts, min(rng.randint(1, QUIZ_MAX), len(subject_facts)))
        out.append(quiz_row([_new_question(f, rng, taken) for f in chosen]))
    rng.shuffle(out)
    return out


# --- pretraining corpus -------------------------------------------------------------------------


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


# --- tokenizer ----------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE (no prefix space, every byte in the alphabet) with the three
    special tokens appended after the merges, as in Qwen2's vocabulary. Its normalizer and
    pre-tokenizer are those transformers' ``Qwen2Tokenizer`` builds (NFC; Qwen2's split regex,
    single digits, then bytes), so tokenizer.json says what ``AutoTokenizer`` does."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.normalizer = tokenizers.normalizers.NFC()
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _token_entry(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def write_tokenizer(tokenizer: tokenizers.Tokenizer, directory: Path) -> None:
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
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    special_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": _token_entry(IM_END),
        "pad_token": _token_entry(ENDOFTEXT),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def check_tokenizer(tokenizer: tokenizers.Tokenizer) -> None:
    """The MMLU answer tokens must be single tokens, or scoring compares the wrong things."""
    for continuation in CONTINUATIONS:
        if len(tokenizer.encode(continuation, add_special_tokens=False).ids) != 1:
            raise RuntimeError(f"sample tokenizer splits {continuation!r}; raise tokenizer_vocab")


# --- model --------------------------------------------------------------------------------------


def model_hf_config(tokenizer: tokenizers.Tokenizer) -> dict[str, Any]:
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


def write_model(tokenizer: tokenizers.Tokenizer, directory: Path, seed: int) -> Path:
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
        [
            ("question", pa.string()),
            ("subject", pa.string()),
            ("choices", pa.list_(pa.string())),
            ("answer", pa.int64()),
        ]
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
    schema = pa.schema([(k, pa.string()) for k in columns])
    _write_parquet(directory / "alpaca.parquet", pa.table(columns, schema=schema))
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
    texts = [r["text"] for r in corpus] + ["system user assistant You are a helpful assistant."]
    texts += [f"{r['instruction']}\n\n{r['input']}\n{r['output']}" for r in instructions]
    for subject, splits in mmlu.items():
        texts += [MMLU_PROMPT.describe(subject) + MMLU_PROMPT.solved_example(q) + FEWSHOT_DELIMITER
                  for q in splits["dev"] + splits["test"]]
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
        choice_tasks = write_choice_tasks(config.seed, world, facts, work)
        generative_tasks = write_generative_tasks(config.seed, world, work)
        files = [file_record(p, work) for p in sorted(work.rglob("*")) if p.is_file()]
        counts = {
            "countries": len(world),
            "facts": sum(len(f) for f in facts.values()),
            "documents": len(corpus),
            "instruct_rows": len(instructions),
            "mmlu": {s: {split: len(qs) for split, qs in splits.items()} for s, splits in mmlu.items()},
            "tokenizer_length": tokenizer.get_vocab_size(),
            **choice_tasks,
            **generative_tasks,
        }
        params = config.model_dump(mode="json", exclude={"out"})
        write_json_atomic(work / MANIFEST, manifest_payload(STAGE, params, files, seed=config.seed, counts=counts))
    return out


class SampleCommand(SampleConfig):
    """Write the built-in sample assets (tokenizer, tiny model, corpus, instructions, MMLU, BoolQ,
    AGIEval, GSM8K, BBH) offline."""

    def cli_cmd(self) -> None:
        start = time.monotonic()
        out = write_sample(SampleConfig(**self.model_dump()))
        print(f"wrote sample assets to {out} in {time.monotonic() - start:.1f}s")
