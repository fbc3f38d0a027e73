"""Prompts for chat models, built as lm-evaluation-harness 0.4.13 builds them
(``ConfigurableTask.fewshot_context``, ``build_qa_turn``, ``multiturn_to_singleturn``).

A prompt is a list of turns: a system turn with the system instruction and the task's
description (``maybe_delimit``: joined by the few-shot delimiter unless either side already
has whitespace at the join), then each few-shot example as a user turn (its question,
followed by the target delimiter in plain text) and an assistant turn (its answer, followed by
the few-shot delimiter), then the question as a user turn. Without a chat template the turns
are joined as plain text, which is the harness's plain prompt (the system instruction, when
given, comes first). With one, they are rendered by it with the generation prompt: as they
are (``fewshot_as_multiturn``, the harness's default with a chat template), or with everything
after the system turn joined as plain text into one user turn. Log-likelihood continuations
lose their target delimiter under a chat template (the harness's ``construct_requests``).

``enable_thinking`` and ``chat_template_args`` are passed to the template as variables, as
the harness's hf backend passes them to ``apply_chat_template``; ``think_end_token`` cuts a
generated text to what follows its last occurrence (``postprocess_generated_text``), or, given
as a token id, the generated tokens to those after its last occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmflow.data.templates import ChatTemplate, TemplateError, load_template, template_file

FEWSHOT_DELIMITER = "\n\n"
TARGET_DELIMITER = " "


class ChatSettings(BaseModel):
    """How prompts are put to a chat model (lm-evaluation-harness's names and defaults)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    apply_chat_template: bool = False
    """Render each prompt with the chat template (lm_eval --apply_chat_template): the system
    instruction and the task's description as the system message, the question as the user's,
    followed by the assistant's turn header."""
    template: str = "tokenizer"
    """The chat template applied: "tokenizer" for the tokenizer's own, or a named one (alpaca,
    chatml, qwen, llama2, llama3)."""
    fewshot_as_multiturn: bool | None = None
    """Few-shot examples as user/assistant turns of their own (lm_eval --fewshot_as_multiturn);
    off: one user message holds them and the question. Default: on with the chat template."""
    system_instruction: str | None = None
    """A system message before every prompt (lm_eval --system_instruction); without the chat
    template it starts the plain prompt."""
    enable_thinking: bool | None = None
    """The chat template's enable_thinking variable (Qwen3's thinking switch; lm_eval's hf
    model argument); needs think_end_token when true. Generative tasks only, as in the harness."""
    chat_template_args: dict[str, Any] = Field(default_factory=dict)
    """Further variables for the chat template (lm_eval's chat_template_args)."""
    think_end_token: str | None = None
    """Where a generated text's reasoning ends (</think>): only what follows its last occurrence
    is scored; digits name a token id instead (lm_eval's think_end_token)."""

    @model_validator(mode="after")
    def _consistent(self) -> ChatSettings:
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError("fewshot_as_multiturn=true needs apply_chat_template=true (few-shot turns are chat turns)")
        if self.enable_thinking and self.think_end_token is None:
            raise ValueError("enable_thinking=true needs think_end_token (</think> for Qwen3), which ends the "
                             "reasoning removed before the answer is extracted")
        if (self.enable_thinking is not None or self.chat_template_args) and not self.apply_chat_template:
            raise ValueError("enable_thinking and chat_template_args are chat template variables; set "
                             "apply_chat_template=true")
        if self.think_end_token == "":
            raise ValueError("think_end_token is empty; give the text (or token id) that ends the reasoning")
        return self

    @property
    def multiturn(self) -> bool:
        """Whether few-shot examples are turns of their own."""
        return self.apply_chat_template if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn

    def template_variables(self) -> dict[str, Any]:
        """The chat template's variables besides the messages (the harness's chat_template_args)."""
        return self.chat_template_args | ({} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking})


def check_loglikelihood(settings: ChatSettings, title: str) -> None:
    """Refuse thinking for a benchmark scored by log-likelihood, as the harness's hf backend does."""
    if settings.enable_thinking:
        raise ValueError(f"enable_thinking=true: {title} is scored by the log-likelihood of its answers, which "
                         "a model thinking first cannot be; lm-evaluation-harness allows it for generative tasks only")


@dataclass
class Turn:
    """One message of a prompt and the text that follows it when the prompt is plain text."""

    role: str
    content: str
    delimiter: str = ""

    def text(self) -> str:
        return self.content + self.delimiter


def maybe_delimit(prefix: str | None, suffix: str | None, delimiter: str) -> str:
    """``prefix`` and ``suffix`` joined by ``delimiter`` unless either has whitespace at the join."""
    if not prefix:
        return suffix or ""
    if not suffix:
        return prefix
    return prefix + suffix if prefix[-1].isspace() or suffix[0].isspace() else prefix + delimiter + suffix


@dataclass(frozen=True)
class Example:
    """A solved few-shot example as the task renders it."""

    question: str
    answer: str


def prompt_turns(system_instruction: str | None, description: str, examples: Sequence[Example], question: str,
                 target_delimiter: str = TARGET_DELIMITER, fewshot_delimiter: str = FEWSHOT_DELIMITER) -> list[Turn]:
    """The turns of one prompt (see the module)."""
    system = maybe_delimit(system_instruction, description, fewshot_delimiter)
    turns = [Turn("system", system)] if system else []
    for example in examples:
        turns += [Turn("user", example.question, target_delimiter), Turn("assistant", example.answer, fewshot_delimiter)]
    return [*turns, Turn("user", question)]


def plain_text(turns: Sequence[Turn]) -> str:
    """The turns as plain text."""
    return "".join(t.text() for t in turns)


def single_turn(turns: Sequence[Turn]) -> list[dict[str, str]]:
    """The system turn, then everything else as plain text in one user message."""
    system, rest = (turns[0], turns[1:]) if turns[0].role == "system" else (None, turns)
    user = {"role": "user", "content": "".join(t.text() for t in rest[:-1]) + rest[-1].content}
    return [{"role": "system", "content": system.content}, user] if system else [user]


class PromptRenderer:
    """Renders prompt turns under a run's chat settings."""

    @classmethod
    def for_model(cls, settings: ChatSettings, model: Path) -> PromptRenderer:
        """The renderer of ``settings`` with the chat template of ``model``'s tokenizer (read only
        when the template is applied)."""
        from llmflow.weights import tokenizer_dir

        return cls(settings, tokenizer_dir(model) if settings.apply_chat_template else None)

    def __init__(self, settings: ChatSettings, tokenizer_dir: Path | None) -> None:
        self.settings = settings
        self.tokenizer_dir = tokenizer_dir
        self.template: ChatTemplate | None = None
        if settings.apply_chat_template:
            if tokenizer_dir is None:
                raise FileNotFoundError("apply_chat_template: the model has no tokenizer (tokenizer_config.json) "
                                        "whose chat template could be applied")
            self.template = load_template(tokenizer_dir, settings.template)

    @property
    def chat(self) -> bool:
        return self.template is not None

    def continuation_delimiter(self, target_delimiter: str = TARGET_DELIMITER) -> str:
        """What separates a prompt from a scored continuation: nothing under a chat template."""
        return "" if self.chat else target_delimiter

    def prompt(self, description: str, examples: Sequence[Example], question: str, where: str,
               target_delimiter: str = TARGET_DELIMITER, fewshot_delimiter: str = FEWSHOT_DELIMITER) -> str:
        """One prompt's text from its parts (see the module); ``where`` names its task in errors."""
        turns = prompt_turns(self.settings.system_instruction, description, examples, question, target_delimiter,
                             fewshot_delimiter)
        return self.render(turns, where)

    def render(self, turns: list[Turn], where: str) -> str:
        """The prompt text; ``where`` names the prompt's task in errors."""
        if self.template is None:
            return plain_text(turns)
        messages = ([{"role": t.role, "content": t.content} for t in turns] if self.settings.multiturn
                    else single_turn(turns))
        try:
            return self.template.render(messages, add_generation_prompt=True, **self.settings.template_variables())
        except TemplateError as e:
            raise TemplateError(f"{where}: {self._source()} cannot render this prompt"
                                f"{self._system_field(turns)}: {e}") from None

    def _source(self) -> str:
        if self.template is not None and self.template.name != "tokenizer":
            return f"the named chat template {self.template.name!r}"
        return f"the chat template of {template_file(self.tokenizer_dir)}" if self.tokenizer_dir else "the chat template"

    def _system_field(self, turns: list[Turn]) -> str:
        """Where the prompt's system message comes from, for errors."""
        if turns[0].role != "system":
            return ""
        instruction = self.settings.system_instruction
        fields = (["system_instruction"] if instruction else []) + (
            ["the task's description"] if turns[0].content != (instruction or "") else [])
        return f" with a system message (from {' and '.join(fields)})"


PLAIN_PROMPTS = PromptRenderer(ChatSettings(), None)
"""The harness's default: plain-text prompts, no chat template."""
