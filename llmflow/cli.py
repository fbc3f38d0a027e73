"""The ``llmflow`` command line.

Each subcommand is a pydantic model whose fields (with their docstrings) are the options:
the same models serve as Prefect flow parameters, so the CLI help and the UI form say the
same thing.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from collections.abc import Sequence
from functools import partial

from pydantic import BaseModel, Field, ValidationError, create_model
from pydantic_settings import (
    BaseSettings,
    CliApp,
    CliSubCommand,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from llmflow.download import DownloadError
from llmflow.launch import WorkerError
from llmflow.validation import Location, dotted, one_line

# Each subcommand's model is imported only when that subcommand runs (every one of them for
# ``llmflow --help``): the models' modules import torch, torch.distributed.checkpoint or
# transformers, seconds of start-up that ``llmflow tokenize`` or ``llmflow eval`` need not pay.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "env": ("llmflow.envinfo:EnvCommand",
            "Show the devices, backends, dtypes and kernels llmflow would use here."),
    "demo": ("llmflow.demo:DemoCommand",
             "Run the finetune-and-eval flow on the built-in sample assets (offline, CPU-friendly)."),
    "flow": ("llmflow.flows.command:FlowCommands",
             "Run a flow here (finetune-eval, pretrain, evaluate, precision), its parameters the options."),
    "server": ("llmflow.server:ServerCommand",
               ("Start the Prefect server and UI, a worker, llmflow's deployments and the MLflow UI "
                "(loopback; Ctrl-C stops).")),
    "sample": ("llmflow.sample.assets:SampleCommand",
               "Write the built-in sample assets: tokenizer, tiny model, corpus, instructions, MMLU-style set."),
    "tokenize": ("llmflow.data.commands:TokenizeCommands",
                 "Tokenize text into training datasets (pretrain text, instruction data)."),
    "download": ("llmflow.download:DownloadCommand",
                 "Download a model or data set (Hugging Face Hub, ModelScope, local directory) with a manifest."),
    "convert": ("llmflow.weights.convert:ConvertCommand",
                ("Hugging Face model directory (or a Megatron-LM / MindSpeed-LLM checkpoint of it) -> training "
                 "checkpoint (DCP, vocabulary padded for tensor parallelism).")),
    "export": ("llmflow.weights.export:ExportCommand",
               ("Training checkpoint -> Hugging Face model directory (or PEFT adapter / merged LoRA model), "
                "or a Megatron-LM / MindSpeed-LLM checkpoint for --tp/--pp.")),
    "train": ("llmflow.train.command:TrainCommand",
              "Pretrain or finetune (full or LoRA) on torchrun workers; resumes from the run's last checkpoint."),
    "generate": ("llmflow.infer.command:GenerateCommand",
                 "Continue prompts with a model (greedy or sampled, streamed, optionally in a chat template)."),
    "chat": ("llmflow.infer.command:ChatCommand", "Chat with a model on the terminal (streamed replies; /reset, /exit)."),
    "eval": ("llmflow.evaluate.commands:EvalCommands", ("Evaluate a model on benchmarks (MMLU, C-Eval, CMMLU, BoolQ, AGIEval, GSM8K, BBH, "
                                                   "HumanEval).")),
    "probe": ("llmflow.probe.compare.command:ProbeCommands",
              "Debug precision: compare msprobe-format dumps of two runs (a training config's probe: option makes them)."),
    "cluster": ("llmflow.cluster.kubernetes:ClusterCommands",
                "Run on a cluster: render a Kubernetes training job's manifest (llmflow cluster render)."),
}


ROOT_NAME = "LLMFlow"
"""The name of the ``llmflow`` command's model, the title of the errors of its options."""


class _Root(BaseSettings):
    """llmflow: download, convert, tokenize, train, generate, evaluate and debug LLMs as
    Prefect flows on Ascend NPU, CUDA and CPU."""

    model_config = SettingsConfigDict(
        cli_prog_name="llmflow",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_enforce_required=True,
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, *args, **kwargs
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Options come from the command line only, never from stray environment variables.
        return (init_settings,)

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def _command_model(name: str) -> type[BaseModel]:
    module, _, attribute = SUBCOMMANDS[name][0].partition(":")
    return getattr(importlib.import_module(module), attribute)


def root_command(names: list[str] | None = None) -> type[BaseSettings]:
    """The ``llmflow`` command with the subcommands ``names`` (default: all of them)."""
    fields = {name.replace("-", "_"): (CliSubCommand[_command_model(name)], Field(description=SUBCOMMANDS[name][1]))
              for name in names or SUBCOMMANDS}
    root = create_model(ROOT_NAME, __base__=_Root, **fields)
    root.__doc__ = _Root.__doc__
    return root


# Bad input (a missing file, an invalid option or config value, an impossible layout, a
# truncated checkpoint, a device that is not there), the file system refusing a read or a
# write (OSError: permissions, a read-only or full disk), a failed download and failed
# workers are reported in one message, not as a Python traceback.
USER_ERRORS = (ValueError, OSError, DownloadError, SettingsError, WorkerError)
# errno values that only a write can meet: their message says so.
_WRITE_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def option_name(command: Sequence[str], location: Location) -> str:
    """The command-line option of a field of the ``llmflow`` command (``--slurm.poll-s``), its
    location stripped of the subcommand words ``command`` (``train``, ``eval boolq``) starts with."""
    words = [word.replace("-", "_") for word in command]
    depth = 0
    while depth < min(len(location), len(words)) and location[depth] == words[depth]:
        depth += 1
    rest = location[depth:]
    return "--" + dotted(rest).replace("_", "-") if rest else ""


def error_message(error: BaseException, command: Sequence[str] = ()) -> str:
    """The one-line message of a user error: for an OSError the file it concerns and why, for
    an invalid option the option (``command``: the words of the command line)."""
    if isinstance(error, SettingsError):
        return str(error.__cause__ or error)
    if isinstance(error, ValidationError):
        return one_line(error, partial(option_name, command) if error.title == ROOT_NAME else dotted)
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
        names = [args[0]] if args and args[0] in SUBCOMMANDS else None
        CliApp.run(root_command(names), cli_args=args or ["--help"])
    except USER_ERRORS as error:
        if os.environ.get("LLMFLOW_DEBUG"):
            raise
        sys.exit(f"llmflow {command}: {error_message(error, args)}")
    except KeyboardInterrupt:
        if os.environ.get("LLMFLOW_DEBUG"):
            raise
        print(f"llmflow {command}: interrupted", file=sys.stderr)
        sys.exit(130)  # the shell's status for a program ended by Ctrl-C (128 + SIGINT)


if __name__ == "__main__":
    main()
