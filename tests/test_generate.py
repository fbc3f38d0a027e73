"""Generation with the KV cache: token-for-token parity with transformers' generate, batched
rows equal to single rows, sampling, stop strings, streaming, the CLI and the chat loop."""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from llmflow.data.tokenizer import load_tokenizer
from llmflow.infer import GenerateConfig, generate, stream_generate
from llmflow.weights import load_model

VOCAB = 320
EOS = "<|im_end|>"
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "ate", "fish", "while", "dogs", "ran", "over", "green", "hills", "near", "blue", "lakes", "ü", "é", "漢字"]


def add_tokenizer(directory: Path) -> None:
    """A byte-level BPE of fewer than VOCAB ids (eos <|im_end|>), as transformers saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([" ".join(rng.choices(WORDS, k=8)) for _ in range(200)], trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>")
    hf.save_pretrained(directory)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 12, 1)]


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int, eos: int) -> list[list[int]]:
    """transformers' greedy continuation of left-padded prompts, cut after the first eos."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=0,
    )[:, width:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in out]


EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
FAMILIES = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 24},
    # The decode step routes each new token as the prompt's tokens were routed.
    "qwen3_moe": {**EXPERTS, "head_dim": 24, "norm_topk_prob": True},
    "qwen2_moe": {**EXPERTS, "shared_expert_intermediate_size": 48},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("family, extra", list(FAMILIES.items()), ids=list(FAMILIES))
def test_greedy_matches_transformers_and_batched_equals_single(make_hf_model, prompt_ids, static_generate, family,
                                                               extra):
    hf_model, path = make_hf_model(family, vocab_size=VOCAB, num_key_value_heads=2, **extra)
    add_tokenizer(path)
    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    eos = 5
    config = GenerateConfig(max_new_tokens=12, eos_token_ids=[eos])
    batched = [r.tokens for r in generate(model, tokenizer, prompt_ids, config)]
    assert batched == hf_greedy(hf_model, prompt_ids, 12, eos)
    single = [generate(model, tokenizer, [p], config)[0].tokens for p in prompt_ids]
    assert batched == single
    assert static_generate(model, tokenizer, prompt_ids, config) == batched


@pytest.fixture
def llama(make_hf_model) -> Path:
    _, path = make_hf_model("llama", vocab_size=VOCAB, num_key_value_heads=2)
    add_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    return path


def test_checkpoint_generates_like_its_hf_model(llama, tmp_path, capsys):
    from llmflow.cli import main
    from llmflow.infer.generator import load_generator
    from llmflow.weights.convert import ConvertConfig, convert

    ckpt = convert(ConvertConfig(hf=llama, out=tmp_path / "ckpt", pad_vocab_to_multiple=256))
    hf, converted = load_generator(llama), load_generator(ckpt)
    assert converted.model.config.vocab_size > VOCAB == converted.vocab_size
    assert hf.eos_token_ids == converted.eos_token_ids == [7, 9]
    config = GenerateConfig(max_new_tokens=10)
    expected = hf.run(["the cat sat", "dogs"], config)
    assert [r.tokens for r in converted.run(["the cat sat", "dogs"], config)] == [r.tokens for r in expected]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the cat sat"}\n{"prompt": "dogs"}\n')
    main(["generate", "--model", str(ckpt), "--prompts", str(prompts), "--max-new-tokens", "10"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["completion"] for line in lines] == [r.text for r in expected]


def test_sampling_is_seeded(llama, static_generate):
    from llmflow.infer.generator import load_generator

    gen = load_generator(llama)
    sample = GenerateConfig(max_new_tokens=16, temperature=1.3, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=3)
    first = [r.tokens for r in gen.run(["the cat", "blue lakes near"], sample)]
    assert first == [r.tokens for r in gen.run(["the cat", "blue lakes near"], sample)]
    assert first == static_generate(gen.model, gen.tokenizer, ["the cat", "blue lakes near"], sample)
    assert first != [r.tokens for r in gen.run(["the cat", "blue lakes near"], sample.model_copy(update={"seed": 4}))]
    assert first != [r.tokens for r in gen.run(["the cat", "blue lakes near"], GenerateConfig(max_new_tokens=16))]


def test_repetition_penalty_and_top_k_top_p_follow_transformers():
    from transformers import (
        RepetitionPenaltyLogitsProcessor,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from llmflow.infer.generate import apply_repetition_penalty
    from llmflow.models.sampling import filter_top_k_top_p

    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(3, 50, generator=g), torch.randint(0, 50, (3, 6), generator=g)
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter(1, ids, True)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.3), expected)
    expected = TopPLogitsWarper(0.7)(ids, TopKLogitsWarper(10)(ids, logits.clone()))
    torch.testing.assert_close(filter_top_k_top_p(logits, 10, 0.7), expected)


def test_stop_strings_and_streamed_text(llama):
    from llmflow.infer.generate import safe_text
    from llmflow.infer.generator import load_generator

    gen = load_generator(llama)
    config = GenerateConfig(max_new_tokens=24, eos_token_ids=[])
    full = gen.run(["the cat sat", "green"], config)[0].text
    stop = full[6:8]
    stopped = gen.run(["the cat sat", "green"], config.model_copy(update={"stop": [stop]}))[0]
    assert stopped.finish_reason == "stop" and stopped.text == full[: full.find(stop)]

    for cfg in (config.model_copy(update={"stop": [stop]}), GenerateConfig(max_new_tokens=24, temperature=1.0, seed=1)):
        deltas: dict[int, list[str]] = {0: [], 1: []}
        results = gen.run(["the cat sat", "漢字 ü"], cfg, on_text=lambda row, text, d=deltas: d[row].append(text))
        assert ["".join(deltas[i]) for i in (0, 1)] == [r.text for r in results]
        assert sum(len(d) for d in deltas.values()) > 2
        events = list(stream_generate(gen.model, gen.tokenizer, ["the cat sat"], cfg))
        assert "".join(e.text for e in events) == events[-1].result.text

    one_byte = gen.tokenizer.decode(gen.tokenizer.encode("漢").ids[:1])
    assert one_byte.endswith("\ufffd") and safe_text("ok" + one_byte, []) == "ok"
    assert safe_text("abc</s", ["</stop>"]) == "abc"


def test_the_stop_window_finds_a_stop_string_when_the_whole_text_does(llama):
    """Token by token, a window of the last tokens sees a stop string at the same token as the
    whole text's decoding: multi-byte characters split across tokens, special tokens between
    a stop string's tokens, stop strings that start with a space."""
    from llmflow.infer.generate import _Row, _stopped, special_ids

    tokenizer = load_tokenizer(llama)
    special = special_ids(tokenizer)
    assert {tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", EOS)} <= special
    rng = random.Random(3)
    for _ in range(200):
        words = rng.choices(WORDS, k=12)
        tokens = tokenizer.encode(" ".join(words)).ids
        for _ in range(rng.randint(0, 4)):
            tokens.insert(rng.randrange(len(tokens) + 1), rng.choice(sorted(special)))
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        start = rng.randrange(len(text))
        stops = [text[start : start + rng.randint(1, 8)], "never there"]
        whole = next(n for n in range(1, len(tokens) + 1)
                     if any(s in tokenizer.decode(tokens[:n], skip_special_tokens=True) for s in stops))
        windowed = next(n for n in range(1, len(tokens) + 1) if _stopped(tokenizer, _Row([], tokens[:n]), stops, special))
        assert windowed == whole, (tokens, stops)


def test_finished_rows_leave_the_batch_without_changing_the_others(llama):
    """Greedy rows that stop at different steps (eos, a stop string, the length limit)
    generate in a batch what each generates alone."""
    from llmflow.infer.generator import load_generator

    gen = load_generator(llama)
    prompts = ["the cat sat", "green", "漢字 ü on a mat", "dogs ran over", "fish"]
    free = gen.run(prompts, GenerateConfig(max_new_tokens=20, eos_token_ids=[-1]))
    # Stop strings from two rows' texts, early in one and late in the other; an eos for a third.
    config = GenerateConfig(max_new_tokens=20, stop=[free[0].text[2:4], free[2].text[-3:-1]],
                            eos_token_ids=[free[3].tokens[10]])
    batched = gen.run(prompts, config)
    assert len({r.finish_reason for r in batched}) > 1 and len({len(r.tokens) for r in batched}) > 2
    alone = [gen.run([p], config)[0] for p in prompts]
    assert [(r.tokens, r.text, r.finish_reason) for r in batched] == [(r.tokens, r.text, r.finish_reason) for r in alone]


def test_cli_streams_a_templated_prompt(llama, capsys):
    from llmflow.cli import main
    from llmflow.data.templates import load_template
    from llmflow.infer.generator import load_generator

    main(["generate", "--model", str(llama), "--prompt", "hello", "--template", "chatml", "--stream", "--max-new-tokens", "8"])
    gen = load_generator(llama)
    rendered = load_template(llama, "chatml").render([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    expected = gen.run([gen.tokenizer.encode(rendered, add_special_tokens=False).ids], GenerateConfig(max_new_tokens=8))
    assert capsys.readouterr().out == expected[0].text + "\n"


@pytest.mark.parametrize("template", ["chatml", None])
def test_chat_says_which_model_and_template_it_loaded_and_how_to_leave(llama, tmp_path, monkeypatch, capsys, template):
    from llmflow.cli import main

    model = tmp_path / "model"
    shutil.copytree(llama, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
    main(["chat", "--model", str(model), *(["--template", template] if template else [])])
    captured = capsys.readouterr()
    which = template or f"the tokenizer's own ({model})"
    assert captured.err == (f"model: {model.resolve()}\nchat template: {which}\n"
                            "/exit or Ctrl-D quits, /reset starts a new conversation, Ctrl-C stops a reply\n")
    assert captured.out == "> "


def test_a_missing_prompt_is_one_line(llama):
    from llmflow.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["generate", "--model", str(llama)])
    assert stopped.value.code == "llmflow generate: give exactly one of --prompt and --prompts"


def test_chat_loop_keeps_history_and_resets(llama):
    from llmflow.data.templates import load_template
    from llmflow.infer.command import chat_loop
    from llmflow.infer.generator import load_generator

    gen, template = load_generator(llama), load_template(llama, "chatml")
    config = GenerateConfig(max_new_tokens=6)
    out = io.StringIO()
    history = chat_loop(gen, template, config, io.StringIO("hello\n/reset\nthe cat\ndogs ran\n/exit\nignored\n"), out)
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert [history[0]["content"], history[2]["content"]] == ["the cat", "dogs ran"]
    prompt = template.render(history[:3], add_generation_prompt=True)
    second = gen.run([gen.tokenizer.encode(prompt, add_special_tokens=False).ids], config)[0].text
    assert history[3]["content"] == second
    assert out.getvalue().endswith(f"> {second}\n> ")
    assert out.getvalue().count("> ") >= 4


@pytest.mark.slow
def test_the_compiled_decode_step_generates_the_eager_tokens(make_hf_model, prompt_ids):
    """``decode: compiled`` in fp32: torch.compile's step over the static KV cache, one graph
    without breaks, reused by a second batch of other prompt lengths in the same cache
    bucket, gives the tokens of the eager step over the growing cache, and the same results."""
    from torch._dynamo.utils import counters

    _, path = make_hf_model("llama", vocab_size=VOCAB, num_key_value_heads=2)
    add_tokenizer(path)
    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    config = GenerateConfig(max_new_tokens=16, eos_token_ids=[5])
    compiled = config.model_copy(update={"decode": "compiled"})
    shorter = [p[: max(1, len(p) // 2)] for p in prompt_ids]
    torch._dynamo.reset()
    counters.clear()
    for prompts in (prompt_ids, shorter):
        assert generate(model, tokenizer, prompts, compiled) == generate(model, tokenizer, prompts, config)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_decode_is_refused_for_linear_attention_layers(make_hf_model):
    from llmflow.infer.decode_step import compiles

    _, path = make_hf_model("qwen3_next", vocab_size=VOCAB, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4)
    model, _ = load_model(path)
    with pytest.raises(ValueError, match="linear-attention .Gated DeltaNet. layers.*decode: eager or auto"):
        compiles(model, "compiled", sharded=False)
    assert not compiles(model, "auto", sharded=False)
