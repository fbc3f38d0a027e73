"""``llmflow generate`` and ``llmflow chat``: load a model (HF directory, checkpoint or LoRA
checkpoint) with its tokenizer and stop tokens, then continue prompts or hold a conversation.
``llmflow generate --nproc N`` runs on N torchrun workers (``llmflow.infer.__main__``) with
the model tensor-parallel across them."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from pydantic import ConfigDict, Field, model_validator

from llmflow import runtime
from llmflow.cluster.nodes import NodeLayout, run_on_this_node
from llmflow.data.templates import ChatTemplate, Message, load_template
from llmflow.data.tokenizer import load_tokenizer
from llmflow.infer.batch import read_prompts
from llmflow.infer.generate import (
    GenerateConfig,
    GenerationResult,
    encode_prompts,
)
from llmflow.infer.generator import Generator, load_generator
from llmflow.mesh import ParallelLayout, layout_problems
from llmflow.models import ModelConfig
from llmflow.models.config import inference_tp_problems
from llmflow.train.memory import MemoryPlan, device_memory, generation_plan, generation_suggestions, refusal
from llmflow.weights import hf_config_of, is_checkpoint, read_meta, resolve_step_dir, tokenizer_dir

RESET, EXIT = "/reset", "/exit"


class GenerateCommand(GenerateConfig, NodeLayout):
    """Continue prompts with a model: raw text, or a user message in a chat template. On
    several nodes, run the same command on each (with its own --node-rank, or the same
    --rdzv-endpoint); node 0 (global rank 0) writes the output."""

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
    nproc: int = Field(default=1, ge=1)
    """Processes per node, one per device: above 1 (or on several nodes), generation runs on
    torchrun workers with the model's attention heads and FFN split across all of them
    (tensor parallelism), for models that do not fit one device (streamed text then arrives a
    line at a time). nproc x nnodes must divide the model's attention heads, key/value heads
    and FFN width."""

    @model_validator(mode="after")
    def _one_source(self) -> GenerateCommand:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("give exactly one of --prompt and --prompts")
        return self

    def cli_cmd(self) -> None:
        check_memory(self)
        if self.nproc > 1 or not self.standalone:
            launch_generate(self)
        else:
            run_generate(self, sys.stdout)


def _encoded(gen: Generator, texts: list[str], template: str | None) -> list[list[int]]:
    return _encode(gen.tokenizer, gen.tokenizer_dir, texts, template)


def _encode(tokenizer, tok_dir: Path, texts: list[str], template: str | None) -> list[list[int]]:
    if template is None:
        return encode_prompts(tokenizer, texts)
    chat = load_template(tok_dir, template)
    return encode_prompts(tokenizer, [chat.prompt(t) for t in texts], add_special_tokens=False)


def check_memory(command: GenerateCommand, report: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> None:
    """Refuse, before loading anything, a ``command`` whose per-device memory plan (weights, KV
    cache, the prompt's forward pass, logits; ``llmflow.train.memory``) does not fit a device,
    naming its largest term and the changes that fit; a launch of torchrun workers (``--nproc``
    above 1, several nodes) reports the plan first. One process reports nothing: a failing
    command there prints its one line."""
    tok_dir = tokenizer_dir(command.model)
    if tok_dir is None:
        return  # loading the model names what is missing
    texts = [command.prompt] if command.prompt is not None else read_prompts(command.prompts)
    lengths = [len(ids) for ids in _encode(load_tokenizer(tok_dir), tok_dir, texts, command.template)] or [1]
    config = ModelConfig.from_hf(hf_config_of(Path(command.model)))
    device_type = command.device.partition(":")[0]
    device_bytes, label = device_memory(device_type, command.nproc)
    model = Path(command.model)
    # Every worker loads a Hugging Face directory or a LoRA checkpoint whole before taking its shard.
    whole_on_host = device_type == "cpu" and (not is_checkpoint(model) or read_meta(resolve_step_dir(model)).lora is not None)
    batch, width = (1, max(lengths)) if command.stream else (len(lengths), max(lengths))

    def plan_of(tp: int, rows: int, new: int) -> MemoryPlan:
        return generation_plan(config, tp, rows, width, new, padded=rows > 1 and min(lengths) < width,
                               device_bytes=device_bytes, device_label=label, name=Path(command.model).name,
                               whole_on_host=whole_on_host)

    tp = command.nproc * command.nnodes
    plan = plan_of(tp, batch, command.max_new_tokens)
    if command.nproc > 1 or not command.standalone:
        report(plan.table())
    if not plan.fits:
        raise ValueError(refusal(plan, generation_suggestions(plan_of, config, tp, batch, command.max_new_tokens)))


def run_generate(command: GenerateCommand, out: TextIO, gen: Generator | None = None) -> list[GenerationResult]:
    """Run ``llmflow generate`` in this process, writing the replies to ``out``; ``gen`` is
    the model of ``command.model`` when already loaded (a tensor-parallel worker's shard)."""
    gen = gen or load_generator(command.model, command.device)
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


def check_nproc(command: GenerateCommand) -> None:
    """Refuse an ``nproc`` (times ``nnodes``) the model cannot be split into or the machine cannot run."""
    world = command.nproc * command.nnodes
    config = ModelConfig.from_hf(hf_config_of(Path(command.model)))
    problems = layout_problems(ParallelLayout(tp=world), world, config) + inference_tp_problems(config, world)
    available = runtime.device_count(command.device)
    if available is not None and command.nproc > available:
        problems.append(f"only {available} {command.device} devices are visible")
    problems += command.torchrun_problems()
    if problems:
        nodes = f" on {command.nnodes} nodes" if command.nnodes > 1 else ""
        raise ValueError(f"--nproc {command.nproc}{nodes} cannot run {command.model}: " + "; ".join(problems))


def launch_generate(command: GenerateCommand, on_line: Callable[[str], None] = print, env: dict[str, str] | None = None) -> None:
    """Run ``command`` on ``command.nproc`` torchrun workers on this node of its node layout,
    each line of rank 0's output going to ``on_line`` (streamed text therefore arrives a line
    at a time)."""
    check_nproc(command)
    with tempfile.TemporaryDirectory(prefix="llmflow-generate-") as tmp:
        config_path = Path(tmp) / "generate_config.json"
        config_path.write_text(command.model_dump_json(), encoding="utf-8")
        # The command is its own node layout.
        run_on_this_node("llmflow.infer", [str(config_path)], command.nproc, command, on_line=on_line, env=env)


def _write(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()


def chat_loop(gen: Generator, template: ChatTemplate, config: GenerateConfig, inp: TextIO, out: TextIO) -> list[Message]:
    """A conversation on ``inp``/``out``: each line is a user turn, answered as it is
    generated; ``/reset`` forgets the history, ``/exit`` or end of input (Ctrl-D) ends.
    Ctrl-C during a reply stops it and returns to the prompt (the turn is forgotten); Ctrl-C
    at the prompt raises KeyboardInterrupt after ending the line. Returns the history at the end."""
    history: list[Message] = []
    while True:
        _write(out, "> ")
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            _write(out, "\n")
            raise
        if not line or line.strip() == EXIT:
            return history
        if line.strip() == RESET:
            history = []
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        prompt = encode_prompts(gen.tokenizer, [template.render(history, add_generation_prompt=True)], False)
        try:
            reply = gen.run(prompt, config, on_text=lambda _, text: _write(out, text))[0]
            _write(out, "\n")
        except KeyboardInterrupt:
            history.pop()
            _write(out, "\n")
            continue
        history.append({"role": "assistant", "content": reply.text})


def chat_banner(model: Path, template: ChatTemplate, tokenizer_dir: Path) -> str:
    """What ``llmflow chat`` says before its first prompt: the model and chat template it
    loaded, and how to leave."""
    which = f"the tokenizer's own ({tokenizer_dir})" if template.name == "tokenizer" else template.name
    return (f"model: {model.expanduser().resolve()}\nchat template: {which}\n"
            f"{EXIT} or Ctrl-D quits, {RESET} starts a new conversation, Ctrl-C stops a reply\n")


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
        template = load_template(gen.tokenizer_dir, self.template)
        _write(sys.stderr, chat_banner(self.model, template, gen.tokenizer_dir))
        chat_loop(gen, template, config, sys.stdin, sys.stdout)
