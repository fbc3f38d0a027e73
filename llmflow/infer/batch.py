"""The inference stage: every prompt of a file through a model, in batches, into
``{out}/generations.jsonl`` (one line per prompt, in file order) with ``manifest.json``
written last.

Prompts come from a .jsonl file (a "prompt" string per line, or a "messages" list of
role/content turns for a chat template) or a text file (one prompt per line). The whole file
is read and checked, and the chat template loaded, before the model is. Prompts are grouped
into batches of similar length; left padding makes a batched row generate what it generates
alone, so greedy outputs do not depend on the grouping.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field

from llmflow.artifacts import (
    MANIFEST,
    atomic_directory,
    file_record,
    manifest_payload,
    write_json_atomic,
)
from llmflow.data.templates import ChatTemplate, Message, load_template
from llmflow.infer.generate import GenerateConfig, GenerationResult, encode_prompts
from llmflow.infer.generator import Generator, load_generator
from llmflow.runtime import detect_device_type, resolve_dtype
from llmflow.weights import tokenizer_dir

STAGE = "infer"
GENERATIONS = "generations.jsonl"

Prompt = str | list[Message]


class PromptFileError(ValueError):
    """A prompts file that cannot be read as prompts: names the file and line."""


class InferConfig(GenerateConfig):
    """Generate a continuation of every prompt of a file, in batches (the inference stage)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    model: Path
    """Hugging Face model directory, checkpoint (root or step directory) or LoRA checkpoint."""
    prompts: Path
    """.jsonl with a "prompt" string or a "messages" list of role/content turns per line, or a
    text file with one prompt per line."""
    out: Path
    """Output directory: generations.jsonl and manifest.json (replaced as a whole)."""
    template: str | None = None
    """Chat template: "tokenizer" for the tokenizer's own, or alpaca, chatml, qwen, llama2,
    llama3; a "prompt" becomes the user message. None sends "prompt" lines as raw text;
    "messages" lines always go through a template (then the tokenizer's own)."""
    batch_size: int = Field(default=8, ge=1)
    """Prompts generated together. Greedy outputs do not depend on it; sampled ones do (the
    sampler starts again from the seed for each batch)."""
    device: str = "auto"
    """cpu, cuda or npu; auto picks npu, then cuda, then cpu."""
    dtype: str = "auto"
    """Compute dtype: fp32, bf16, fp16, or auto (bf16 on accelerators that support it, fp32 on CPU)."""


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
        for turn in value
    )


def _line_prompt(record: Any, where: str, messages: bool) -> Prompt:
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    if messages and isinstance(record, dict) and _is_conversation(record.get("messages")):
        return record["messages"]
    wanted = 'a "prompt" string' + (' or a "messages" list of {"role": ..., "content": ...} strings' if messages else "")
    raise PromptFileError(f"{where}: expected {wanted}, got {json.dumps(record, ensure_ascii=False)[:200]}")


def read_prompts(path: Path, messages: bool = False) -> list[Prompt]:
    """The prompts of a .jsonl file (a "prompt" string per line, or with ``messages`` also a
    "messages" conversation) or a text file (one per line); blank lines are skipped. The
    first bad line is named with its file and number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path}: no such file")
    prompts: list[Prompt] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptFileError(f"{path} line {number}: not JSON ({error.msg})") from None
        prompts.append(_line_prompt(record, f"{path} line {number}", messages))
    if not prompts:
        raise PromptFileError(f"prompts file {path}: no prompts")
    return prompts


def _chat_template(config: InferConfig, prompts: list[Prompt]) -> ChatTemplate | None:
    """The template the prompts need (loaded from the model's tokenizer files), if any."""
    if config.template is None and all(isinstance(p, str) for p in prompts):
        return None
    tok_dir = tokenizer_dir(config.model)
    if tok_dir is None:
        raise FileNotFoundError(f"model {config.model}: no tokenizer (tokenizer.json) beside it")
    return load_template(tok_dir, config.template)


def encode(tokenizer, prompts: list[Prompt], template: ChatTemplate | None, wrap_text: bool) -> list[list[int]]:
    """Token ids of every prompt: a plain prompt as raw text with the tokenizer's special
    tokens, unless ``wrap_text``; otherwise the conversation (a plain prompt as its user
    message) rendered with ``template`` up to the assistant's turn header."""
    ids = []
    for p in prompts:
        if isinstance(p, str) and not wrap_text:
            ids += encode_prompts(tokenizer, [p])
        else:
            ids += encode_prompts(tokenizer, [template.prompt(p)], False)
    return ids


def generate_batches(gen: Generator, prompts: list[list[int]], config: GenerateConfig, batch_size: int) -> list[GenerationResult]:
    """``gen.run`` over batches of prompts of similar length (longest first); results in prompt order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    results: list[GenerationResult | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        for i, result in zip(batch, gen.run([prompts[i] for i in batch], config)):
            results[i] = result
    return results


def _record(index: int, prompt: Prompt, result: GenerationResult) -> str:
    record = {"index": index, "prompt": prompt, "output": result.text, "prompt_tokens": len(result.prompt_tokens),
              "generated_tokens": len(result.tokens), "finish_reason": result.finish_reason}
    return json.dumps(record, ensure_ascii=False) + "\n"


def run_inference(config: InferConfig) -> Path:
    """Generate for every prompt of ``config.prompts``; writes ``config.out`` and returns it."""
    prompts = read_prompts(config.prompts, messages=True)
    template = _chat_template(config, prompts)
    device_type = detect_device_type() if config.device == "auto" else config.device
    gen = load_generator(config.model, device_type)
    gen.model.to(resolve_dtype(config.dtype, device_type))
    encoded = encode(gen.tokenizer, prompts, template, wrap_text=config.template is not None)
    generation = GenerateConfig(**config.model_dump(include=set(GenerateConfig.model_fields)))
    start = time.monotonic()
    results = generate_batches(gen, encoded, generation, config.batch_size)
    seconds = time.monotonic() - start
    generated = sum(len(r.tokens) for r in results)
    out = Path(config.out).expanduser().resolve()
    with atomic_directory(out) as work:
        with open(work / GENERATIONS, "w", encoding="utf-8") as f:
            f.writelines(_record(i, p, r) for i, (p, r) in enumerate(zip(prompts, results)))
        counts = {"prompts": len(prompts), "prompt_tokens": sum(len(p) for p in encoded), "generated_tokens": generated,
                  "seconds": seconds, "tokens_per_s": generated / seconds if seconds else 0.0}
        files = [file_record(work / GENERATIONS, work)]
        write_json_atomic(work / MANIFEST, manifest_payload(STAGE, config.model_dump(mode="json"), files, **counts))
    return out
