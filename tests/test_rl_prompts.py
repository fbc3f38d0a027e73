"""The prompts of online RL (``llmflow.train.grpo.prompts``): every layout in JSON lines and
parquet, rendered to the ids transformers' ``apply_chat_template(..., add_generation_prompt=True)``
gives, bad rows refused naming the file and row, and the preflight's problem lines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmflow.data.readers import InputError
from llmflow.data.templates import CHATML
from llmflow.train.grpo.prompts import prompt_problems, read_prompt_rows, render_prompts

QUESTION = "What is 7 + 5?"
CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": QUESTION}]
LONG_CHAT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}, *CHAT[1:]]
LAYOUTS = {
    "gsm8k": ([{"question": QUESTION, "answer": "7 + 5 = 12\n#### 12"}, {"question": "How much is 3 + 4?", "answer": "#### 7"}],
              "question"),
    "math": ([{"problem": QUESTION, "solution": "$\\boxed{12}$", "level": "Level 1"},
              {"problem": "Compute 3 + 4.", "solution": "$\\boxed{7}$", "level": "Level 2"}], "problem"),
    "prompt": ([{"prompt": QUESTION, "answer": "12"}, {"prompt": "Compute 3 + 4.", "answer": "7"}], "prompt"),
    "conversational": ([{"prompt": CHAT, "test": "assert f() == 12", "entry_point": "f"},
                        {"prompt": LONG_CHAT, "test": "assert f() == 7", "entry_point": "f"}], "prompt"),
    "messages": ([{"messages": CHAT, "answer": "12"}, {"messages": LONG_CHAT, "answer": "12"}], "messages"),
}


@pytest.fixture(scope="module")
def tokenizer_dir(sample_assets) -> Path:
    return sample_assets() / "tokenizer"


@pytest.fixture(scope="module")
def hf_tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def write(path: Path, records: list[dict]) -> Path:
    """``records`` as a parquet table or as JSON lines, by ``path``'s suffix."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def chat_ids(hf_tok, prompt, **kw) -> list[int]:
    """transformers' reference: the prompt (text as the user's message) up to the assistant's turn header."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kw)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_reads_and_renders_as_apply_chat_template(tmp_path, tokenizer_dir, hf_tok, layout, suffix):
    records, column = LAYOUTS[layout]
    path = write(tmp_path / f"rl{suffix}", records)
    rows = read_prompt_rows(path)
    assert [r.index for r in rows] == [0, 1]
    assert [r.where for r in rows] == ([f"{path}: line 1", f"{path}: line 2"] if suffix == ".jsonl" else [f"{path}: row 0", f"{path}: row 1"])
    assert [r.prompt for r in rows] == [r[column] for r in records]
    assert [r.columns for r in rows] == records
    ids = render_prompts(rows, tokenizer_dir, None)
    assert ids == [r.prompt_ids for r in rows] == [chat_ids(hf_tok, r[column]) for r in records]
    assert render_prompts(rows, tokenizer_dir, "tokenizer") == ids
    assert render_prompts(rows, tokenizer_dir, "chatml") == [chat_ids(hf_tok, r[column], chat_template=CHATML) for r in records]


def test_rows_keep_every_column_and_are_located_by_line(tmp_path):
    """Blank lines are skipped but counted; a column only later rows have is kept for them."""
    path = tmp_path / "rl.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": 2, "hint": "even"}\n', encoding="utf-8")
    rows = read_prompt_rows(path)
    assert [(r.index, r.where) for r in rows] == [(0, f"{path}: line 1"), (1, f"{path}: line 3")]
    assert rows[1].columns == {"prompt": "b", "answer": 2, "hint": "even"}


BAD_ROWS = [
    ([{"question": 7, "answer": "7"}], "line 1: 'question' holds int, expected text (gsm8k layout)"),
    ([{"question": QUESTION, "answer": "12"}, {"answer": "7"}], "line 2: 'question' is missing, expected text (gsm8k layout)"),
    ([{"problem": [{"role": "user", "content": QUESTION}], "solution": "12"}], "line 1: 'problem' holds list, expected text (math layout)"),
    ([{"prompt": QUESTION, "answer": "12"}, {"prompt": " ", "answer": "1"}], "line 2: 'prompt' is an empty prompt (prompt layout)"),
    ([{"prompt": QUESTION}], "line 1: 'answer' is missing; a prompt row needs it beside a text 'prompt'"),
    ([{"prompt": {"text": QUESTION}, "answer": "12"}],
     "line 1: 'prompt' holds dict, expected text or a list of role/content messages (prompt layout)"),
    ([{"messages": QUESTION}], "line 1: 'messages' holds str, expected a list of role/content messages (messages layout)"),
    ([{"messages": [*CHAT, {"role": "assistant", "content": "12"}]}],
     "line 1: 'messages' must end with a user message, the one the model answers (got system -> user -> assistant)"),
    ([{"messages": []}], "line 1: 'messages' must end with a user message, the one the model answers (got no message)"),
    ([{"prompt": [{"role": "robot", "content": QUESTION}]}], "line 1: prompt[0] must be {'role': system|user|assistant, 'content': text}"),
    ([{"text": QUESTION, "label": "12"}],
     "line 1: no prompt column in the columns ['text', 'label']; the layouts are gsm8k (question, answer), math (problem, solution)"),
    ([], ": no rows, so no prompts"),
]


@pytest.mark.parametrize(("records", "message"), BAD_ROWS)
def test_bad_rows_name_the_file_and_row(tmp_path, records, message):
    path = write(tmp_path / "rl.jsonl", records)
    with pytest.raises(InputError) as error:
        read_prompt_rows(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value)


def test_bad_files(tmp_path):
    parquet = write(tmp_path / "rl.parquet", [{"question": QUESTION, "answer": "12"}, {"question": None, "answer": "7"}])
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": \n', encoding="utf-8")
    (tmp_path / "rl.csv").write_text("prompt,answer\na,1\n", encoding="utf-8")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    for path, message in [(parquet, "row 1: 'question' is missing"), (tmp_path / "bad.jsonl", "line 2: malformed JSON"),
                          (tmp_path / "rl.csv", "prompts must be JSON lines or parquet"),
                          (tmp_path / "broken.parquet", "not a readable parquet file"), (tmp_path / "none.jsonl", "no such file")]:
        with pytest.raises(InputError, match=message):
            read_prompt_rows(path)


def test_prompt_problems(tmp_path, tokenizer_dir, hf_tok):
    short, long = "What is 7 + 5?", "What is 7 + 5? " * 8
    path = write(tmp_path / "rl.jsonl", [{"prompt": short, "answer": "12"}, {"prompt": long, "answer": "12"}])
    lengths = [len(chat_ids(hf_tok, p)) for p in (short, long)]
    assert prompt_problems(path, tokenizer_dir, None, None) == [] == prompt_problems(path, tokenizer_dir, None, lengths[1])
    assert prompt_problems(path, tokenizer_dir, None, lengths[1] - 1) == [
        f"{path}: line 2: the prompt is {lengths[1]} tokens, over max_prompt_tokens {lengths[1] - 1}"
    ]

    bare = tmp_path / "bare"  # a tokenizer without a chat template, and a bad file: both reported
    shutil.copytree(tokenizer_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    bad = write(tmp_path / "bad.jsonl", [{"prompt": ""}])
    problems = prompt_problems(bad, bare, None, 8)
    assert len(problems) == 2
    assert problems[0].startswith(f"{bad}: line 1: 'prompt' is an empty prompt")
    assert f"tokenizer {bare} has no chat template" in problems[1]
    assert prompt_problems(path, tokenizer_dir, "nonesuch", None) == [
        "unknown template 'nonesuch'; expected one of tokenizer, alpaca, chatml, qwen, llama2, llama3"
    ]
    conversation = write(tmp_path / "turns.jsonl", [{"messages": [CHAT[1], CHAT[1]]}])
    assert prompt_problems(conversation, tokenizer_dir, "llama2", None) == [
        f"{conversation}: line 1: chat template 'llama2': Conversation roles must alternate user/assistant/user/assistant/..."
    ]


def test_the_sample_rl_prompts_read_in_the_prompt_layout(sample_assets, tokenizer_dir, hf_tok):
    rl = sample_assets() / "rl"
    for split in ("train", "heldout"):
        rows = read_prompt_rows(rl / f"rl_{split}.jsonl")
        assert [(r.prompt, r.columns) for r in rows] == [(r.prompt, r.columns) for r in read_prompt_rows(rl / f"rl_{split}.parquet")]
        assert all(r.columns == {"prompt": r.prompt, "answer": r.columns["answer"]} for r in rows)
        assert render_prompts(rows, tokenizer_dir, None) == [chat_ids(hf_tok, r.prompt) for r in rows]
