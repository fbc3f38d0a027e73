"""MMLU-Pro (mmlu_pro) and GPQA Diamond (gpqa_diamond_cot_zeroshot, gpqa_diamond_cot_n_shot):
the prompts, plain and under a chat template, against the installed harness's fewshot_context
on the same local data, the targets, the filters against its filter classes, the readers'
errors, and agreement with the real lm-evaluation-harness on a tiny model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from harness_exemplars import harness_tasks
from harness_runs import harness_results, harness_task, outputs, parrot_model, run_harness
from parquet_rows import write_parquet
from test_chat_eval import harness_kwargs
from test_generative_tasks import assert_same_metrics, assert_same_samples, harness_samples

from llmflow.evaluate.chat_context import ChatSettings, PromptRenderer
from llmflow.evaluate.generative_engine import GenerativeEvalConfig, build_runs, evaluate_generative, task_settings
from llmflow.evaluate.generative_tasks import GenerativeGroup
from llmflow.evaluate.gpqa import FLEXIBLE, GPQA_DIAMOND, STRICT, read_docs, zeroshot_text
from llmflow.evaluate.mmlu_pro import CATEGORIES, MMLU_PRO, read_category
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.task_selection import select_tasks
from llmflow.sample.reasoning_choice_tasks import MMLU_PRO_CATEGORIES, write_gpqa, write_mmlu_pro
from llmflow.sample.world import make_world

PRO_TASKS = [f"mmlu_pro_{c.replace(' ', '_')}" for c in MMLU_PRO_CATEGORIES]
GPQA_TASKS = [t.name for t in GPQA_DIAMOND.tasks]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The sample writers' MMLU-Pro and GPQA Diamond data."""
    root = tmp_path_factory.mktemp("reasoning-data")
    world = make_world(random.Random(3), 8)
    assert write_mmlu_pro(7, world, root) == {"mmlu_pro_validation": 15, "mmlu_pro_test": 18}
    assert write_gpqa(7, world, root) == {"gpqa_diamond": 10}
    return root


def write_harness_tasks(out: Path, data: Path, prefix: str) -> None:
    pro = data / "mmlu-pro" / "data"
    for name in PRO_TASKS:
        harness_task(out, prefix + name, f"mmlu_pro/{name}.yaml",
                     {split: pro / f"{split}-00000-of-00001.parquet" for split in ("test", "validation")})
    for name in GPQA_TASKS:
        kind = name.removeprefix("gpqa_diamond_")
        harness_task(out, prefix + name, f"gpqa/{kind}/{name}.yaml", {"train": data / "gpqa-diamond" / "gpqa_diamond.csv"},
                     "csv")


@pytest.fixture(scope="module")
def harness(data, tmp_path_factory):
    """The harness's tasks on the data, loaded after simple_evaluate's random.seed(0)."""
    import datasets
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("reasoning-tasks")
    write_harness_tasks(root, data, "h_")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets-cache")
        tasks = {}
        for name in [*PRO_TASKS, *GPQA_TASKS]:
            random.seed(0)
            tasks.update(TaskManager(include_path=str(root), include_defaults=False).load([f"h_{name}"])["tasks"])
        return tasks


def test_the_tasks_are_the_harness_configurations(harness):
    from lm_eval.tasks._yaml_loader import load_yaml

    group = load_yaml(harness_tasks() / "mmlu_pro" / "_mmlu_pro.yaml")
    assert group["group"] == MMLU_PRO.harness_name and group["task"] == [t.name for t in MMLU_PRO.tasks]
    assert group["aggregate_metric_list"] == [{"aggregation": "mean", "metric": "exact_match", "weight_by_size": True,
                                               "filter_list": MMLU_PRO.headline_filter}]
    assert len(CATEGORIES) == 14
    for task in [t for t in MMLU_PRO.tasks if t.name in PRO_TASKS] + list(GPQA_DIAMOND.tasks):
        theirs = harness[f"h_{task.name}"]
        assert list(theirs.config.generation_kwargs["until"]) == list(task.until)
        assert theirs.config.generation_kwargs.get("max_gen_toks", 256) == task.max_gen_toks
        assert float(theirs.config.metadata["version"]) == float(task.version)
        assert (theirs.config.num_fewshot or 0) == task.fewshot.shots
        (metric,) = theirs.config.metric_list
        assert (metric["metric"], metric["ignore_case"], metric["ignore_punctuation"]) == ("exact_match", True, True)
        filters = [(f["name"], [s["function"] for s in f["filter"]], f["filter"][0]["regex_pattern"])
                   for f in theirs.config.filter_list]
        if task.scorer is None:
            assert task.metric.ignore_case and task.metric.ignore_punctuation
            assert filters == [(f.name, ["regex", "take_first"], f.pattern) for f in task.filters]
        else:
            assert filters == [(STRICT.name, ["regex", "take_first"], STRICT.pattern),
                               (FLEXIBLE.name, ["multi_choice_regex", "take_first"], FLEXIBLE.pattern)]
            flexible = theirs.config.filter_list[1]["filter"][0]
            assert (flexible["group_select"], flexible["ignore_case"], flexible["ignore_punctuation"]) == (
                FLEXIBLE.group_select, FLEXIBLE.ignore_case, FLEXIBLE.ignore_punctuation)


SETTINGS = [{}, {"apply_chat_template": True}, {"apply_chat_template": True, "fewshot_as_multiturn": False,
                                                 "system_instruction": "Be brief."}]


@pytest.mark.parametrize("settings", SETTINGS, ids=["plain", "multiturn", "single-turn+system"])
def test_prompts_and_targets_are_the_harness_fewshot_context(settings, harness, data, sample_assets, tmp_path):
    model = sample_assets() / "model"
    renderer = PromptRenderer(ChatSettings(**settings), model)
    kwargs = harness_kwargs(settings, model)
    for group, names, root, settings_shots in ((MMLU_PRO, PRO_TASKS, data / "mmlu-pro", (None, 2)),
                                               (GPQA_DIAMOND, GPQA_TASKS, data / "gpqa-diamond", (None, 3))):
        for setting in settings_shots:
            tasks = select_tasks(group.title, group.tasks, names)
            config = GenerativeEvalConfig(model=model, data=root, out=tmp_path / "out", shots=setting)
            shots, _ = task_settings(tasks, config)
            for run in build_runs(group, tasks, root, shots, None, renderer):
                theirs = harness[f"h_{run.task.name}"]
                assert shots == (setting if setting is not None else theirs.config.num_fewshot or 0)
                theirs.set_fewshot_seed(1234)
                docs = list(theirs.eval_docs)
                assert [theirs.fewshot_context(d, shots, **kwargs) for d in docs] == run.contexts, (run.task.name, shots)
                assert [theirs.doc_to_target(d) for d in docs] == [d.target for d in run.docs]
    texts = [d.text for d in read_category("history", data / "mmlu-pro")]
    assert any("\nJ. " in t for t in texts) and any("\nI. " not in t for t in texts)  # 10 options, and fewer


CHOICES = ("Bralvil", "Gunstem and Bralvil", "the (third) one", "A")
TEXTS = [
    "", "nothing here", "The answer is (B).", "The answer is (b)", "so (A) then (C) finally", "I pick gunstem and bralvil!",
    "It is Bralvil, not Gunstem and Bralvil.", "The third one.", "answer: C", "Answer:B and more", "answer is (D) .",
    "the answer is (Z)", "Final: a", "(x) (Y)", "THE THIRD ONE", "The answer is ", "answer:\n D", "A", "( A )",
]


def test_filters_extract_what_the_harness_filters_extract():
    from lm_eval.filters.extraction import MultiChoiceRegexFilter, RegexFilter
    from lm_eval.filters.selection import TakeFirstFilter

    strict = RegexFilter(regex_pattern=STRICT.pattern)
    flexible = MultiChoiceRegexFilter(regex_pattern=FLEXIBLE.pattern, group_select=-1, ignore_case=True,
                                      ignore_punctuation=True)
    for choices in (CHOICES, ("", "x", "y", "z"), ("Guilty", "Guilty of Romance", "b", "c")):
        doc = {"choices": list(choices)}
        texts = [*TEXTS, *choices, "guilty of romance", "Guilty"]
        docs = [doc] * len(texts)  # one apply: the harness builds its punctuation table on each
        flexibles = TakeFirstFilter().apply(flexible.apply([[t] for t in texts], docs), docs)
        stricts = TakeFirstFilter().apply(strict.apply([[t] for t in texts], docs), docs)
        for text, picked, strictly in zip(texts, flexibles, stricts, strict=True):
            assert FLEXIBLE.extract(text, choices) == picked, (choices, text)
            assert STRICT.extract(text) == strictly, text
    (pro_filter,) = MMLU_PRO.tasks[0].filters
    pro = RegexFilter(regex_pattern=pro_filter.pattern)
    for text in [*TEXTS, "the answer is (J)", "answer is E. and answer is (F)", "The answer is K"]:
        (picked,) = TakeFirstFilter().apply(pro.apply([[text]], [None]), [None])
        assert pro_filter.extract(text) == picked, text


def test_the_scorer_scores_both_filters(data):
    task = GPQA_DIAMOND.tasks[0]
    doc = read_docs(zeroshot_text, data / "gpqa-diamond")[0]
    text = f"The answer is {doc.target}.\nOr {doc.choices[0]}"
    (scored,) = task.score([doc], [[text]], 1)
    assert scored.record["extracted"] == {"strict-match": doc.target, "flexible-extract": doc.target}
    assert scored.values == {"exact_match_strict_match": 1.0, "exact_match_flexible_extract": 1.0}
    assert GPQA_DIAMOND.headline_metric(task) == "exact_match_flexible_extract"


# --- errors, before the model is loaded ----------------------------------------------------------


def test_bad_data_is_refused_before_the_model_loads(data, tmp_path):
    common = {"model": tmp_path / "no-model", "out": tmp_path / "out"}
    (tmp_path / "empty").mkdir()
    with pytest.raises(BenchmarkDataError, match=r"MMLU-Pro data .*empty: no test split; found \[\]; expected TIGER-Lab"):
        evaluate_generative(MMLU_PRO, GenerativeEvalConfig(**common, data=tmp_path / "empty", tasks=PRO_TASKS))
    bad = write_parquet(tmp_path / "p" / "data" / "test-00000-of-00001.parquet",
                        [{"question": "q", "options": ["a"], "answer": "A"}])
    with pytest.raises(BenchmarkDataError, match=rf"{bad}: columns \['question', 'options', 'answer'\] lack \['category'\]"):
        evaluate_generative(MMLU_PRO, GenerativeEvalConfig(**common, data=tmp_path / "p", tasks=PRO_TASKS))
    row = {"question": "q", "options": "a", "answer": "A", "category": "history", "cot_content": ""}
    typed = write_parquet(tmp_path / "t" / "data" / "test-00000-of-00001.parquet", [row])
    with pytest.raises(BenchmarkDataError, match=rf"{typed} row 1: expected a question, an answer, a category \(text\) "
                                                 r"and options \(a list of texts\)"):
        evaluate_generative(MMLU_PRO, GenerativeEvalConfig(**common, data=tmp_path / "t", tasks=["mmlu_pro_history"]))
    with pytest.raises(BenchmarkDataError, match=r"mmlu_pro_biology data .*: no documents"):
        evaluate_generative(MMLU_PRO, GenerativeEvalConfig(**common, data=data / "mmlu-pro"))
    with pytest.raises(BenchmarkDataError, match=r"6 shots asked for, the validation split has 5 rows in category 'history'"):
        evaluate_generative(MMLU_PRO, GenerativeEvalConfig(**common, data=data / "mmlu-pro", shots=6,
                                                           tasks=["mmlu_pro_history"]))
    with pytest.raises(BenchmarkDataError, match=r"GPQA data .*empty: no gpqa_diamond.csv; found \[\]"):
        evaluate_generative(GPQA_DIAMOND, GenerativeEvalConfig(**common, data=tmp_path / "empty"))
    csv = tmp_path / "g" / "gpqa_diamond.csv"
    csv.parent.mkdir()
    csv.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2\nq,a,b,c\n")
    with pytest.raises(BenchmarkDataError, match=rf"{csv}: columns \[.*\] lack \['Incorrect Answer 3'\]"):
        evaluate_generative(GPQA_DIAMOND, GenerativeEvalConfig(**common, data=csv.parent))
    csv.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\nq,a,b,c,d\n,a,b,c,d\n")
    with pytest.raises(BenchmarkDataError, match=rf"{csv} line 3: no Question"):
        evaluate_generative(GPQA_DIAMOND, GenerativeEvalConfig(**common, data=csv.parent))
    with pytest.raises(BenchmarkDataError, match=r"10 shots asked for, the few-shot split has 10 documents"):
        evaluate_generative(GPQA_DIAMOND, GenerativeEvalConfig(**common, data=data / "gpqa-diamond", shots=10))
    with pytest.raises(FileNotFoundError, match="no-model"):
        evaluate_generative(GPQA_DIAMOND, GenerativeEvalConfig(**common, data=data / "gpqa-diamond", shots=2))
    assert not (tmp_path / "out").exists()


# --- against the real lm-evaluation-harness ------------------------------------------------------


def agree(tmp_path: Path, model: Path, data: Path, group: GenerativeGroup, names: list[str], shots: int | None,
          limit: int, max_new_tokens: int, same_gold: bool = True, chat: dict | None = None) -> dict:
    """Run the harness and llmflow on ``names`` and compare them (``same_gold``: their golds
    and metrics too), under the ``chat`` settings; llmflow's results."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_harness_tasks(tasks, data, "llmflow_")
    random.seed(0)
    run_harness(model, ",".join(f"llmflow_{n}" for n in names), tasks, tmp_path / "harness", shots=shots, limit=limit,
                max_gen_toks=max_new_tokens, chat=chat)
    root = data / ("mmlu-pro" if group is MMLU_PRO else "gpqa-diamond")
    config = GenerativeEvalConfig(model=model, data=root, out=tmp_path / "ours", tasks=names, shots=shots, limit=limit,
                                  max_new_tokens=max_new_tokens, batch_size=3, device="cpu", **(chat or {}))
    out = evaluate_generative(group, config)
    results, predictions = outputs(out)
    expected = harness_results(tmp_path / "harness")
    for name in names:
        theirs = harness_samples(tmp_path / "harness", f"llmflow_{name}")
        mine = [p for p in predictions if p["task"] == name]
        contexts = [s["arguments"]["gen_args_0"]["arg_0"] for s in next(iter(theirs.values()))]
        if same_gold:
            assert_same_samples(theirs, mine, contexts)
            assert_same_metrics(expected[f"llmflow_{name}"], results["tasks"][name], list(theirs))
        for samples in theirs.values():
            assert [s["arguments"]["gen_args_0"]["arg_0"] for s in samples] == contexts
            assert [s["resps"][0][0] for s in samples] == [p["generated"] for p in mine]
        for filter_name, samples in theirs.items():
            assert [s["filtered_resps"][0] for s in samples] == [p["extracted"][filter_name] for p in mine]
    return {"results": results, "predictions": predictions, "harness": expected}


@pytest.mark.slow
@pytest.mark.parametrize("chat", [None, {"apply_chat_template": True}], ids=["plain", "chat-multiturn"])
def test_mmlu_pro_agrees_with_lm_eval(sample_assets, data, tmp_path, chat):
    model = parrot_model(sample_assets() / "model", tmp_path / "parrot", " so the answer is (B)")
    names = ["mmlu_pro_history", "mmlu_pro_computer_science"]
    out = agree(tmp_path, model, data, MMLU_PRO, names, 2, 4, 12, chat=chat)
    assert {p["extracted"]["custom-extract"] for p in out["predictions"]} == {"B"}
    group = out["results"]["group"]["exact_match_custom_extract"]
    scores = [out["harness"][f"llmflow_{n}"]["exact_match,custom-extract"] for n in names]
    assert group["micro"] == pytest.approx(sum(scores) / 2, abs=1e-12)  # 4 documents each: the size-weighted mean


@pytest.mark.slow
@pytest.mark.parametrize("chat", [None, {"apply_chat_template": True, "fewshot_as_multiturn": False,
                                         "system_instruction": "Answer carefully."}], ids=["plain", "chat-single-turn"])
def test_gpqa_agrees_with_lm_eval(sample_assets, data, tmp_path, chat):
    model = parrot_model(sample_assets() / "model", tmp_path / "parrot", " The answer is (C)")
    # The harness shuffles the answers again (process_docs, the global random state moved on)
    # each time it reads the documents, so its logged golds are not those of its prompts.
    out = agree(tmp_path, model, data, GPQA_DIAMOND, GPQA_TASKS, 2, 5, 16, same_gold=False, chat=chat)
    # strict-match drops the last character (the full stop it expects); flexible-extract takes "(C)"
    assert {tuple(p["extracted"].values()) for p in out["predictions"]} == {("(C", "(C)")}
