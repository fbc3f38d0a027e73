"""BoolQ and AGIEval (English, multiple choice): their readers and errors, the harness's
seeded few-shot draws, and agreement with the real lm-evaluation-harness (``lm_eval --model hf``
on the same tiny local data and model): the same contexts character for character,
log-likelihoods within 1e-5 (or one float32 step of a sum past 100), the same predictions, and the same metrics and standard errors,
the agieval_en group's size-weighted average included."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness_runs import harness_results, harness_samples, harness_task, ours, run_harness
from parquet_rows import write_parquet

from llmflow.evaluate.choice_engine import ChoiceEvalConfig, evaluate_choices
from llmflow.evaluate.choice_tasks import AGIEVAL, BOOLQ, read_agieval, read_boolq
from llmflow.evaluate.fewshot import fewshot_indices
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.statistics import pooled_stderr, stderr_of_mean
from llmflow.evaluate.task_selection import select_tasks

WORDS = ["river", "stone", "lantern", "orchard", "violet", "harbor", "meadow", "copper", "whisper", "glacier", "canyon", "ember", "falcon", "prairie", "summit", "tundra", "willow", "cobalt", "quartz", "lagoon"]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def boolq_rows(rng: random.Random, n: int) -> list[dict]:
    """super_glue's rows: the passage starts with its title and " -- "."""
    return [{"question": sentence(rng, 6), "passage": f"{sentence(rng, 2).title()} -- {sentence(rng, 30).capitalize()}.",
             "idx": i, "label": rng.randint(0, 1)} for i in range(n)]


# Train rows that copy validation rows: under another idx (the harness keeps such a copy among
# the few-shot examples) and under the same idx (an equal row, which it leaves out).
COPY_ELSEWHERE = {"train": 5, "validation": 3}
COPY_SAME_IDX = 7


def agieval_rows(rng: random.Random, n: int, choices: int) -> list[dict]:
    rows = []
    for _ in range(n):
        options = [f"({'ABCDE'[j]}){sentence(rng, rng.randint(1, 4))}" for j in range(choices)]
        query = f"Q: {sentence(rng, 12)}? Answer Choices: {' '.join(options)}\nA: Among A through {'ABCDE'[choices - 1]}, the answer is"
        rows.append({"query": query, "choices": options, "gold": [rng.randrange(choices)]})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """BoolQ in aps/super_glue's layout and two AGIEval tasks in hails' layout."""
    root = tmp_path_factory.mktemp("choice-data")
    rng = random.Random(0)
    train, validation = boolq_rows(rng, 12), boolq_rows(rng, 10)
    train[COPY_ELSEWHERE["train"]] = validation[COPY_ELSEWHERE["validation"]] | {"idx": COPY_ELSEWHERE["train"]}
    train[COPY_SAME_IDX] = validation[COPY_SAME_IDX]
    write_parquet(root / "boolq" / "boolq" / "train-00000-of-00001.parquet", train)
    write_parquet(root / "boolq" / "boolq" / "validation-00000-of-00001.parquet", validation)
    write_parquet(root / "agieval" / "agieval-lsat-ar" / "data" / "test-00000-of-00001.parquet", agieval_rows(rng, 7, 5))
    write_parquet(root / "agieval" / "agieval-sat-math" / "data" / "test-00000-of-00001.parquet", agieval_rows(rng, 9, 4))
    return root


# --- readers, selection, statistics ------------------------------------------------------------


def test_boolq_reads_the_super_glue_and_the_original_layouts_alike(data, tmp_path):
    hub = read_boolq(data / "boolq", "validation")
    assert len(hub) == 10 and hub[0].choices == ("no", "yes")
    assert hub[0].text.endswith("?\nAnswer:") and "\nQuestion: " in hub[0].text
    rows = pq.read_table(next((data / "boolq").rglob("validation-*.parquet"))).to_pylist()
    original = tmp_path / "dev.jsonl"
    # google/boolq keeps the title apart from the passage, in super_glue's order and without idx.
    original.write_text("".join(json.dumps({"question": r["question"], "title": r["passage"].split(" -- ")[0],
                                            "answer": bool(r["label"]), "passage": r["passage"].split(" -- ", 1)[1]})
                                + "\n" for r in rows))
    assert read_boolq(tmp_path, "validation") == hub
    assert [doc.row for doc in hub] == rows


def test_bad_rows_and_missing_splits_name_the_file_and_what_was_expected(data, tmp_path):
    bad = write_parquet(tmp_path / "boolq" / "validation-00000-of-00001.parquet",
                        [{"question": "q", "passage": "p", "idx": 0, "label": 1}, {"question": "q", "passage": "p",
                                                                                   "idx": 1, "label": 7}])
    with pytest.raises(BenchmarkDataError, match=rf"{bad} row 2: expected a passage, a question and a label 0/1"):
        read_boolq(tmp_path, "validation")
    with pytest.raises(BenchmarkDataError, match=r"no train split; found \[boolq/validation-00000-of-00001.parquet\]"):
        read_boolq(tmp_path, "train")
    wrong = write_parquet(tmp_path / "agieval-x" / "test-00000-of-00001.parquet", [{"question": "q", "answer": 1}])
    with pytest.raises(BenchmarkDataError, match=rf"{wrong}: columns \['question', 'answer'\] lack \['query', 'choices', 'gold'\]"):
        read_agieval(tmp_path / "agieval-x", "test")
    gold = write_parquet(tmp_path / "agieval-y" / "test-00000-of-00001.parquet",
                         [{"query": "q", "choices": ["(A)a", "(B)b"], "gold": [2]}])
    with pytest.raises(BenchmarkDataError, match=rf"{gold} row 1: expected .* gold, a non-empty list of choice indices"):
        read_agieval(tmp_path / "agieval-y", "test")


def test_fewshot_draws_are_the_harness_samplers():
    """lm-evaluation-harness's ContextSampler: one Random(seed) per task, and for each document
    ``sample(pool, n + 1)`` without the document (BoolQ's path), copies of it included."""
    from lm_eval.api.samplers import ContextSampler

    pool = [{"doc": i % 10} for i in range(12)]  # documents 0 and 1 twice
    docs = [{"doc": i} for i in (0, 1, 5, 11, 3, 0, 7, 1, 9, 2, 4, 8)]
    sampler = ContextSampler(pool, rnd=None).set_rnd(1234)
    theirs = [[pool.index(d) for d in sampler.sample(3, eval_doc=doc)] for doc in docs]
    mine = fewshot_indices(docs, pool, 3)
    assert [[pool[i] for i in m] for m in mine] == [[pool[i] for i in t] for t in theirs]
    assert all(docs[n] not in [pool[i] for i in m] for n, m in enumerate(mine))
    assert fewshot_indices(docs[:2], pool, 0) == [[], []]
    with pytest.raises(ValueError, match="12 shots asked for, the few-shot split has 12 documents"):
        fewshot_indices(docs[:1], pool, 12)


def test_boolq_fewshot_leaves_out_equal_rows_only_as_the_harness_does(data):
    """The harness compares whole rows: a train copy of the evaluated question under another idx
    stays among its examples, one under the same idx does not."""
    from lm_eval.api.samplers import ContextSampler

    def rows(split: str) -> list[dict]:
        return pq.read_table(next((data / "boolq").rglob(f"{split}-*.parquet"))).to_pylist()

    pool, docs = rows("train"), rows("validation")
    sampler = ContextSampler(pool, rnd=None).set_rnd(1234)
    theirs = [[pool.index(d) for d in sampler.sample(3, eval_doc=doc)] for doc in docs]
    mine = fewshot_indices(read_boolq(data / "boolq", "validation"), read_boolq(data / "boolq", "train"), 3)
    assert mine == theirs
    copy_elsewhere = COPY_ELSEWHERE["train"]
    assert copy_elsewhere in mine[COPY_ELSEWHERE["validation"]]
    assert COPY_SAME_IDX not in mine[COPY_SAME_IDX]


def test_standard_errors_are_the_harness_formulas():
    from lm_eval.api.metrics import mean_stderr, pooled_sample_stderr

    a, b = [1.0, 0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0]
    assert stderr_of_mean(a) == pytest.approx(mean_stderr(a), abs=1e-15)
    assert pooled_stderr([mean_stderr(a), mean_stderr(b)], [5, 3]) == pytest.approx(
        float(pooled_sample_stderr([mean_stderr(a), mean_stderr(b)], [5, 3])), abs=1e-15)
    assert stderr_of_mean([1.0]) is None


def test_agieval_refuses_shots_and_unknown_tasks_before_loading_the_model(data, tmp_path):
    common = {"model": tmp_path / "no-model", "data": data / "agieval", "out": tmp_path / "out"}
    with pytest.raises(ValueError, match="agieval_lsat_ar: shots=2, but lm-evaluation-harness runs it zero-shot"):
        evaluate_choices(AGIEVAL, ChoiceEvalConfig(**common, shots=2, tasks=["agieval_lsat_ar"]))
    with pytest.raises(ValueError, match=r"no tasks \['lsat'\]; its tasks are \['agieval_aqua_rat'"):
        evaluate_choices(AGIEVAL, ChoiceEvalConfig(**common, tasks=["lsat"]))
    with pytest.raises(BenchmarkDataError, match=r"no directory for tasks \['agieval_aqua_rat', 'agieval_gaokao_english', "
                                                 r".*evaluate the tasks it has with tasks=\['agieval_lsat_ar', 'agieval_sat_math'\]"):
        evaluate_choices(AGIEVAL, ChoiceEvalConfig(**common))
    assert not (tmp_path / "out").exists()


# --- against the real lm-evaluation-harness ----------------------------------------------------


def assert_same_documents(theirs: list[dict], mine: list[dict]) -> None:
    assert len(theirs) == len(mine)
    for sample, pred in zip(theirs, mine):
        lls = [float(r[0]) for r in sample["filtered_resps"]]
        # A continuation's token log-probabilities (fp32) are summed in float32 by the harness and
        # in double by llmflow: within 1e-5, or a few float32 steps (6e-8 relative each) of sums
        # past 50 (two steps measured at -81).
        assert pred["scores"] == pytest.approx(lls, rel=5e-7, abs=1e-5), sample["doc_id"]
        assert float(sample["acc"]) == pred["acc"]
        if "acc_norm" in sample:
            assert float(sample["acc_norm"]) == pred["acc_norm"]


@pytest.mark.slow
def test_boolq_with_shots_agrees_with_lm_eval(sample_assets, data, tmp_path):
    model = sample_assets() / "model"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    files = {split: next((data / "boolq").rglob(f"{split}-*.parquet")) for split in ("train", "validation")}
    harness_task(tasks, "llmflow_boolq", "super_glue/boolq/default.yaml", files)
    run_harness(model, "llmflow_boolq", tasks, tmp_path / "harness", shots=3)
    results, predictions = ours(tmp_path, "boolq", model, data / "boolq", "--shots", "3")
    theirs = harness_samples(tmp_path / "harness", "llmflow_boolq")
    # The harness's contexts, character for character: the same seeded few-shot draws.
    from llmflow.evaluate.choice_engine import build_runs

    (run,) = build_runs(BOOLQ, list(BOOLQ.tasks), data / "boolq",
                        ChoiceEvalConfig(model=model, data=data / "boolq", out=tmp_path / "x", shots=3))
    assert [s["arguments"]["gen_args_0"]["arg_0"] for s in theirs] == run.contexts
    assert [s["arguments"]["gen_args_1"]["arg_1"] for s in theirs] == [" yes"] * len(theirs)
    assert_same_documents(theirs, predictions)
    expected = harness_results(tmp_path / "harness")["llmflow_boolq"]
    task = results["tasks"]["boolq"]
    assert task["acc"] == pytest.approx(expected["acc,none"], abs=1e-12)
    assert task["acc_stderr"] == pytest.approx(expected["acc_stderr,none"], abs=1e-12)
    assert task["samples"] == 10 and task["fewshot"]["seed"] == 1234 and len(task["prompts_sha256"]) == 64
    assert results["headline"] == {"metric": "acc", "average": None, "value": task["acc"], "stderr": task["acc_stderr"]}


@pytest.mark.slow
def test_agieval_agrees_with_lm_eval_task_by_task_and_as_a_size_weighted_group(sample_assets, data, tmp_path):
    model = sample_assets() / "model"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    names = {"agieval_lsat_ar": "agieval-lsat-ar", "agieval_sat_math": "agieval-sat-math"}
    for name, directory in names.items():
        test = next((data / "agieval" / directory).rglob("test-*.parquet"))
        harness_task(tasks, f"llmflow_{name}", f"agieval/{directory.removeprefix('agieval-')}.yaml", {"test": test})
    # The agieval_en group's own aggregation (agieval/agieval_en.yaml) over these two tasks.
    (tasks / "llmflow_agieval_en.yaml").write_text(
        "group: llmflow_agieval_en\ntask:\n" + "".join(f"  - llmflow_{n}\n" for n in names)
        + "aggregate_metric_list:\n  - metric: acc\n    aggregation: mean\n    weight_by_size: true\n"
        + "  - metric: acc_norm\n    aggregation: mean\n    weight_by_size: true\n")
    run_harness(model, "llmflow_agieval_en", tasks, tmp_path / "harness", shots=None)
    results, predictions = ours(tmp_path, "agieval", model, data / "agieval", "--tasks", json.dumps(list(names)))
    expected = harness_results(tmp_path / "harness")
    for name in names:
        theirs = harness_samples(tmp_path / "harness", f"llmflow_{name}")
        assert_same_documents(theirs, [p for p in predictions if p["task"] == name])
        for metric in ("acc", "acc_norm"):
            assert results["tasks"][name][metric] == pytest.approx(expected[f"llmflow_{name}"][f"{metric},none"], abs=1e-12)
            assert results["tasks"][name][f"{metric}_stderr"] == pytest.approx(
                expected[f"llmflow_{name}"][f"{metric}_stderr,none"], abs=1e-12)
    group = expected["llmflow_agieval_en"]
    for metric in ("acc", "acc_norm"):
        assert results["group"][metric]["micro"] == pytest.approx(group[f"{metric},none"], abs=1e-12)
        assert results["group"][metric]["micro_stderr"] == pytest.approx(group[f"{metric}_stderr,none"], abs=1e-12)
    assert results["headline"]["average"] == "micro" and results["group"]["samples"] == 16


# --- in the flows ------------------------------------------------------------------------------


@pytest.mark.slow
def test_finetune_eval_scores_every_task_group_before_and_after_and_gates_on_agieval(prefect_env, monkeypatch,
                                                                                      tmp_path):
    from prefect_helpers import mlflow_runs, task_states

    from llmflow.flows.finetune_eval import FinetuneEvalParams, finetune_eval

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LLMFLOW_DEVICE", "cpu")
    params = FinetuneEvalParams.model_validate({
        "workspace": str(tmp_path / "ws"), "version": "test", "prompts": [], "registered_model": "test-choice",
        "train": {"steps": 2, "micro_batch_size": 4, "global_batch_size": 4, "save_interval": None},
        "benchmarks": ["boolq", "agieval", "gsm8k", "humaneval"], "gate_benchmark": "agieval", "register_min_gain": None,
        "benchmark_data": {"boolq": "sample", "agieval": "sample", "gsm8k": "sample", "humaneval": "sample"},
        "evaluation": {"limit": 6, "max_new_tokens": 48},
    })
    state = finetune_eval(**dict(params), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    states = task_states(state.state_details.flow_run_id)
    assert states["eval-boolq"] == ["Completed", "Completed"] and states["eval-agieval"] == ["Completed", "Completed"]
    assert states["eval-gsm8k"] == ["Completed", "Completed"] and 0 <= result["gsm8k_after"] <= 1
    assert states["eval-humaneval"] == ["Completed", "Completed"] and 0 <= result["humaneval_after"] <= 1
    assert "eval-mmlu" not in states and "register" in states
    outputs = {(p.name.startswith("base-"), json.loads((p / "results.json").read_text())["benchmark"]): p
               for p in (tmp_path / "ws" / "eval").iterdir()}
    agieval = json.loads((outputs[(False, "agieval")] / "results.json").read_text())
    assert result["agieval_after"] == agieval["headline"]["value"] == agieval["group"]["acc"]["micro"]
    assert result["gate"]["reason"].startswith(f"AGIEval {result['agieval_before']:.4f} -> {result['agieval_after']:.4f}")
    boolq_after = mlflow_runs(prefect_env, "eval-boolq")[-1]
    assert boolq_after.data.metrics["accuracy"] == result["boolq_after"]
    assert "acc_stderr/boolq" in boolq_after.data.metrics and boolq_after.data.metrics["samples"] == 6
    agieval_runs = mlflow_runs(prefect_env, "eval-agieval")
    assert len(agieval_runs) == 2
    assert {"acc_norm/agieval_sat_math", "acc/micro", "acc/macro", "acc_norm/micro_stderr"} <= set(agieval_runs[0].data.metrics)


def test_the_sample_tasks_of_the_groups_it_holds_in_part_are_their_groups_tasks():
    from llmflow.evaluate.generative_tasks import BBH
    from llmflow.evaluate.mmlu_pro import MMLU_PRO
    from llmflow.evaluate.task_groups import TASK_GROUPS
    from llmflow.flows.params import Benchmark
    from llmflow.flows.stages import SAMPLE_TASKS
    from llmflow.flows.summary import BENCHMARK_TITLES

    assert [t.name for t in select_tasks(AGIEVAL.title, AGIEVAL.tasks, SAMPLE_TASKS["agieval"])] == SAMPLE_TASKS["agieval"]
    assert [t.name for t in select_tasks(BBH.title, BBH.tasks, SAMPLE_TASKS["bbh"])] == SAMPLE_TASKS["bbh"]
    assert {t.name for t in select_tasks(MMLU_PRO.title, MMLU_PRO.tasks, SAMPLE_TASKS["mmlu-pro"])} == set(
        SAMPLE_TASKS["mmlu-pro"])
    assert set(TASK_GROUPS) == {"boolq", "agieval", "gsm8k", "bbh", "humaneval", "minerva-math500", "minerva-math",
                                "mmlu-pro", "gpqa-diamond", "ifeval"}
    assert set(BENCHMARK_TITLES) == set(Benchmark.__args__) == {"mmlu", "ceval", "cmmlu", *TASK_GROUPS}


def test_the_gate_benchmark_must_be_scored():
    from llmflow.flows.finetune_eval import FinetuneEvalParams

    with pytest.raises(ValueError, match=r"gate_benchmark='boolq' is not among benchmarks=\['mmlu'\]"):
        FinetuneEvalParams.model_validate({"gate_benchmark": "boolq"})
