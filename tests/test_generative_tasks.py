"""GSM8K (gsm8k_cot) and BBH (bbh_cot_fewshot): the exemplars against the installed harness's
yamls, the prompts against its own rendering, the filters, exact match and stop-string cut
against its own functions, the readers' errors, and agreement with the real
lm-evaluation-harness (what ``lm_eval --model hf`` runs, on the same tiny local data and model): the
same contexts, generated texts, extracted answers and metrics, the bbh group's size-weighted
average included."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness_exemplars import MODULE, harness_exemplars, harness_tasks, render
from harness_runs import harness_results, harness_task, ours, parrot_model, run_harness
from parquet_rows import write_parquet

from llmflow.evaluate.generative_engine import (
    GenerativeEvalConfig,
    build_runs,
    evaluate_generative,
    harness_cut,
    task_settings,
)
from llmflow.evaluate.generative_tasks import BBH, GSM8K, GSM8K_COT_TASK, read_bbh, read_gsm8k
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.task_selection import select_tasks

BBH_PAIR = ["bbh_cot_fewshot_boolean_expressions", "bbh_cot_fewshot_object_counting"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """GSM8K in openai/gsm8k's layout and two BBH subtasks in SaylorTwift/bbh's."""
    root = tmp_path_factory.mktemp("generative-data")
    write_parquet(root / "gsm8k" / "main" / "test-00000-of-00001.parquet", [
        {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
         "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1,200 * 2 = 2,400\n#### 2,400"},
        {"question": "What is 5 - 8?", "answer": "#### -3"},
    ])
    write_parquet(root / "bbh" / "boolean_expressions" / "test-00000-of-00001.parquet",
                  [{"input": "not ( True ) and ( True ) is", "target": "False"}, {"input": "True or False is",
                                                                                 "target": "True"}])
    write_parquet(root / "bbh" / "object_counting" / "test-00000-of-00001.parquet",
                  [{"input": "I have a fox and two owls. How many animals do I have?", "target": "3"}])
    return root


# --- the harness's text, prompts and functions -------------------------------------------------


def test_exemplars_are_the_installed_harness_yamls():
    """cot_exemplars.py is what tests/harness_exemplars.py writes from lm_eval's task yamls today."""
    assert MODULE.read_text(encoding="utf-8") == render(harness_exemplars())
    assert len(GSM8K_COT_TASK.exemplars) == 8 and len(BBH.tasks) == 27
    assert all(len(task.exemplars) == 3 for task in BBH.tasks)


def test_bbh_is_the_harness_group_with_its_size_weighted_score():
    from lm_eval.tasks._yaml_loader import load_yaml

    group = load_yaml(harness_tasks() / "bbh" / "cot_fewshot" / "_bbh_cot_fewshot.yaml")
    assert group["group"] == BBH.harness_name and group["task"] == [t.name for t in BBH.tasks]
    assert group["aggregate_metric_list"] == [{"metric": "exact_match", "aggregation": "mean", "weight_by_size": True,
                                               "filter_list": BBH.headline_filter}]


def test_prompts_and_targets_are_the_harness_renderings(data, tmp_path, monkeypatch):
    import datasets
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # datasets reads HF_DATASETS_CACHE when imported, which may have happened already.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    harness_task(tmp_path, "h_gsm8k_cot", "gsm8k/gsm8k-cot.yaml", {"test": next((data / "gsm8k").rglob("*.parquet"))})
    for name in BBH_PAIR:
        subtask = name.removeprefix("bbh_cot_fewshot_")
        harness_task(tmp_path, f"h_{name}", f"bbh/cot_fewshot/{subtask}.yaml",
                     {"test": next((data / "bbh" / subtask).glob("*"))})
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    tasks = manager.load([f"h_{n}" for n in ["gsm8k_cot", *BBH_PAIR]])["tasks"]
    for group, names, root in ((GSM8K, ["gsm8k_cot"], data / "gsm8k"), (BBH, BBH_PAIR, data / "bbh")):
        for setting in (None, 2):
            config = GenerativeEvalConfig(model=tmp_path, data=root, out=tmp_path / "out", shots=setting)
            shots, _ = task_settings(select_tasks(group.title, group.tasks, names), config)
            for run in build_runs(group, select_tasks(group.title, group.tasks, names), root, shots, None):
                theirs = tasks[f"h_{run.task.name}"]
                assert shots == (setting or theirs.config.num_fewshot)
                docs = list(theirs.eval_docs)
                assert [theirs.fewshot_context(d, shots) for d in docs] == run.contexts, (run.task.name, shots)
                assert [theirs.doc_to_target(d) for d in docs] == [d.target for d in run.docs]
                assert list(theirs.config.generation_kwargs["until"]) == list(run.task.until)
                assert theirs.config.generation_kwargs.get("max_gen_toks", 256) == run.task.max_gen_toks
                assert float(theirs.config.metadata["version"]) == float(run.task.version)
                assert [(f["name"], [step["function"] for step in f["filter"]], f["filter"][0]["regex_pattern"],
                         f["filter"][0].get("group_select", 0)) for f in theirs.config.filter_list] == [
                    (f.name, ["regex", "take_first"], f.pattern, f.group_select) for f in run.task.filters]
                (metric,) = theirs.config.metric_list
                assert metric["metric"] == "exact_match"
                assert (metric.get("ignore_case", False), metric.get("ignore_punctuation", False),
                        metric.get("regexes_to_ignore", [])) == (
                    run.task.metric.ignore_case, run.task.metric.ignore_punctuation,
                    list(run.task.metric.regexes_to_ignore))
    assert tasks["h_gsm8k_cot"].doc_to_target(list(tasks["h_gsm8k_cot"].eval_docs)[1]) == "2,400"


ANSWERS = [
    "", "no number at all", "The answer is 5.", "The answer is 5", "The answer is -1,234.50. Next", "the answer is 5.",
    "So the answer is $12.", "x\nThe answer is 7.\nThe answer is 8.", "It is 3.5 and then 4", "1 2 3", "$1,000.00",
    "value -7 or -8.", "So the answer is (A).\n", "so the answer is False.", "So the answer is .", "the answer is  yes .",
    "So the answer is 12 apples. And the answer is 13!", "#### 42", "The answer is 6.\x00", " the answer is x",
]


def test_filters_extract_what_the_harness_filters_extract():
    from lm_eval.filters.extraction import RegexFilter
    from lm_eval.filters.selection import TakeFirstFilter

    for task in (GSM8K_COT_TASK, BBH.tasks[0]):
        for f in task.filters:
            theirs = RegexFilter(regex_pattern=f.pattern, group_select=f.group_select)
            for text in ANSWERS:
                (picked,) = TakeFirstFilter().apply(theirs.apply([[text]], [None]), [None])
                assert f.extract(text) == picked, (f.name, text)
    assert [f.extract("So the answer is 3,200.") for f in GSM8K_COT_TASK.filters] == ["[invalid]", "3,200."]
    assert BBH.tasks[0].filters[0].extract("Z = True. So the answer is True.") == "True"


MATCHES = [("7", "7"), ("$1,200.", "1200"), ("1,200", "1,200"), ("2,400.", "2,400"), ("-3", "-3"), ("3.", "3"),
           ("[invalid]", "7"), ("ABC", "abc"), ("(A)", "(A)"), ("(a)", "(A)"), ("True", "True "), ("6\x00", "6"),
           ("İ", "i̇"), ("steps #### 42", "42"), ("42.0", "42"), ("a.b", "a.b"), ("", ""), ("x", "")]


def test_exact_match_is_the_harness_metric():
    from lm_eval.api.metrics import exact_match_hf_evaluate

    options = [(GSM8K_COT_TASK.metric, {"ignore_case": True, "ignore_punctuation": False,
                                        "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"]}),
               (BBH.tasks[0].metric, {})]
    for metric, kwargs in options:
        for prediction, reference in MATCHES + [(r, p) for p, r in MATCHES]:
            theirs = exact_match_hf_evaluate(predictions=[prediction], references=[reference], **kwargs)["exact_match"]
            assert metric.score(prediction, reference) == theirs, (kwargs, prediction, reference)


def test_stop_strings_cut_as_the_harness_cuts():
    from lm_eval.models.utils import postprocess_generated_text

    stops = [["Q:", "</s>", "<|im_end|>", "<|endoftext|>"], ["</s>", "Q", "\n\n"], ["\n\n", "Q"]]
    texts = ["The answer is 5.\n\nQ: next", " A Q", "no stop", "Q", "</s>Q:", "a\n\n\nb", "", "x\n\nQ:y\n\n"]
    for until in stops:
        for text in texts:
            assert harness_cut(text, until) == postprocess_generated_text(text, until, None), (text, until)


# --- readers and errors, before the model is loaded ---------------------------------------------


def test_gsm8k_reads_the_hub_and_the_original_layouts_alike(data, tmp_path):
    hub = read_gsm8k(data / "gsm8k")
    assert [d.target for d in hub] == ["7", "2,400", "-3"]
    assert hub[0].text == "Q: Tom has 3 apples and buys 4 more. How many apples does he have?\nA:"
    rows = pq.read_table(next((data / "gsm8k").rglob("*.parquet"))).to_pylist()
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_gsm8k(tmp_path) == hub


def test_bad_data_names_the_file_and_row(tmp_path):
    bad = write_parquet(tmp_path / "g" / "main" / "test-00000-of-00001.parquet",
                        [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": None}])
    with pytest.raises(BenchmarkDataError, match=rf"{bad} row 2: expected a question and an answer \(text\)"):
        read_gsm8k(tmp_path / "g")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BenchmarkDataError, match=r"GSM8K data .*empty: no test split; found \[\]; expected openai/gsm8k"):
        read_gsm8k(tmp_path / "empty")
    lines = tmp_path / "o" / "test.jsonl"
    lines.parent.mkdir()
    lines.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"\n')
    with pytest.raises(BenchmarkDataError, match=rf"{lines} line 2: not JSON"):
        read_gsm8k(tmp_path / "o")
    wrong = write_parquet(tmp_path / "b" / "navigate" / "test-00000-of-00001.parquet", [{"question": "q", "answer": "a"}])
    with pytest.raises(BenchmarkDataError, match=rf"{wrong}: columns \['question', 'answer'\] lack \['input', 'target'\]"):
        read_bbh(tmp_path / "b" / "navigate")
    target = write_parquet(tmp_path / "c" / "navigate" / "test-00000-of-00001.parquet", [{"input": "q", "target": 3}])
    with pytest.raises(BenchmarkDataError, match=rf"{target} row 1: expected an input and a target \(text\)"):
        read_bbh(tmp_path / "c" / "navigate")


def test_settings_and_missing_tasks_are_refused_before_the_model_loads(data, tmp_path):
    common = {"model": tmp_path / "no-model", "out": tmp_path / "out"}
    with pytest.raises(BenchmarkDataError, match=r"GSM8K data .*missing: no test split; no such directory"):
        evaluate_generative(GSM8K, GenerativeEvalConfig(**common, data=tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"shots=9: gsm8k_cot has 8 exemplars"):
        evaluate_generative(GSM8K, GenerativeEvalConfig(**common, data=data / "gsm8k", shots=9))
    with pytest.raises(ValueError, match=r"shots=4: bbh_cot_fewshot_boolean_expressions has 3 exemplars"):
        evaluate_generative(BBH, GenerativeEvalConfig(**common, data=data / "bbh", shots=4, tasks=BBH_PAIR))
    with pytest.raises(ValueError, match=r"no tasks \['navigate'\]; its tasks are \['bbh_cot_fewshot_boolean_expressions'"):
        evaluate_generative(BBH, GenerativeEvalConfig(**common, data=data / "bbh", tasks=["navigate"]))
    with pytest.raises(BenchmarkDataError, match=r"no directory for tasks \['bbh_cot_fewshot_causal_judgement', .*"
                                                 + re.escape(f"evaluate the tasks it has with tasks={BBH_PAIR}")):
        evaluate_generative(BBH, GenerativeEvalConfig(**common, data=data / "bbh"))
    with pytest.raises(FileNotFoundError, match="no-model"):
        evaluate_generative(BBH, GenerativeEvalConfig(**common, data=data / "bbh", tasks=BBH_PAIR))
    assert not (tmp_path / "out").exists()


# --- against the real lm-evaluation-harness ----------------------------------------------------


def bbh_harness_tasks(tasks: Path, data: Path, prefix: str = "llmflow_") -> Path:
    """``tasks``, holding the harness's own tasks of ``BBH_PAIR`` (named ``prefix`` + name)
    reading ``data``'s subtasks."""
    tasks.mkdir(exist_ok=True)
    for name in BBH_PAIR:
        subtask = name.removeprefix("bbh_cot_fewshot_")
        harness_task(tasks, f"{prefix}{name}", f"bbh/cot_fewshot/{subtask}.yaml", {"test": next((data / subtask).glob("*"))})
    return tasks


def harness_samples(out: Path, task: str) -> dict[str, list[dict]]:
    """Each filter's samples of ``task``, by document."""
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    by_filter: dict[str, list[dict]] = {}
    for sample in map(json.loads, path.read_text().splitlines()):
        by_filter.setdefault(sample["filter"], []).append(sample)
    return {f: sorted(samples, key=lambda s: s["doc_id"]) for f, samples in by_filter.items()}


def assert_same_samples(theirs: dict[str, list[dict]], mine: list[dict], contexts: list[str]) -> None:
    """The same prompts, generated texts, extracted answers and scores, document by document."""
    for name, samples in theirs.items():
        assert len(samples) == len(mine) == len(contexts)
        for sample, pred, context in zip(samples, mine, contexts):
            assert sample["arguments"]["gen_args_0"]["arg_0"] == context
            assert sample["resps"][0][0] == pred["generated"], sample["doc_id"]
            assert sample["filtered_resps"][0] == pred["extracted"][name]
            assert sample["target"] == pred["gold"]
            assert float(sample["exact_match"]) == float(pred["correct"][name])


def assert_same_metrics(expected: dict, task: dict, filters: list[str]) -> None:
    for name in filters:
        metric = "exact_match_" + name.replace("-", "_")
        assert task[metric] == pytest.approx(expected[f"exact_match,{name}"], abs=1e-12)
        assert task[f"{metric}_stderr"] == pytest.approx(expected[f"exact_match_stderr,{name}"], abs=1e-12)


@pytest.mark.slow
def test_gsm8k_agrees_with_lm_eval(sample_assets, tmp_path):
    """The sample model's gibberish, from prompts cut from the left (8 exemplars are longer than
    the model's 1024 positions), generated in batches of other sizes, under the repetition
    penalty its generation_config.json sets (transformers applies it to greedy decoding; this
    strong one varies the text: partial UTF-8 characters, a row that ends at eos)."""
    model, data = shutil.copytree(sample_assets() / "model", tmp_path / "model"), sample_assets() / "gsm8k"
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "repetition_penalty": 5.0}))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    harness_task(tasks, "llmflow_gsm8k_cot", "gsm8k/gsm8k-cot.yaml", {"test": next(data.rglob("test-*.parquet"))})
    run_harness(model, "llmflow_gsm8k_cot", tasks, tmp_path / "harness", limit=6, max_gen_toks=32)
    results, predictions = ours(tmp_path, "gsm8k", model, data, "--limit", "6", "--max-new-tokens", "32")
    (run,) = build_runs(GSM8K, list(GSM8K.tasks), data, 8, 6)
    theirs = harness_samples(tmp_path / "harness", "llmflow_gsm8k_cot")
    assert sorted(theirs) == ["flexible-extract", "strict-match"]
    assert_same_samples(theirs, predictions, run.contexts)
    assert all(p["truncated"] and p["prompt_tokens"] == 1024 - 32 for p in predictions)
    task = results["tasks"]["gsm8k_cot"]
    assert_same_metrics(harness_results(tmp_path / "harness")["llmflow_gsm8k_cot"], task, list(theirs))
    assert task["samples"] == 6 and task["generation"]["until"] == ["Q:", "</s>", "<|im_end|>"]
    assert results["settings"]["repetition_penalty"] == 5.0
    assert results["headline"] == {"metric": "exact_match_strict_match", "average": None,
                                   "value": task["exact_match_strict_match"],
                                   "stderr": task["exact_match_strict_match_stderr"]}


@pytest.mark.slow
def test_bbh_agrees_with_lm_eval_task_by_task_and_as_a_size_weighted_group(sample_assets, tmp_path):
    """A model that answers "So the answer is 7." to everything: the filter matches, and some
    object_counting documents are right."""
    model = parrot_model(sample_assets() / "model", tmp_path / "parrot", " So the answer is 7.")
    data = sample_assets() / "bbh"
    tasks = bbh_harness_tasks(tmp_path / "tasks", data)
    # The bbh_cot_fewshot group's own aggregation (bbh/cot_fewshot/_bbh_cot_fewshot.yaml) over these two tasks.
    (tasks / "llmflow_bbh.yaml").write_text(
        "group: llmflow_bbh\ntask:\n" + "".join(f"  - llmflow_{n}\n" for n in BBH_PAIR)
        + "aggregate_metric_list:\n  - metric: exact_match\n    aggregation: mean\n    weight_by_size: true\n"
        + "    filter_list: get-answer\n")
    run_harness(model, "llmflow_bbh", tasks, tmp_path / "harness", limit=8, max_gen_toks=16)
    results, predictions = ours(tmp_path, "bbh", model, data, "--limit", "8", "--max-new-tokens", "16",
                                "--tasks", json.dumps(BBH_PAIR))
    expected = harness_results(tmp_path / "harness")
    runs = build_runs(BBH, select_tasks(BBH.title, BBH.tasks, BBH_PAIR), data, 3, 8)
    for run in runs:
        theirs = harness_samples(tmp_path / "harness", f"llmflow_{run.task.name}")
        mine = [p for p in predictions if p["task"] == run.task.name]
        assert_same_samples(theirs, mine, run.contexts)
        assert {p["generated"] for p in mine} == {" So the answer is 7."}
        assert {p["extracted"]["get-answer"] for p in mine} == {"7"}
        assert_same_metrics(expected[f"llmflow_{run.task.name}"], results["tasks"][run.task.name], ["get-answer"])
    assert 0 < results["tasks"]["bbh_cot_fewshot_object_counting"]["exact_match_get_answer"] < 1
    group = results["group"]["exact_match_get_answer"]
    assert group["micro"] == pytest.approx(expected["llmflow_bbh"]["exact_match,get-answer"], abs=1e-12)
    assert group["micro_stderr"] == pytest.approx(expected["llmflow_bbh"]["exact_match_stderr,get-answer"], abs=1e-12)
    assert results["headline"] == {"metric": "exact_match_get_answer", "average": "micro", "value": group["micro"],
                                   "stderr": group["micro_stderr"]}
