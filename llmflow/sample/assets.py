"""``llmflow sample``: every sample asset written into one directory, its manifest last."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from llmflow.artifacts import MANIFEST, atomic_directory, file_record, manifest_payload, write_json_atomic
from llmflow.sample.choice_tasks import write_choice_tasks
from llmflow.sample.corpus import make_corpus, write_corpus
from llmflow.sample.generative_tasks import write_generative_tasks
from llmflow.sample.ifeval_tasks import write_ifeval
from llmflow.sample.instructions import make_instructions, write_instructions
from llmflow.sample.math_tasks import write_math_tasks
from llmflow.sample.mmlu import make_mmlu, write_mmlu
from llmflow.sample.model import write_model
from llmflow.sample.preferences import write_preferences
from llmflow.sample.reasoning_choice_tasks import write_gpqa, write_mmlu_pro
from llmflow.sample.rl_prompts import write_rl_prompts
from llmflow.sample.tokenizer import TOKENIZER_FILES, check_tokenizer, tokenizer_texts, train_tokenizer, write_tokenizer
from llmflow.sample.world import make_facts, make_world

STAGE = "sample"


class SampleConfig(BaseModel):
    """Write the built-in sample assets (tokenizer, tiny model, corpus, instruction set,
    preference set, RL prompt set, MMLU, BoolQ, AGIEval, GSM8K, BBH, HumanEval, MATH-500, MATH,
    MMLU-Pro, GPQA Diamond, IFEval)."""

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
        preferences = write_preferences(config.seed, world, facts, work / "preference")
        rl_prompts = write_rl_prompts(config.seed, world, facts, work / "rl")
        write_mmlu(mmlu, work / "mmlu")
        choice_tasks = write_choice_tasks(config.seed, world, facts, work)
        generative_tasks = write_generative_tasks(config.seed, world, work)
        reasoning_tasks = {**write_math_tasks(config.seed, world, work), **write_mmlu_pro(config.seed, world, work),
                           **write_gpqa(config.seed, world, work), **write_ifeval(config.seed, world, work)}
        files = [file_record(p, work) for p in sorted(work.rglob("*")) if p.is_file()]
        counts = {
            "countries": len(world),
            "facts": sum(len(f) for f in facts.values()),
            "documents": len(corpus),
            "instruct_rows": len(instructions),
            "mmlu": {s: {split: len(qs) for split, qs in splits.items()} for s, splits in mmlu.items()},
            "tokenizer_length": tokenizer.get_vocab_size(),
            **preferences,
            **rl_prompts,
            **choice_tasks,
            **generative_tasks,
            **reasoning_tasks,
        }
        params = config.model_dump(mode="json", exclude={"out"})
        write_json_atomic(work / MANIFEST, manifest_payload(STAGE, params, files, seed=config.seed, counts=counts))
    return out


class SampleCommand(SampleConfig):
    """Write the built-in sample assets (tokenizer, tiny model, corpus, instructions, preference
    pairs, RL prompts, MMLU, BoolQ, AGIEval, GSM8K, BBH, HumanEval, MATH-500, MATH, MMLU-Pro, GPQA
    Diamond, IFEval) offline."""

    def cli_cmd(self) -> None:
        start = time.monotonic()
        out = write_sample(SampleConfig(**self.model_dump()))
        print(f"wrote sample assets to {out} in {time.monotonic() - start:.1f}s")
