"""Chat templates: one rendering path for training data, generation and evaluation.

A template is a Jinja chat template, the format Hugging Face tokenizers carry in
``tokenizer_config.json`` (``chat_template``). ``load_template`` picks the tokenizer's own
template by default, or a named one (``alpaca``, ``chatml``, ``qwen``, ``llama2``,
``llama3``) that reproduces the format its model family was trained with. Rendering
follows transformers' ``apply_chat_template``: a sandboxed environment with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, a non-escaping ``tojson`` and the
tokenizer's special tokens as variables.

``ChatTemplate.segments`` splits a conversation into prompt text (not trained) and
assistant text (trained). A template that marks the assistant's text with transformers'
``{% generation %}`` blocks is split at them, exactly as ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` splits it. Any other is split by rendering growing
prefixes of the conversation, which needs a template whose rendering of a conversation
starts with the rendering of each shorter prefix: every named template, Llama 3's, Qwen's,
Gemma 3's and GLM-4.5's. DeepSeek-V3's (its generation prompt opens a ``<think>`` the
rendered reply does not have) and gpt-oss's (a reply ends in ``<|return|>`` only when it is
the last) are not; their marked versions (TRL's ``deepseekv3_training.jinja``,
``gptoss_training.jinja``) are.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

# Qwen2-Instruct's template (a default system prompt when there is none).
QWEN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML without a default system prompt.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Meta-Llama-3-Instruct's template, with its begin-of-text token spelled out.
LLAMA3 = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = '<|begin_of_text|>' + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama-2-chat's template ([INST] ... [/INST], system prompt folded into the first turn).
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '<s>[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' </s>' }}{% endif %}"
    "{% endfor %}"
)

# Stanford Alpaca's prompt; each response ends with the tokenizer's eos token.
ALPACA = (
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{{ 'Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n' }}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '### Response:\n' + message['content'] + eos_token + '\n\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"
)

NAMED_TEMPLATES: dict[str, str] = {
    "alpaca": ALPACA,
    "chatml": CHATML,
    "qwen": QWEN,
    "llama2": LLAMA2,
    "llama3": LLAMA3,
}
TEMPLATE_CHOICES = ("tokenizer", *NAMED_TEMPLATES)

class TemplateError(ValueError):
    """A template that is missing, fails to render, or cannot split prompt from response."""


Message = dict[str, str]
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""transformers' mark of the assistant's text in a chat template (``{% generation %}``)."""


@lru_cache(maxsize=32)
def _compile(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker)
        renders its body unchanged."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the special tokens it is rendered with."""

    name: str
    """"tokenizer" for the tokenizer's own template, else the named template's name."""
    source: str
    """The Jinja source."""
    special_tokens: tuple[tuple[str, str], ...] = ()
    """(name, token) pairs passed to the template: bos_token, eos_token, pad_token, ..."""

    @property
    def digest(self) -> str:
        """sha256 of the source and special tokens: identifies the template in manifests."""
        payload = json.dumps([self.source, list(self.special_tokens)])
        return hashlib.sha256(payload.encode()).hexdigest()

    def render(self, messages: list[Message], add_generation_prompt: bool = False, **variables: Any) -> str:
        """The conversation as text, optionally followed by the assistant's turn header;
        ``variables`` are the template's own (``enable_thinking``), as ``apply_chat_template``
        passes its further keyword arguments."""
        import jinja2

        try:
            return _compile(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **(dict(self.special_tokens) | variables)
            )
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template {self.name!r}: {e}") from e

    def prompt(self, prompt: str | list[Message]) -> str:
        """A prompt as the model is asked it: plain text as the user's message (or a whole
        conversation), followed by the assistant's turn header."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.render(messages, add_generation_prompt=True)

    def segments(self, messages: list[Message]) -> list[tuple[str, bool]]:
        """``(text, trained)`` pieces whose concatenation is the rendered conversation up to
        its last assistant message: assistant replies (with the end-of-turn text the
        template puts after them) are trained, everything else is prompt. A template that
        marks what the assistant says with ``{% generation %}`` is split at its marks, as
        transformers' ``return_assistant_tokens_mask`` splits it; any other is split by
        rendering growing prefixes of the conversation."""
        if GENERATION_MARK.search(self.source):
            return self._marked_segments(messages)
        pieces: list[tuple[str, bool]] = []
        done = ""
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:k], add_generation_prompt=True)
            full = self.render(messages[: k + 1])
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise TemplateError(
                    f"chat template {self.name!r} does not render a conversation as an extension of "
                    "its earlier turns, so prompt and response tokens cannot be told apart; "
                    f"choose a named template ({', '.join(NAMED_TEMPLATES)}) or a template that marks "
                    "the assistant's text with {% generation %} (TRL's training templates do)"
                )
            pieces.append((prompt[len(done) :], False))
            pieces.append((full[len(prompt) :], True))
            done = full
        return pieces

    def _marked_segments(self, messages: list[Message]) -> list[tuple[str, bool]]:
        """The conversation rendered once by transformers, split at its ``{% generation %}`` blocks."""
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            (text,), (spans,) = render_jinja_template([messages], chat_template=self.source,
                                                      return_assistant_tokens_mask=True, **dict(self.special_tokens))
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template {self.name!r}: {e}") from e
        pieces: list[tuple[str, bool]] = []
        done = 0
        for start, end in spans:
            if end > start:
                pieces += [(text[done:start], False), (text[start:end], True)]
                done = end
        return [(piece, trained) for piece, trained in pieces if piece]


def tokenizer_config(tokenizer_dir: str | Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of a tokenizer directory ({} when there is none)."""
    path = Path(tokenizer_dir) / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def template_file(tokenizer_dir: str | Path) -> Path:
    """The file a tokenizer's own chat template is read from: ``chat_template.jinja`` where
    transformers (>= 4.43) saved it apart, else ``tokenizer_config.json``."""
    jinja_file = Path(tokenizer_dir) / "chat_template.jinja"
    return jinja_file if jinja_file.is_file() else Path(tokenizer_dir) / "tokenizer_config.json"


def _own_template(tokenizer_dir: Path, config: dict[str, Any]) -> str | None:
    path = template_file(tokenizer_dir)
    if path.suffix == ".jinja":
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named variants: [{"name": "default", "template": ...}, ...]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default")
    return template if isinstance(template, str) else None


def load_template(tokenizer_dir: str | Path, name: str | None = None) -> ChatTemplate:
    """The template to use with the tokenizer in ``tokenizer_dir``: ``name`` when given (a
    named template, or "tokenizer"), else the tokenizer's own, else an error that lists the
    named ones."""
    from llmflow.data.tokenizer import hf_tokenizer

    tokenizer_dir = Path(tokenizer_dir)
    config = tokenizer_config(tokenizer_dir)
    # The variables transformers' apply_chat_template renders with: the special tokens of
    # the tokenizer AutoTokenizer builds (its class may default some the config leaves out).
    special = tuple(hf_tokenizer(tokenizer_dir).special_tokens_map.items())
    if name not in (None, "tokenizer"):
        if name not in NAMED_TEMPLATES:
            raise TemplateError(f"unknown template {name!r}; expected one of {', '.join(TEMPLATE_CHOICES)}")
        special = (("bos_token", ""), ("eos_token", ""), *special)
        return ChatTemplate(name=name, source=NAMED_TEMPLATES[name], special_tokens=tuple(dict(special).items()))
    source = _own_template(tokenizer_dir, config)
    if source is None:
        raise TemplateError(
            f"tokenizer {tokenizer_dir} has no chat template (tokenizer_config.json chat_template or "
            f"chat_template.jinja); pass a named template: {', '.join(NAMED_TEMPLATES)}"
        )
    return ChatTemplate(name="tokenizer", source=source, special_tokens=special)
