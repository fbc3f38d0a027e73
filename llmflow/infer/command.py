"""``llmflow generate`` and ``llmflow chat``: load a model (HF directory, checkpoint or LoRA
checkpoint) with its tokenizer and stop tokens, then continue prompts or hold a conversation."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import ConfigDict, Field, model_validator

from llmflow.data.templates import ChatTemplate, Message, load_template
from llmflow.data.tokenizer import load_tokenizer, tokenizer_info
from llmflow.infer.generate import (
    GenerateConfig,
    GenerationResult,
    encode_prompts,
    generate,
)
from llmflow.model_loading import load_model, tokenizer_dir
from llmflow.models import CausalLM

RESET, EXIT = "/reset", "/exit"


@dataclass
class Generator:
    """A model ready to generate: weights, tokenizer and the ids that end a reply."""

    model: CausalLM
    tokenizer: Any
    tokenizer_dir: Path
    vocab_size: int
    """The model's real vocabulary (a checkpoint's padded rows are never sampled)."""
    eos_token_ids: list[int]

    def run(self, prompts: list[str] | list[list[int]], config: GenerateConfig, on_text=None) -> list[GenerationResult]:
        """``generate`` with this model's eos ids (unless the config names its own)."""
        config = config.model_copy(update={"eos_token_ids": config.eos_token_ids or self.eos_token_ids})
        return generate(self.model, self.tokenizer, prompts, config, on_text=on_text, vocab_size=self.vocab_size)


def eos_token_ids(tok_dir: Path, hf_config: dict[str, Any]) -> list[int]:
    """The eos_token_id (one id or a list) of generation_config.json beside the tokenizer
    (a checkpoint keeps it there), else of config.json, else the tokenizer's eos token."""
    generation = tok_dir / "generation_config.json"
    for source in (json.loads(generation.read_text()) if generation.is_file() else {}, hf_config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return eos if isinstance(eos, list) else [eos]
    eos = tokenizer_info(tok_dir).eos_token_id
    return [eos] if eos is not None else []


def load_generator(path: str | Path, device: str = "cpu") -> Generator:
    """The model in ``path`` with its tokenizer and eos ids, in eval mode."""
    model, hf_config = load_model(path, device)
    tok_dir = tokenizer_dir(path)
    if tok_dir is None:
        raise FileNotFoundError(f"model {path}: no tokenizer (tokenizer.json) beside it")
    return Generator(
        model=model.eval(),
        tokenizer=load_tokenizer(tok_dir),
        tokenizer_dir=tok_dir,
        vocab_size=int(hf_config["vocab_size"]),
        eos_token_ids=eos_token_ids(tok_dir, hf_config),
    )


def read_prompts(path: Path) -> list[str]:
    """Prompts of a .jsonl file (a "prompt" field per line) or a text file (one per line)."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        return [json.loads(line)["prompt"] for line in lines]
    return lines


class GenerateCommand(GenerateConfig):
    """Continue prompts with a model: raw text, or a user message in a chat template."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: Path
    """Hugging Face model directory, checkpoint (root or step directory) or LoRA checkpoint."""
    prompt: str | None = None
    """One prompt."""
    prompts: Path | None = None
    """A file of prompts: .jsonl with a "prompt" field per line, or text with one per line;
    the output is then one JSON line per prompt (the plain text of each with --stream)."""
    template: str | None = None
    """Render each prompt as a user message with this chat template ("tokenizer" for the
    tokenizer's own, or alpaca, chatml, qwen, llama2, llama3); none sends the raw text."""
    stream: bool = False
    """Print the text as it is generated, one line per prompt (prompts then run one at a time)."""
    device: str = "cpu"
    """Device to run on (cpu, cuda, npu)."""

    @model_validator(mode="after")
    def _one_source(self) -> GenerateCommand:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("give exactly one of --prompt and --prompts")
        return self

    def cli_cmd(self) -> None:
        run_generate(self, sys.stdout)


def _encoded(gen: Generator, texts: list[str], template: str | None) -> list[list[int]]:
    if template is None:
        return encode_prompts(gen.tokenizer, texts)
    chat = load_template(gen.tokenizer_dir, template)
    rendered = [chat.render([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    return encode_prompts(gen.tokenizer, rendered, add_special_tokens=False)


def run_generate(command: GenerateCommand, out: TextIO) -> list[GenerationResult]:
    """Run ``llmflow generate``, writing the replies to ``out``."""
    gen = load_generator(command.model, command.device)
    texts = [command.prompt] if command.prompt is not None else read_prompts(command.prompts)
    prompts = _encoded(gen, texts, command.template)
    config = GenerateConfig(**command.model_dump(include=set(GenerateConfig.model_fields)))
    if command.stream:
        results = []
        for prompt in prompts:
            results += gen.run([prompt], config, on_text=lambda _, text: _write(out, text))
            _write(out, "\n")
        return results
    results = gen.run(prompts, config)
    for text, result in zip(texts, results):
        if command.prompts is None:
            _write(out, result.text + "\n")
        else:
            _write(out, json.dumps({"prompt": text, "completion": result.text, "finish_reason": result.finish_reason}) + "\n")
    return results


def _write(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()


def chat_loop(gen: Generator, template: ChatTemplate, config: GenerateConfig, inp: TextIO, out: TextIO) -> list[Message]:
    """A conversation on ``inp``/``out``: each line is a user turn, answered as it is
    generated; ``/reset`` forgets the history, ``/exit`` or end of input ends. Returns the
    history at the end."""
    history: list[Message] = []
    while True:
        _write(out, "> ")
        line = inp.readline()
        if not line or line.strip() == EXIT:
            return history
        if line.strip() == RESET:
            history = []
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        prompt = encode_prompts(gen.tokenizer, [template.render(history, add_generation_prompt=True)], False)
        reply = gen.run(prompt, config, on_text=lambda _, text: _write(out, text))[0]
        _write(out, "\n")
        history.append({"role": "assistant", "content": reply.text})


class ChatCommand(GenerateConfig):
    """Chat with a model on the terminal (streamed replies; /reset, /exit)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: Path
    """Hugging Face model directory, checkpoint (root or step directory) or LoRA checkpoint."""
    template: str | None = None
    """Chat template: the tokenizer's own by default, or alpaca, chatml, qwen, llama2, llama3."""
    device: str = "cpu"
    """Device to run on (cpu, cuda, npu)."""
    max_new_tokens: int = Field(default=512, ge=1)
    """Most tokens per reply."""

    def cli_cmd(self) -> None:
        gen = load_generator(self.model, self.device)
        config = GenerateConfig(**self.model_dump(include=set(GenerateConfig.model_fields)))
        chat_loop(gen, load_template(gen.tokenizer_dir, self.template), config, sys.stdin, sys.stdout)
