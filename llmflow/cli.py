"""The ``llmflow`` command line.

Each subcommand is a pydantic model whose fields (with their docstrings) are the options:
the same models serve as Prefect flow parameters, so the CLI help and the UI form say the
same thing.
"""

from __future__ import annotations

import errno
import os
import sys

from pydantic import BaseModel, ConfigDict
from pydantic_settings import (
    BaseSettings,
    CliApp,
    CliSubCommand,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from llmflow.cluster.kubernetes import RenderCommand
from llmflow.convert import ConvertCommand
from llmflow.data.tokenize_instruction import InstructionCommand
from llmflow.data.tokenize_pretrain import PretrainCommand
from llmflow.demo import DemoCommand
from llmflow.download import DownloadCommand, DownloadError
from llmflow.envinfo import EnvCommand
from llmflow.evaluate.commands import CEvalCommand, CMMLUCommand, MMLUCommand
from llmflow.export import ExportCommand
from llmflow.infer.command import ChatCommand, GenerateCommand
from llmflow.launch import WorkerError
from llmflow.probe.compare.command import CompareCommand
from llmflow.sample import SampleCommand
from llmflow.server import ServerCommand
from llmflow.train.command import TrainCommand


class TokenizeCommands(BaseModel):
    """Tokenize text into training datasets."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    pretrain: CliSubCommand[PretrainCommand]
    """Pretraining text -> Megatron indexed dataset ({out}_text_document.bin/.idx)."""
    instruction: CliSubCommand[InstructionCommand]
    """Instruction data -> input_ids/labels indexed datasets ({out}_packed_*_document)."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class EvalCommands(BaseModel):
    """Evaluate models on benchmarks."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    mmlu: CliSubCommand[MMLUCommand]
    """MMLU accuracy with lm-evaluation-harness's prompts and scoring (results.json, predictions.jsonl)."""
    ceval: CliSubCommand[CEvalCommand]
    """C-Eval (val split) accuracy with lm-evaluation-harness's ceval-valid prompts and scoring."""
    cmmlu: CliSubCommand[CMMLUCommand]
    """CMMLU accuracy with lm-evaluation-harness's cmmlu prompts and scoring."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class ProbeCommands(BaseModel):
    """Debug precision with msprobe-format dumps."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    compare: CliSubCommand[CompareCommand]
    """Compare a dump against a benchmark dump (msprobe's metrics and results) and name the first divergence."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class ClusterCommands(BaseModel):
    """Run training workers on a cluster."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    render: CliSubCommand[RenderCommand]
    """Print a Kubernetes training job's manifest (TrainJob, PyTorchJob or Volcano Job) without submitting it."""

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class LLMFlow(BaseSettings):
    """llmflow: download, convert, tokenize, train, generate, evaluate and debug LLMs as
    Prefect flows on Ascend NPU, CUDA and CPU."""

    model_config = SettingsConfigDict(
        use_attribute_docstrings=True,
        cli_prog_name="llmflow",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_enforce_required=True,
    )

    env: CliSubCommand[EnvCommand]
    """Show the devices, backends, dtypes and kernels llmflow would use here."""
    demo: CliSubCommand[DemoCommand]
    """Run the finetune-and-eval flow on the built-in sample assets (offline, CPU-friendly)."""
    server: CliSubCommand[ServerCommand]
    """Start the Prefect server and UI, a worker, llmflow's deployments and the MLflow UI (loopback; Ctrl-C stops)."""
    sample: CliSubCommand[SampleCommand]
    """Write the built-in sample assets: tokenizer, tiny model, corpus, instructions, MMLU-style set."""
    tokenize: CliSubCommand[TokenizeCommands]
    """Tokenize text into training datasets (pretrain text, instruction data)."""
    download: CliSubCommand[DownloadCommand]
    """Download a model or data set (Hugging Face Hub, ModelScope, local directory) with a manifest."""
    convert: CliSubCommand[ConvertCommand]
    """Hugging Face model directory -> training checkpoint (DCP, vocabulary padded for tensor parallelism)."""
    export: CliSubCommand[ExportCommand]
    """Training checkpoint -> Hugging Face model directory (or PEFT adapter / merged LoRA model)."""
    train: CliSubCommand[TrainCommand]
    """Pretrain or finetune (full or LoRA) on torchrun workers; resumes from the run's last checkpoint."""
    generate: CliSubCommand[GenerateCommand]
    """Continue prompts with a model (greedy or sampled, streamed, optionally in a chat template)."""
    chat: CliSubCommand[ChatCommand]
    """Chat with a model on the terminal (streamed replies; /reset, /exit)."""
    eval: CliSubCommand[EvalCommands]
    """Evaluate a model on benchmarks (MMLU)."""
    probe: CliSubCommand[ProbeCommands]
    """Debug precision: compare msprobe-format dumps of two runs (a training config's probe: option makes them)."""
    cluster: CliSubCommand[ClusterCommands]
    """Run on a cluster: render a Kubernetes training job's manifest (llmflow cluster render)."""

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, *args, **kwargs
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Options come from the command line only, never from stray environment variables.
        return (init_settings,)

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


# Bad input (a missing file, an invalid option or config value, an impossible layout, a
# truncated checkpoint, a device that is not there), the file system refusing a read or a
# write (OSError: permissions, a read-only or full disk), a failed download and failed
# workers are reported in one message, not as a Python traceback.
USER_ERRORS = (ValueError, OSError, DownloadError, SettingsError, WorkerError)
# errno values that only a write can meet: their message says so.
_WRITE_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def error_message(error: BaseException) -> str:
    """The one-line message of a user error: for an OSError the file it concerns and why."""
    if isinstance(error, SettingsError):
        return str(error.__cause__ or error)
    if isinstance(error, OSError) and error.filename is not None:
        where = str(error.filename) + (f" -> {error.filename2}" if error.filename2 is not None else "")
        why = error.strerror or str(error)
        return f"cannot write {where}: {why}" if error.errno in _WRITE_ERRNOS else f"{where}: {why}"
    return str(error)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``llmflow`` console script (``LLMFLOW_DEBUG=1`` shows tracebacks)."""
    args = sys.argv[1:] if argv is None else argv
    command = " ".join(a for a in args[:2] if not a.startswith("-"))
    try:
        CliApp.run(LLMFlow, cli_args=args or ["--help"])
    except USER_ERRORS as error:
        if os.environ.get("LLMFLOW_DEBUG"):
            raise
        sys.exit(f"llmflow {command}: {error_message(error)}")
    except KeyboardInterrupt:
        if os.environ.get("LLMFLOW_DEBUG"):
            raise
        print(f"llmflow {command}: interrupted", file=sys.stderr)
        sys.exit(130)  # the shell's status for a program ended by Ctrl-C (128 + SIGINT)


if __name__ == "__main__":
    main()
