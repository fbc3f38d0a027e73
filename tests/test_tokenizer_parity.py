"""Text becomes the ids transformers' AutoTokenizer makes, for every kind of tokenizer directory:
through ``llmflow tokenize pretrain`` and ``tokenize instruction`` (read back from their
outputs), MMLU requests (as lm-evaluation-harness's hf backend encodes them), generation and
chat prompts (as ``tokenizer(prompt)`` and ``apply_chat_template`` encode them).

Tokenizers: the built-in sample's (its model and tokenizer directories), a byte-level BPE
saved by transformers as the other tests build them, the same files beside a qwen2
config.json (transformers then swaps in Qwen2's pre-tokenizer), and two published Mistral
SentencePiece tokenizers shipped in the mistral-common package (Mistral 7B v0.1 and v0.3;
BOS added by default), laid out as their Hub repositories lay them out. The tokenizer files
are copied from the installed package at test time, never committed."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from llmflow.cli import main
from llmflow.data.indexed import IndexedDataset
from llmflow.data.templates import QWEN, load_template
from llmflow.data.tokenize_instruction import IGNORE_INDEX
from llmflow.data.tokenize_instruction import output_paths as instruction_paths
from llmflow.data.tokenize_pretrain import output_paths as pretrain_paths
from llmflow.data.tokenizer import TokenizeError, load_tokenizer
from llmflow.evaluate.prompts import CONTINUATIONS
from llmflow.evaluate.scoring import model_requests
from llmflow.infer.batch import encode
from llmflow.infer.generate import encode_prompts

TEXTS = [
    "The answer is (B) 1999.",
    "Prices rose 12.5% in 2023, from $1,234,567 to $9,876,543.21 (+0.07).",
    "tabs\t\tand   three spaces,\n\n\nblank lines  \n   and trailing spaces   ",
    "中文文本：北京是中国的首都，人口约2189万。日本語のテキストも。한국어 문장.",
    "emoji 🙂👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✨sparkles✨",
    "accents: café naïve Ångström façade jalapeño Øresund ß İstanbul",
    "decomposed: cafe\u0301 n\u0303 A\u030a (NFC and NFKC differ from the raw text)",
    "ligatures ﬁ ﬂ, fullwidth ＡＢＣ１２３, superscripts x² ½",
    "mixed 123abc456 a1b2c3 0x1F 3.14159 1e-10 -42",
    "  leading spaces and a final newline\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 1999 + 27?"}, {"role": "assistant", "content": "2026, café ☕."}],
    [{"role": "user", "content": "北京 2189万?"}, {"role": "assistant", "content": "是的  👍🏽"},
     {"role": "user", "content": "tabs\t\tthen 42"}, {"role": "assistant", "content": "Ångström 3.14\n\nok"}],
]
MISTRAL_FILES = {"mistral-7b-v0.1": "tokenizer.model.v1", "mistral-7b-v0.3": "mistral_instruct_tokenizer_240323.model.v3"}


def _bpe_dir(directory: Path) -> Path:
    """A byte-level BPE trained on TEXTS and saved by transformers, as the tokenization tests
    build theirs (no config.json: transformers loads tokenizer.json as it is)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 4 + [m["content"] for c in CONVERSATIONS for m in c] * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = QWEN
    hf.save_pretrained(directory)
    return directory


def _mistral_dir(directory: Path, package_file: str) -> Path:
    """A Mistral 7B tokenizer directory as its Hub repository has it: the SentencePiece model,
    a tokenizer_config.json (LlamaTokenizer, BOS added) and a config.json of model_type mistral."""
    data = pytest.importorskip("mistral_common").__path__[0]
    directory.mkdir(parents=True)
    shutil.copyfile(Path(data) / "data" / package_file, directory / "tokenizer.model")
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 32768}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}))
    return directory


@pytest.fixture(scope="module")
def sample(sample_assets) -> Path:
    return sample_assets(test_questions=2, instruct_rows=20, documents=10)


KINDS = ["sample-model", "sample-tokenizer", "bpe", "bpe-qwen2", *MISTRAL_FILES]


@pytest.fixture(scope="module", params=KINDS)
def tok_dir(request, sample, tmp_path_factory) -> Path:
    kind = request.param
    if kind.startswith("sample-"):
        return sample / kind.removeprefix("sample-")
    root = tmp_path_factory.mktemp("tok")
    if kind in MISTRAL_FILES:
        return _mistral_dir(root / kind, MISTRAL_FILES[kind])
    directory = _bpe_dir(root / kind)
    if kind == "bpe-qwen2":
        (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    return directory


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _template(tok_dir: Path) -> str | None:
    """The tokenizer's own chat template, or a named one for tokenizers without one."""
    return None if "mistral" not in tok_dir.name else "llama2"


def test_pretrain_ids_equal_autotokenizer(tok_dir, hf, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS), encoding="utf-8")
    for special, workers in ((False, 2), (True, 1)):
        out = tmp_path / f"ds-{special}"
        args = ["tokenize", "pretrain", "--input", str(src), "--tokenizer", str(tok_dir), "--out", str(out),
                "--append-eod", "--workers", str(workers), "--batch-size", "3"]
        main(args + (["--add-special-tokens"] if special else []))
        ds = IndexedDataset(pretrain_paths(out)["prefix"])
        got = [ds[i].tolist() for i in range(len(ds))]
        want = [hf(t, add_special_tokens=special)["input_ids"] + [hf.eos_token_id] for t in TEXTS]
        assert got == want, f"add_special_tokens={special}"
    if hf.bos_token_id is not None and hf("x")["input_ids"][0] == hf.bos_token_id:
        assert got[0][0] == hf.bos_token_id  # asked for, the tokenizer's BOS leads every document


def test_instruction_ids_equal_apply_chat_template(tok_dir, hf, tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in CONVERSATIONS), encoding="utf-8")
    out = tmp_path / "sft"
    template = _template(tok_dir)
    main(["tokenize", "instruction", "--input", str(src), "--tokenizer", str(tok_dir), "--out", str(out),
          "--format", "messages", "--seq-length", "1024", "--workers", "2", "--batch-size", "1"]
         + (["--template", template] if template else []))
    ids = IndexedDataset(instruction_paths(out)["input_ids"])
    labels = IndexedDataset(instruction_paths(out)["labels"])
    source = load_template(tok_dir, template).source
    for i, conversation in enumerate(CONVERSATIONS):
        want = hf.apply_chat_template(conversation, chat_template=source, tokenize=True, return_dict=False)
        assert ids[i].tolist() == want
        trained = labels[i] != IGNORE_INDEX
        assert (labels[i][trained] == ids[i][trained]).all() and 0 < trained.sum() < len(want)
        reply = hf.decode(ids[i][trained].tolist(), skip_special_tokens=True)
        for message in conversation[1::2]:
            assert unicodedata.normalize("NFKC", message["content"]).strip() in unicodedata.normalize("NFKC", reply)


def _lm_eval_requests(hf, contexts: list[str]) -> list[tuple[list[int], list[list[int]]]]:
    """lm-evaluation-harness's hf backend (lm_eval/models/huggingface.py ``tok_encode`` with
    add_bos_token unset, lm_eval/api/model.py ``_encode_pair`` for causal models), written out."""
    prefix_id = hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id

    def tok_encode(string: str) -> list[int]:
        kwargs = {"add_special_tokens": False} if string.startswith(hf.decode(prefix_id)) else {}
        return hf.encode(string, **kwargs)

    requests = []
    for context in contexts:
        continuations = []
        for continuation in CONTINUATIONS:
            n = len(context) - len(context.rstrip())
            ctx, cont = (context[:-n], context[-n:] + continuation) if n else (context, continuation)
            whole, context_enc = tok_encode(ctx + cont), tok_encode(ctx)
            continuations.append(whole[len(context_enc):])
        requests.append((context_enc, continuations))
    return requests


def test_eval_requests_equal_lm_eval(tok_dir, hf):
    contexts = [f"The following are multiple choice questions (with answers).\n\n{t}\nA. 1\nB. 2\nAnswer:" for t in TEXTS]
    chat = load_template(tok_dir, _template(tok_dir))
    contexts += [chat.render([{"role": "user", "content": contexts[0]}], add_generation_prompt=True)]
    got = [(r.context, r.continuations) for r in model_requests(tok_dir, contexts, [CONTINUATIONS] * len(contexts))]
    assert got == _lm_eval_requests(hf, contexts)
    if hf.encode("x")[0] == hf.bos_token_id:  # Llama/Mistral style: every plain context starts with BOS, once
        assert all(r[0][0] == hf.bos_token_id and r[0][1] != hf.bos_token_id for r in got)


def test_generation_and_chat_prompts_equal_transformers(tok_dir, hf):
    tokenizer = load_tokenizer(tok_dir)
    assert encode_prompts(tokenizer, TEXTS) == [hf(t)["input_ids"] for t in TEXTS]
    template = load_template(tok_dir, _template(tok_dir))
    conversations = [c[:-1] for c in CONVERSATIONS]
    want = [hf.apply_chat_template(c, chat_template=template.source, add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for c in conversations]
    assert encode(tokenizer, conversations, template, wrap_text=True) == want
    assert encode(tokenizer, TEXTS[:1], None, wrap_text=False) == [hf(TEXTS[0])["input_ids"]]


def test_sample_tokenizer_json_says_what_transformers_does(sample):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    for name in ("model", "tokenizer"):
        hf = AutoTokenizer.from_pretrained(sample / name)
        raw = Tokenizer.from_file(str(sample / name / "tokenizer.json"))
        assert type(hf).__name__ == "Qwen2Tokenizer"
        for text in TEXTS:
            assert raw.encode(text).ids == hf(text)["input_ids"]


def test_checkpoint_tokenizer_folder_tokenizes_as_its_model(make_hf_model, tmp_path):
    """A checkpoint's tokenizer/ folder has no config.json; transformers picks Qwen2's tokenizer
    by the model type, so the checkpoint's ids must still be those of the model directory."""
    from transformers import AutoTokenizer

    _, model_dir = make_hf_model("qwen2", vocab_size=640)
    _bpe_dir(model_dir)
    main(["convert", "--hf", str(model_dir), "--out", str(tmp_path / "ckpt")])
    want = AutoTokenizer.from_pretrained(model_dir)
    assert type(want).__name__ == "Qwen2Tokenizer"
    tokenizer = load_tokenizer(tmp_path / "ckpt" / "tokenizer")
    assert [e.ids for e in tokenizer.encode_batch(TEXTS)] == [want(t)["input_ids"] for t in TEXTS]
    assert np.any([want(t)["input_ids"] != load_tokenizer(_bpe_dir(tmp_path / "plain")).encode(t).ids for t in TEXTS])


def test_a_directory_transformers_cannot_load_is_named(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{")
    with pytest.raises(TokenizeError, match=r"broken: transformers' AutoTokenizer cannot load it: .+"):
        load_tokenizer(tmp_path / "broken")
