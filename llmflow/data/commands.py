"""``llmflow tokenize``: the pretraining, instruction and preference tokenizers as one command group."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_settings import CliApp, CliSubCommand

from llmflow.data.tokenize_instruction import InstructionCommand
from llmflow.data.tokenize_preference import PreferenceCommand
from llmflow.data.tokenize_pretrain import PretrainCommand


class TokenizeCommands(BaseModel):
    """Tokenize text into training datasets."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    pretrain: CliSubCommand[PretrainCommand]
    """Pretraining text -> Megatron indexed dataset ({out}_text_document.bin/.idx)."""
    instruction: CliSubCommand[InstructionCommand]
    """Instruction data -> input_ids/labels indexed datasets ({out}_packed_*_document)."""
    preference: CliSubCommand[PreferenceCommand]
    """Preference pairs (chosen/rejected) -> input_ids/labels indexed datasets ({out}_packed_*_document)."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
