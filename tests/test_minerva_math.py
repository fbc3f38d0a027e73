"""minerva_math500 and the minerva_math group: the exemplars, prompts, golds and settings against
the installed harness's own tasks, the answer extraction, normalisation, equivalence and
math_verify against its utils.py, the readers' errors, the sample data, and agreement with the
real lm-evaluation-harness on MATH-500 (the same contexts, generated texts, answers, scores
and metrics with their standard errors)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from harness_exemplars import harness_tasks
from harness_runs import harness_results, harness_samples, harness_task, outputs, parrot_model, run_harness
from parquet_rows import write_parquet

from llmflow.evaluate import minerva_math
from llmflow.evaluate.chat_context import PromptRenderer
from llmflow.evaluate.generative_engine import GenerativeEvalConfig, build_runs, evaluate_generative
from llmflow.evaluate.minerva_math import (
    FEWSHOT_SAMPLES,
    MINERVA_MATH,
    MINERVA_MATH500,
    MINERVA_MATH500_TASK,
    MathProblem,
    get_unnormalized_answer,
    is_equiv,
    last_boxed_only_string,
    normalize_final_answer,
    read_hendrycks_math,
    read_math500,
    remove_boxed,
)
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.sample.math_tasks import write_math_tasks
from llmflow.sample.world import make_world

SOLUTIONS = [
    "So $x = \\boxed{7}$.", "The sum is $\\boxed{1,000}$ dollars.", "Hence $\\boxed{\\dfrac{1}{2}}$.",
    "It is $\\boxed{5\\text{ cm}}$ long.", "The pair is $\\boxed{(0,1)}$.", "So $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.",
    "We get $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "Thus \\boxed 12$ and more.", "First $\\boxed{2}$, finally $\\boxed{x = 9}$.",
    "$\\boxed{90^\\circ}$", "The answer is \\boxed{\\text{(B)}}.", "$\\boxed{\\infty}$", "It repeats: $\\boxed{0.\\overline{3}}$.",
]
"""Solutions whose golds exercise process_docs: the last box, braces inside it, "\\boxed " (and a
gold, 0.3, that exact_match takes and math_verify does not)."""


def math500_row(number: int, solution: str) -> dict:
    return {"problem": f"Problem {number}: what is $x$?\n\nExplain.", "solution": solution, "answer": "unused",
            "subject": "Algebra", "level": 1 + number % 5, "unique_id": f"test/algebra/{number}.json"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Crafted MATH-500 rows (``crafted/test.jsonl``) and the sample data (``sample/``)."""
    root = tmp_path_factory.mktemp("minerva-data")
    write_jsonl(root / "crafted" / "test.jsonl", [math500_row(n, s) for n, s in enumerate(SOLUTIONS)])
    write_math_tasks(0, make_world(random.Random(0), 8), root / "sample")
    return root


def harness_utils() -> ModuleType:
    from lm_eval.tasks.minerva_math import utils

    return utils


# --- the harness's tasks, prompts and settings ---------------------------------------------------


def test_exemplars_and_the_group_are_the_harness_ones():
    from lm_eval.tasks._yaml_loader import load_yaml

    assert [{"problem": s["problem"], "solution": s["solution"], "few_shot": "1"} for s in FEWSHOT_SAMPLES] == (
        harness_utils().list_fewshot_samples())
    group = load_yaml(harness_tasks() / "benchmarks" / "minerva_math.yaml")
    assert group["group"] == MINERVA_MATH.harness_name and group["task"] == [t.name for t in MINERVA_MATH.tasks]
    assert group["aggregate_metric_list"] == [{"metric": m, "aggregation": "mean", "weight_by_size": True}
                                              for m in ("exact_match", "math_verify")]
    for task in MINERVA_MATH.tasks:
        config = load_yaml(harness_tasks() / "minerva_math" / f"{task.name}.yaml", resolve_func=False)
        assert (config["task"], config.get("dataset_name", "algebra")) == (task.name, task.subdir)
        assert task.hub_include == (f"{task.subdir}/test-*",)
    math500 = load_yaml(harness_tasks() / "minerva_math" / "minerva_math500.yaml", resolve_func=False)
    assert (math500["task"], math500["dataset_path"], math500["test_split"]) == (
        MINERVA_MATH500.harness_name, "HuggingFaceH4/MATH-500", "test")
    assert MINERVA_MATH500.headline_metric(MINERVA_MATH500_TASK) == "exact_match"
    # llmflow's names: kebab-case commands, and Prefect artifact keys ("{name}-scores") take no "_"
    assert [MINERVA_MATH500.name, MINERVA_MATH.name] == ["minerva-math500", "minerva-math"]


def test_prompts_golds_and_settings_are_the_harness_renderings(data, tmp_path, monkeypatch):
    import datasets
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    harness_task(tmp_path, "h_crafted", "minerva_math/minerva_math500.yaml",
                 {"test": data / "crafted" / "test.jsonl"}, "json")
    harness_task(tmp_path, "h_minerva_math500", "minerva_math/minerva_math500.yaml",
                 {"test": data / "sample" / "minerva-math500" / "test.jsonl"}, "json")
    for task in MINERVA_MATH.tasks:
        harness_task(tmp_path, f"h_{task.name}", f"minerva_math/{task.name}.yaml",
                     {"test": next((data / "sample" / "minerva-math" / task.subdir).glob("test-*.parquet"))})
    names = ["crafted", "minerva_math500", *(t.name for t in MINERVA_MATH.tasks)]
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False).load([f"h_{n}" for n in names])["tasks"]
    runs = [("crafted", run) for run in build_runs(MINERVA_MATH500, [MINERVA_MATH500_TASK], data / "crafted", 4, None)]
    runs += [(run.task.name, run) for run in build_runs(MINERVA_MATH500, [MINERVA_MATH500_TASK],
                                                          data / "sample" / "minerva-math500", 4, None)]
    runs += [(run.task.name, run) for run in build_runs(MINERVA_MATH, list(MINERVA_MATH.tasks),
                                                          data / "sample" / "minerva-math", 4, None)]
    assert len(runs) == 9
    for name, run in runs:
        theirs = tasks[f"h_{name}"]
        docs = list(theirs.eval_docs)
        assert theirs.config.num_fewshot == len(run.task.exemplars) == 4
        assert [theirs.fewshot_context(d, 4) for d in docs] == run.contexts, name
        assert [theirs.fewshot_context(d, 1) for d in docs[:2]] == [run.task.prompt(d, 1) for d in run.docs[:2]]
        assert [theirs.doc_to_target(d) for d in docs] == [d.target for d in run.docs], name
        assert [d["solution"] for d in docs] == [d.solution for d in run.docs if isinstance(d, MathProblem)]
        kwargs = theirs.config.generation_kwargs
        assert list(kwargs["until"]) == list(run.task.until) and not kwargs["do_sample"]
        assert kwargs.get("max_gen_toks", 256) == run.task.max_gen_toks
        assert theirs.config.target_delimiter == run.task.target_delimiter
        assert float(theirs.config.metadata["version"]) == float(run.task.version)
        assert [m["metric"] for m in theirs.config.metric_list] == ["exact_match", "math_verify"]
    assert [d.target for d in runs[0][1].docs] == [
        "7", "1000", "\\dfrac{1}{2}", "5", "(0,1)", "\\left(3,\\frac{\\pi}{2}\\right)", "\\frac{\\sqrt{3}}{2}", "12", "9",
        "90", "(B)", "\\infty", "0.3"]


# --- the harness's functions -----------------------------------------------------------------------

TEXTS = [
    "Final Answer: The final answer is $7$. I hope it is correct.",
    "Work.\nFinal Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.\n\n",
    "Final Answer: The final answer is 5", "Final Answer: The final answer is 5.", "Final Answer: The final answer is 5. ",
    "no final answer here", "", "final answer: the final answer is 7. I hope it is correct.",
    ("Final Answer: The final answer is $\\boxed{3}$. I hope it is correct. Final Answer: The final answer is $4$. "
     "I hope it is correct."), "Final Answer: The final answer is $12$ dollars. I hope it is correct.",
    "Final Answer: The final answer is$x=3$.I hope it is correct.", "So $\\boxed{8}$.",
    "Final Answer: The final answer is $[2,5)$. I hope it is correct.\nProblem",
]
ANSWERS = [
    "$7$", "7", "\\$1,000", "1,000", "0,1", "10,000,000", "-1,234", "1,23", "5 cm", "2\\pi cm", "2\\picm",
    "\\left( 3, \\frac{\\pi}{2} \\right)", "\\infty", "\\text{(A)}", "\\textbf{B}", "\\boxed{5}", "\\frac12", "\\fracab",
    "\\frac{1}2", "\\sqrt2", "\\sqrt[3]{8}", "\\sqrt[3]8", "x = 5", "y=2x+3", "90^\\circ", "90^{\\circ}",
    "5 \\text{ inches}", "\\$32.50", "an apple", "a b", "3 \\text{ and } 4", "1, 2,\\text{and} 3", "10\\%",
    "\\overline{AB}", "12 \\mbox{ feet}", "[invalidanswer]", "\\dfrac{3}{4}", "0.5", "5\\text{ ways}", "\\$5.00.",
    '"yes"', "1, 2, \\ldots", "1{,}000", "4\\;\\text{m}", "5\\text{ m}", "10^{\\circ} \\text{C}", "3\\text{s}",
    "\\text{Monday}", "$\\$4.50$ each", "squares", "\\left[ 1, 2 \\right]", "",
]
PAIRS = [
    ("7", "7"), ("7", "\\frac{14}{2}"), ("0.5", "\\frac{1}{2}"), ("\\dfrac{3}{4}", "\\frac{3}{4}"), ("[2,5)", "[2,5)"),
    ("(1,2)", "(2,1)"), ("x^2+2x+1", "(x+1)^2"), ("", ""), ("8", "7"), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
    ("(A)", "A"), ("10\\%", "10"), ("\\infty", "\\infty"), ("[invalidanswer]", "7"), ("1/3", "0.333"),
    ("2\\pi", "6.28"), ("a", "b"), ("\\pi", "\\pi/1"), ("3", "3.0"), ("\\{1,2\\}", "\\{2,1\\}"), ("x", "y-y+x"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"), ("1000", "10^3"), ("((", "7"),
]


def test_extraction_and_normalisation_are_the_harness_functions():
    utils = harness_utils()
    for text in TEXTS:
        assert get_unnormalized_answer(text) == utils.get_unnormalized_answer(text), text
    for answer in ANSWERS + [utils.get_unnormalized_answer(t) for t in TEXTS]:
        assert normalize_final_answer(answer) == utils.normalize_final_answer(answer), answer
    for solution in SOLUTIONS + ["no box", "\\fbox{3}", "\\boxed{unclosed", "\\boxed\\frac12 and {3}", "\\boxed {5}$"]:
        boxed = last_boxed_only_string(solution)
        assert boxed == utils.last_boxed_only_string(solution), solution
        if boxed is None:
            continue
        try:
            expected = utils.remove_boxed(boxed)
        except AssertionError:
            with pytest.raises(ValueError):
                remove_boxed(boxed)
        else:
            assert remove_boxed(boxed) == expected


def test_equivalence_is_the_harness_is_equiv():
    utils = harness_utils()
    for x1, x2 in PAIRS + [(b, a) for a, b in PAIRS]:
        assert is_equiv(x1, x2) == utils.is_equiv(x1, x2), (x1, x2)
    assert is_equiv("7", "\\frac{14}{2}") and not is_equiv("8", "7")


def test_both_metrics_are_the_harness_process_results(data):
    """Each crafted solution against the Minerva answer of its own gold and of the next one,
    the first against every text: the scorer's values are process_results' on the harness's
    own processed document."""
    import datasets

    utils = harness_utils()
    docs = list(utils.process_docs(datasets.Dataset.from_list([math500_row(n, s) for n, s in enumerate(SOLUTIONS)])))
    problems = read_math500(data / "crafted")
    answers = [f"Final Answer: The final answer is ${p.target}$. I hope it is correct." for p in problems]
    cases = [(i, text) for i in range(len(problems)) for text in (answers[i], answers[i - 1])]
    cases += [(0, text) for text in TEXTS]
    seen = set()
    for (i, text), score in zip(cases, MINERVA_MATH500_TASK.score([problems[i] for i, _ in cases],
                                                                  [[text] for _, text in cases], workers=1)):
        expected = utils.process_results(docs[i], [text])
        assert score.values == {k: float(v) for k, v in expected.items()}, (docs[i]["solution"], text)
        assert score.record["answer"] == normalize_final_answer(utils.get_unnormalized_answer(text))
        assert score.record["gold"] == docs[i]["answer"]
        seen.add(tuple(expected.values()))
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


# --- readers, errors, sample data ------------------------------------------------------------------


def test_bad_data_names_the_file_row_and_field(tmp_path):
    lines = write_jsonl(tmp_path / "m" / "test.jsonl", [math500_row(1, "$\\boxed{1}$"), {"problem": "p", "answer": "1"}])
    with pytest.raises(BenchmarkDataError, match=rf'{lines} line 2: expected solution as text, got \{{"problem": "p"'):
        read_math500(tmp_path / "m")
    unboxed = write_jsonl(tmp_path / "u" / "test.jsonl", [math500_row(1, "It is 4."), math500_row(2, "\\fbox{4}")])
    with pytest.raises(BenchmarkDataError, match=rf"{unboxed} line 1: expected the solution's answer in "
                                                 r"\\boxed\{\.\.\.\} \(it has none\)"):
        read_math500(tmp_path / "u")
    write_jsonl(unboxed, [math500_row(2, "\\fbox{4}")])
    with pytest.raises(BenchmarkDataError, match=rf"{unboxed} line 1: expected the solution's answer in .*fbox"):
        read_math500(tmp_path / "u")
    wrong = write_parquet(tmp_path / "h" / "algebra" / "test-00000-of-00001.parquet",
                          [{"problem": "p", "level": "Level 1", "type": "Algebra", "answer": "\\boxed{1}"}])
    with pytest.raises(BenchmarkDataError, match=rf"{wrong}: columns \['problem', 'level', 'type', 'answer'\] lack "
                                                 r"\['solution'\]; expected EleutherAI/hendrycks_math"):
        read_hendrycks_math(tmp_path / "h" / "algebra")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BenchmarkDataError, match=r"MATH-500 data .*empty: no test split; found \[\]; "
                                                 r"expected HuggingFaceH4/MATH-500"):
        read_math500(tmp_path / "empty")


def test_missing_subjects_and_parser_are_refused_before_the_model_loads(data, tmp_path, monkeypatch):
    common = {"model": tmp_path / "no-model", "out": tmp_path / "out"}
    partial = tmp_path / "partial"
    shutil.copytree(data / "sample" / "minerva-math" / "algebra", partial / "algebra")
    with pytest.raises(BenchmarkDataError, match=r"no directory for tasks \['minerva_math_counting_and_prob', .*"
                                                 r"evaluate the tasks it has with tasks=\['minerva_math_algebra'\]"):
        evaluate_generative(MINERVA_MATH, GenerativeEvalConfig(**common, data=partial))
    with pytest.raises(FileNotFoundError, match="no-model"):
        evaluate_generative(MINERVA_MATH, GenerativeEvalConfig(**common, data=data / "sample" / "minerva-math"))
    import sympy.parsing.latex

    def unusable(text: str) -> None:
        raise ImportError("LaTeX parsing requires the antlr4 Python package ... version 4.11")

    minerva_math.latex_parser.cache_clear()
    monkeypatch.setattr(sympy.parsing.latex, "parse_latex", unusable)
    try:
        with pytest.raises(ImportError, match=r"pip install 'antlr4-python3-runtime==4\.11\.0'"):
            evaluate_generative(MINERVA_MATH500, GenerativeEvalConfig(**common, data=data / "crafted"))
    finally:
        minerva_math.latex_parser.cache_clear()
    assert not (tmp_path / "out").exists()


def test_sample_data_is_both_layouts(data):
    runs = build_runs(MINERVA_MATH, list(MINERVA_MATH.tasks), data / "sample" / "minerva-math", 4, None)
    assert [len(run.docs) for run in runs] == [3] * 7
    (math500,) = build_runs(MINERVA_MATH500, [MINERVA_MATH500_TASK], data / "sample" / "minerva-math500", 4, None)
    assert len(math500.docs) == 12 and all(d.target for run in [*runs, math500] for d in run.docs)
    rows = [json.loads(line) for line in (data / "sample" / "minerva-math500" / "test.jsonl").read_text().splitlines()]
    assert [normalize_final_answer(r["answer"]) for r in rows] == [d.target for d in math500.docs]


# --- against the real lm-evaluation-harness ----------------------------------------------------------

PARROT = " Final Answer: The final answer is $7$. I hope it is correct."
AGREEMENT = ["$\\boxed{7}$", "$x = \\boxed{\\frac{14}{2}}$", "It is $\\boxed{8}$.", "$\\boxed{7 \\text{ apples}}$",
             "$\\boxed{(7, 1)}$", "$\\boxed{x=7}$"]
"""Golds the parrot's 7 matches by both metrics, neither, or math_verify only."""


CHAT = {"apply_chat_template": True, "system_instruction": "Solve the problem."}


@pytest.mark.slow
@pytest.mark.parametrize("chat", [{}, CHAT], ids=["plain", "chat"])
def test_minerva_math500_agrees_with_lm_eval(sample_assets, tmp_path, chat):
    """A model that answers PARROT (one token of its tokenizer) to everything: the same
    contexts (cut from the left: 4 exemplars are longer than its 1024 positions), texts,
    answers, both scores per document, and both metrics with their standard errors; plain and
    under the chat template with a system instruction (the exemplars as turns)."""
    model = parrot_model(sample_assets() / "model", tmp_path / "parrot", PARROT, added_tokens=(PARROT,))
    data = tmp_path / "math500"
    write_jsonl(data / "test.jsonl", [math500_row(n, s) for n, s in enumerate(AGREEMENT)])
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    harness_task(tasks, "llmflow_minerva_math500", "minerva_math/minerva_math500.yaml", {"test": data / "test.jsonl"},
                 "json")
    run_harness(model, "llmflow_minerva_math500", tasks, tmp_path / "harness", limit=5, max_gen_toks=8, chat=chat)
    config = GenerativeEvalConfig(model=model, data=data, out=tmp_path / "ours", limit=5, max_new_tokens=8,
                                  batch_size=3, device="cpu", **chat)
    out = evaluate_generative(MINERVA_MATH500, config)
    results, predictions = outputs(out)
    (run,) = build_runs(MINERVA_MATH500, [MINERVA_MATH500_TASK], data, 4, 5, PromptRenderer.for_model(config, model))
    utils = harness_utils()
    theirs = harness_samples(tmp_path / "harness", "llmflow_minerva_math500")
    assert len(theirs) == len(predictions) == 5
    for sample, pred, context in zip(theirs, predictions, run.contexts):
        assert sample["filter"] == "none" and sample["arguments"]["gen_args_0"]["arg_0"] == context
        assert sample["resps"][0][0] == sample["filtered_resps"][0] == pred["generated"] == PARROT
        assert sample["target"] == pred["gold"]
        assert pred["answer"] == utils.normalize_final_answer(utils.get_unnormalized_answer(pred["generated"]))
        assert (sample["exact_match"], sample["math_verify"]) == (pred["exact_match"], pred["math_verify"])
        assert pred["truncated"]
    assert [(p["exact_match"], p["math_verify"]) for p in predictions] == [
        (True, True), (True, True), (False, False), (False, True), (False, False)]
    expected = harness_results(tmp_path / "harness")["llmflow_minerva_math500"]
    task = results["tasks"]["minerva_math500"]
    for metric in ("exact_match", "math_verify"):
        assert task[metric] == pytest.approx(expected[f"{metric},none"], abs=1e-12)
        assert task[f"{metric}_stderr"] == pytest.approx(expected[f"{metric}_stderr,none"], abs=1e-12)
    assert results["headline"] == {"metric": "exact_match", "average": None, "value": task["exact_match"],
                                   "stderr": task["exact_match_stderr"]}
    assert task["generation"]["until"][0] == "Problem:" and task["version"] == "3.1"
    assert (results["benchmark"], results["harness_task"]) == ("minerva-math500", "minerva_math500")


@pytest.mark.slow
def test_the_minerva_math_group_agrees_with_lm_eval(sample_assets, tmp_path):
    """Two subjects of the sample's MATH as the harness's minerva_math group (its own yaml, the
    task list cut to them): each task's texts and scores, and the group's size-weighted means
    of both metrics."""
    answer = " Final Answer: The final answer is $40$. I hope it is correct."  # one problem of each is 40
    model = parrot_model(sample_assets() / "model", tmp_path / "parrot", answer, added_tokens=(answer,))
    data = sample_assets() / "minerva-math"
    names = ["minerva_math_algebra", "minerva_math_num_theory"]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for task in (t for t in MINERVA_MATH.tasks if t.name in names):
        harness_task(tasks, f"llmflow_{task.name}", f"minerva_math/{task.name}.yaml",
                     {"test": next((data / task.subdir).glob("test-*.parquet"))})
    group = yaml.safe_load((harness_tasks() / "benchmarks" / "minerva_math.yaml").read_text())
    group.update(group="llmflow_minerva_math", task=[f"llmflow_{n}" for n in names])
    (tasks / "llmflow_minerva_math.yaml").write_text(json.dumps(group))
    run_harness(model, "llmflow_minerva_math", tasks, tmp_path / "harness", max_gen_toks=8)
    out = evaluate_generative(MINERVA_MATH, GenerativeEvalConfig(model=model, data=data, out=tmp_path / "ours",
                                                                 tasks=names, max_new_tokens=8, device="cpu"))
    results, predictions = outputs(out)
    expected = harness_results(tmp_path / "harness")
    for name in names:
        theirs = harness_samples(tmp_path / "harness", f"llmflow_{name}")
        mine = [p for p in predictions if p["task"] == name]
        assert [s["resps"][0][0] for s in theirs] == [p["generated"] for p in mine]
        assert [(s["exact_match"], s["math_verify"]) for s in theirs] == [(p["exact_match"], p["math_verify"])
                                                                        for p in mine]
    for metric in ("exact_match", "math_verify"):
        assert results["group"][metric]["micro"] == pytest.approx(expected["llmflow_minerva_math"][f"{metric},none"],
                                                                   abs=1e-12)
    assert results["group"]["exact_match"]["micro"] == pytest.approx(2 / 6)
