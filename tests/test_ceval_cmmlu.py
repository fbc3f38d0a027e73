"""C-Eval and CMMLU on the multiple-choice engine: both published layouts of each, prompts
character for character as lm-evaluation-harness's ceval-valid and cmmlu tasks build them,
layout errors that name what was found, scores equal to full log-likelihood scoring, and
results written by the commands. The data sets are a few generated questions per subject,
written here in each layout."""

from __future__ import annotations

import csv
import io
import json
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from llmflow.cli import main
from llmflow.data.tokenizer import load_tokenizer
from llmflow.evaluate.benchmarks import CEVAL, CMMLU, Benchmark
from llmflow.evaluate.chat_context import ChatSettings, PromptRenderer
from llmflow.evaluate.engine import EvalConfig, evaluate, prompts_for, select_questions
from llmflow.evaluate.prompts import CONTINUATIONS, continuations
from llmflow.evaluate.questions import BenchmarkDataError
from llmflow.evaluate.scoring import model_requests, score_loglikelihood
from llmflow.weights import load_model

# Subjects and their Chinese names as lm-evaluation-harness's _generate_configs.py lists them.
CEVAL_NAMES = {"computer_network": "计算机网络", "logic": "逻辑学"}
CMMLU_NAMES = {"agronomy": "农学", "arts": "艺术学"}
CEVAL_HEADER = ["id", "question", "A", "B", "C", "D", "answer", "explanation"]


def make_rows(subject: str, split: str, n: int) -> list[dict]:
    """C-Eval-style rows; the text has what CSV must quote and what doc_to_text strips."""
    return [
        {"id": i, "question": f"  {subject}（{split}）第{i}题：他说\"1,{i}\"，\n下一行____？ ", "A": f"{i + 1}",
         "B": f" 选项,{i}", "C": "三", "D": "四 ", "answer": "ABCD"[(i + len(subject)) % 4], "explanation": ""}
        for i in range(n)
    ]


def rows_for(splits: tuple[str, ...], names: dict[str, str]) -> dict[str, dict[str, list[dict]]]:
    sizes = {"dev": 3, "val": 3, "test": 3}
    return {split: {s: make_rows(s, split, sizes[split]) for s in names} for split in splits}


def lm_eval_prompt(description: str, doc: dict, dev: list[dict], k: int, question: str, answer: str) -> str:
    """lm-evaluation-harness's ceval-valid / cmmlu task from its YAML: description + k x
    (doc_to_text + target_delimiter " " + choice + fewshot_delimiter "\\n\\n") + doc_to_text,
    doc_to_text = "{{question.strip()}}\\nA. {{A}}\\nB. {{B}}\\nC. {{C}}\\nD. {{D}}\\n答案："."""

    def doc_to_text(d: dict) -> str:
        return f"{d[question].strip()}\nA. {d['A']}\nB. {d['B']}\nC. {d['C']}\nD. {d['D']}\n答案："

    return description + "".join(doc_to_text(d) + " " + d[answer] + "\n\n" for d in dev[:k]) + doc_to_text(doc)


def write_ceval(root: Path, rows: dict, layout: str) -> Path:
    """ceval/ceval-exam's parquet folders, or the unpacked ceval-exam.zip's CSVs."""
    for split, subjects in rows.items():
        for subject, table in subjects.items():
            if layout == "parquet":
                (root / subject).mkdir(parents=True, exist_ok=True)
                pq.write_table(pa.Table.from_pylist(table), root / subject / f"{split}-00000-of-00001.parquet")
            else:
                (root / split).mkdir(parents=True, exist_ok=True)
                with open(root / split / f"{subject}_{split}.csv", "w", newline="", encoding="utf-8") as f:
                    writer = csv.DictWriter(f, CEVAL_HEADER)
                    writer.writeheader()
                    writer.writerows(table)
    return root


def cmmlu_csv(table: list[dict]) -> str:
    """A CMMLU CSV: the header ,Question,A,B,C,D,Answer, the row number first."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["", "Question", "A", "B", "C", "D", "Answer"])
    writer.writerows([[i, r["question"], r["A"], r["B"], r["C"], r["D"], r["answer"]] for i, r in enumerate(table)])
    return out.getvalue()


def write_cmmlu(root: Path, rows: dict, layout: str) -> Path:
    """The CMMLU CSV folders, or them inside a zip archive as haonan-li/cmmlu ships them."""
    root.mkdir(parents=True, exist_ok=True)
    files = {f"{split}/{subject}.csv": cmmlu_csv(table) for split, subjects in rows.items() for subject, table in subjects.items()}
    if layout == "zip":
        with zipfile.ZipFile(root / "cmmlu_v1_0_1.zip", "w") as z:
            for name, text in files.items():
                z.writestr(name, text)
    else:
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def ceval(tmp_path_factory) -> tuple[dict, Path, Path]:
    rows = rows_for(("dev", "val"), CEVAL_NAMES)
    root = tmp_path_factory.mktemp("ceval")
    return rows, write_ceval(root / "hub", rows, "parquet"), write_ceval(root / "csv", rows, "csv")


@pytest.fixture(scope="module")
def cmmlu(tmp_path_factory) -> tuple[dict, Path, Path]:
    rows = rows_for(("dev", "test"), CMMLU_NAMES)
    root = tmp_path_factory.mktemp("cmmlu")
    return rows, write_cmmlu(root / "csv", rows, "csv"), write_cmmlu(root / "hub", rows, "zip")


@pytest.fixture(scope="module")
def sample(sample_assets) -> Path:
    return sample_assets(test_questions=2, instruct_rows=20, documents=10)


@pytest.mark.parametrize("shots", [0, 2])
def test_prompts_equal_lm_eval_templates(ceval, cmmlu, shots):
    cases = [
        (CEVAL, ceval, "val", "以下是中国关于{}的单项选择题，请选出其中的正确答案。\n\n", CEVAL_NAMES),
        (CMMLU, cmmlu, "test", "以下是关于{}的单项选择题，请直接给出正确答案的选项。\n\n", CMMLU_NAMES),
    ]
    for benchmark, (rows, first, second), split, description, names in cases:
        for path in (first, second):
            data = benchmark.load(path)
            questions = select_questions(benchmark, data, None)
            prompts = prompts_for(benchmark, questions, data, shots)
            docs = [(s, doc) for s in sorted(names) for doc in rows[split][s]]
            assert len(prompts) == len(docs) == 6
            for prompt, (subject, doc) in zip(prompts, docs):
                expected = lm_eval_prompt(description.format(names[subject]), doc, rows["dev"][subject], shots,
                                          "question", "answer")
                assert prompt == expected
            assert prompts[0].count("答案：") == shots + 1


def test_layouts_read_the_same_questions(ceval, cmmlu):
    _, hub, unpacked = ceval
    assert (CEVAL.load(hub).layout, CEVAL.load(unpacked).layout) == ("ceval/ceval-exam", "csv")
    assert CEVAL.load(hub).splits == CEVAL.load(unpacked).splits
    assert set(CEVAL.load(hub).splits) == {"dev", "val"}
    _, folders, archive = cmmlu
    assert (CMMLU.load(folders).layout, CMMLU.load(archive).layout) == ("csv", "zip")
    assert CMMLU.load(folders).splits == CMMLU.load(archive).splits
    picked = CMMLU.load(archive, ["arts"])
    assert list(picked.splits["test"]) == list(picked.splits["dev"]) == ["arts"]
    q = picked.splits["test"]["arts"][1]
    assert q.question == make_rows("arts", "test", 3)[1]["question"] and q.choices[1] == " 选项,1"


def test_layout_errors_name_what_was_found(tmp_path):
    bad = tmp_path / "ceval"
    (bad / "val").mkdir(parents=True)
    (bad / "val" / "logic_val.csv").write_text("id,题目,A,B,C,D,答案\n0,q,a,b,c,d,A\n", encoding="utf-8")
    with pytest.raises(BenchmarkDataError, match=r"logic_val.csv: columns \['id', '题目', 'A', 'B', 'C', 'D', '答案'\] "
                                                 r"lack \['question', 'answer'\]"):
        CEVAL.load(bad)
    (bad / "val" / "logic_val.csv").write_text("id,question,A,B,C,D,answer\n0,q,a,b,c,d,A\n1,q,a,b,c,d,E\n")
    with pytest.raises(BenchmarkDataError, match=r"logic_val.csv row 2: expected .* answer letter A-D"):
        CEVAL.load(bad)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("?")
    with pytest.raises(BenchmarkDataError, match=r"CMMLU data .*: no test questions; found \[notes.txt\]; expected"):
        CMMLU.load(tmp_path / "other")
    (bad / "val" / "logic_val.csv").write_text("id,question,A,B,C,D,answer\n0,q,a,b,c,d,A\n")
    assert CEVAL.load(bad).splits["val"]["logic"][0].answer == 0
    with pytest.raises(BenchmarkDataError, match=r"no subjects \['nope'\]; it has \['logic'\]"):
        CEVAL.load(bad, ["nope"])


@torch.no_grad()
def reference_scores(benchmark: Benchmark, sample: Path, data_path: Path, shots: int, chat: bool) -> torch.Tensor:
    """Every question's four continuations scored one (context, continuation) sequence at a time."""
    data = benchmark.load(data_path)
    renderer = PromptRenderer(ChatSettings(apply_chat_template=chat), sample / "model")
    prompts = prompts_for(benchmark, select_questions(benchmark, data, 2), data, shots, renderer)
    requests = model_requests(sample / "model", prompts, [continuations(renderer)] * len(prompts))
    model = load_model(sample / "model")[0].eval()
    return score_loglikelihood(model, requests, batch_size=1, max_length=1024)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_ceval_command_writes_results_scored_as_loglikelihood(sample, ceval, tmp_path, capsys):
    _, hub, _ = ceval
    out = tmp_path / "ceval"
    main(["eval", "ceval", "--model", str(sample / "model"), "--data", str(hub), "--out", str(out),
          "--shots", "2", "--limit", "2", "--batch-size", "3"])
    printed = capsys.readouterr().out
    assert "[Humanities]" in printed and "computer_network" in printed and "[all]" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["benchmark"] == "ceval" and results["settings"]["split"] == "val"
    assert results["questions"] == 4 and results["single_pass_questions"] == 4
    assert {s: v["category"] for s, v in results["subjects"].items()} == {"computer_network": "STEM", "logic": "Humanities"}
    assert list(results["categories"]) == ["STEM", "Humanities"]
    rows = read_jsonl(out / "predictions.jsonl")
    assert [(r["subject"], r["index"]) for r in rows] == [("computer_network", 0), ("computer_network", 1),
                                                          ("logic", 0), ("logic", 1)]
    scores = torch.tensor([r["scores"] for r in rows])
    torch.testing.assert_close(scores, reference_scores(CEVAL, sample, hub, 2, False), atol=1e-4, rtol=1e-4)
    answers = ["ABCD"[(i + len(s)) % 4] for s in ("computer_network", "logic") for i in range(2)]
    assert [r["answer"] for r in rows] == answers
    assert [r["prediction"] for r in rows] == ["ABCD"[i] for i in scores.argmax(1).tolist()]
    assert results["correct"] == sum(r["correct"] for r in rows) == sum(p == a for p, a in zip(
        [r["prediction"] for r in rows], answers))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "eval-ceval" and manifest["accuracy"] == results["accuracy"]
    assert {f["path"] for f in manifest["files"]} == {"results.json", "predictions.jsonl"}


def test_cmmlu_letters_after_the_chinese_answer_prompt(sample, cmmlu, tmp_path):
    _, _, archive = cmmlu
    tokenizer = load_tokenizer(sample / "model")
    requests = model_requests(sample / "model", ["题目\n答案："], [CONTINUATIONS])
    assert requests[0].continuations == [tokenizer.encode(f" {x}", add_special_tokens=False).ids for x in "ABCD"]
    assert requests[0].single_token
    for chat, single_pass in ((False, 4), (True, 0)):
        out = evaluate(CMMLU, EvalConfig(model=sample / "model", data=str(archive), out=tmp_path / str(chat),
                                         shots=1, limit=2, apply_chat_template=chat))
        results = json.loads((out / "results.json").read_text())
        assert results["single_pass_questions"] == single_pass and results["settings"]["layout"] == "zip"
        assert list(results["categories"]) == ["Humanities", "Other"]
        scores = torch.tensor([r["scores"] for r in read_jsonl(out / "predictions.jsonl")])
        torch.testing.assert_close(scores, reference_scores(CMMLU, sample, archive, 1, chat), atol=1e-4, rtol=1e-4)


def test_hub_sources_fetch_only_the_files_read(hub, sample, ceval, cmmlu, tmp_path):
    (_, ceval_hub, _), (_, _, cmmlu_hub) = ceval, cmmlu
    hub.repos[("dataset", "ceval/ceval-exam")] = {
        **{p.relative_to(ceval_hub).as_posix(): p.read_bytes() for p in ceval_hub.rglob("*.parquet")},
        "logic/test-00000-of-00001.parquet": b"answers withheld: never fetched",
        "ceval-exam.zip": b"never fetched",
    }
    hub.repos[("dataset", "haonan-li/cmmlu")] = {
        "cmmlu_v1_0_1.zip": (cmmlu_hub / "cmmlu_v1_0_1.zip").read_bytes(), "README.md": b"never fetched",
    }
    common = {"model": sample / "model", "shots": 1, "limit": 1, "cache_dir": tmp_path / "cache"}
    cases = [(CEVAL, "ceval/ceval-exam", ceval_hub, ["logic"], {"logic/dev-00000-of-00001.parquet",
                                                                 "logic/val-00000-of-00001.parquet"}),
             (CMMLU, "haonan-li/cmmlu", cmmlu_hub, None, {"cmmlu_v1_0_1.zip"})]
    for benchmark, repo, local, subjects, needed in cases:
        fetched = evaluate(benchmark, EvalConfig(data=f"hf://{repo}", subjects=subjects, out=tmp_path / repo, **common))
        prefix = f"/datasets/{repo}/resolve/{hub.commit}/"
        assert {p[len(prefix):] for p in hub.file_gets() if p.startswith(prefix)} == needed
        same = evaluate(benchmark, EvalConfig(data=local, subjects=subjects, out=tmp_path / "local" / repo, **common))
        assert (fetched / "predictions.jsonl").read_text() == (same / "predictions.jsonl").read_text()
